"""What the bench scripts share: running their async main on uvloop (as every role does), and printing
the header, the table and the optional JSON. Nothing in parley imports bench/."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from pathlib import Path


def run(coro_fn, *args):
    """(result, seconds) of `coro_fn(*args)` on uvloop, or asyncio where uvloop is missing."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    t0 = time.perf_counter()
    result = runner(coro_fn(*args))
    return result, time.perf_counter() - t0


def report(title: str, details: str, seconds: float, table: str, data, json_path: Path | None) -> None:
    """`title: <cores> cores, <python>, <details>, <seconds> s`, the table, and the data as JSON if asked."""
    print(f"{title}: {os.cpu_count()} cores, {platform.python_version()}, {details}, {seconds:.0f} s")
    print(table)
    if json_path:
        json_path.write_text(json.dumps(data, indent=1, default=str))
