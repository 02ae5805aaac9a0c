"""Which environment a run trains: `environment.json` (config.env.EnvConfig.record(): name,
distribution, version, entry point, options), written in the run directory at a fresh start
(learner.resume) and beside every DeepSpeed checkpoint (learner.stepper); a resume whose environment differs is refused,
since its feeder position and buffered groups would index another environment's tasks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parley.runtime.durable import write_durable_text

FILE = "environment.json"


def write(directory: str | Path, record: dict[str, Any]) -> Path:
    # durable: a resume after a power cut reads it (an empty file stopped every --resume)
    return write_durable_text(Path(directory) / FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")


def read(directory: str | Path) -> dict[str, Any] | None:
    path = Path(directory) / FILE
    return json.loads(path.read_text()) if path.is_file() else None


def differs(run_dir: str | Path, record: dict[str, Any]) -> str:
    """Why `record` is not the environment the run in `run_dir` started with ("" if it is). A run
    directory without the file (written before environments were recorded) trained the default
    environment's bundled task, the only one there was: only that name is accepted, and the file is written."""
    started = read(run_dir)
    if started is None:
        from parley.config.env import DEFAULT_NAME as NAME

        if record.get("name") != NAME:
            return (
                f"{Path(run_dir) / FILE} is missing, so this run trained {NAME!r}; env.name={record.get('name')!r} "
                f"cannot resume it: set env.name={NAME!r}, or use another run directory for a fresh run"
            )
        write(run_dir, record)
        return ""
    keys = sorted(set(started) | set(record))
    changed = [f"{k} {started.get(k)!r} -> {record.get(k)!r}" for k in keys if started.get(k) != record.get(k)]
    if not changed:
        return ""
    return (
        f"the run started with environment {started.get('name')!r} ({Path(run_dir) / FILE}) and this config "
        f"differs: {'; '.join(changed)}. Resume with the [env] (and its package version) the run started with, "
        "or use another run directory for a fresh run"
    )
