"""Scratch directories that do not outlive their process for long. A process removes its own on the
way out, but one that is killed (SIGKILL, the OOM killer, a crash of the interpreter) cannot: a
killed actor leaves its copy of the served weights in the temp directory (a model's size: 8 GB at the
4B shape in bf16), one more at every crash its supervisor restarts it from (the CI machine's count:
docs/benchmarks.md, "Observations behind the code"). So each scratch directory
names its host and process, `parley-<kind>-<host>-<pid>-<label>-<random>`, and making one first
removes every directory of that kind on this host whose process is gone.

A process id of another host, or of a live process (one that reused a dead one's id included), is
never touched; the host's name keeps machines that share one temp directory apart."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner(path: str | os.PathLike, kind: str) -> int | None:
    """The process id in the name of a scratch directory of `kind` made on this host, else None."""
    m = re.match(rf"^parley-{re.escape(kind)}-{re.escape(_host())}-(\d+)-", Path(path).name)
    return int(m.group(1)) if m else None


def sweep(kind: str, base: str | os.PathLike | None = None) -> list[Path]:
    """Remove the scratch directories of `kind` left on this host by processes no longer alive;
    returns what was removed."""
    root = Path(base or tempfile.gettempdir())
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for path in entries:
        pid = owner(path, kind)
        if pid is None or pid == os.getpid() or alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        log.info(
            "removed %d scratch director%s of %s left by processes that are gone: %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            kind,
            ", ".join(p.name for p in removed[:3]),
        )
    return removed


def scratch_dir(kind: str, label: str = "", base: str | os.PathLike | None = None) -> Path:
    """A new private directory `parley-<kind>-<host>-<pid>-<label>-<random>` in `base` (the temp
    directory), after sweeping those of `kind` whose process is gone. The caller removes it when done."""
    sweep(kind, base)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
    prefix = f"parley-{kind}-{_host()}-{os.getpid()}-" + (f"{safe}-" if safe else "")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
