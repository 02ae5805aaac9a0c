"""Named kill points: `PARLEY_KILL_AT=<point>[:<n>]` makes the process SIGKILL itself the n-th time
(1 when not given) it reaches the named point, so a crash-consistency test kills the learner exactly
where the resume table of docs/learner.md says, instead of at a random moment. Read once, by `arm()`
at the learner's start; with the variable unset every `reached()` is a dictionary miss and nothing
else. SIGKILL, not an exception or sys.exit: no `finally`, no atexit, no buffered write flushed, as
when the kernel's OOM killer or a node loss ends the process.

The points are listed in POINTS with what the process has done when it dies there; `reached(name)`
with a name not listed is a programming error (KeyError), so the table and the code cannot drift.
"""

from __future__ import annotations

import logging
import os
import signal

from parley.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "PARLEY_KILL_AT"

POINTS = {
    "held": "a Scored sample is buffered and its message held unacked; no ledger write records it yet",
    "acks": "a ledger write is durable; the messages it records are not acked yet",
    "step": "the step's groups are taken and their attempt is in the ledger; training has not begun",
    "published": "the step is trained (a ledger write took its attempt back) and its weights version handed to the publisher; no checkpoint yet",
    "checkpoint_write": "the DeepSpeed checkpoint files are written but not fsynced; the ledger names the previous one",
    "checkpoint": "the checkpoint is durable; the step's trained.jsonl line, archive and ledger write are not",
    "archive": "the step's trained.jsonl line and archive are durable; its ledger write is not",
    "ledger": "the step's ledger write is done and its messages acked; older checkpoints not pruned yet",
    "upload": "a weights upload has stored chunks in the object store, and no meta names them",
}

_armed: tuple[str, int] | None = None
_count = 0


class KillPointError(ConfigError):
    """PARLEY_KILL_AT names no point, or a count that is not a positive integer."""


def parse(value: str) -> tuple[str, int] | None:
    """`point` or `point:n` -> (point, n); "" -> None."""
    value = value.strip()
    if not value:
        return None
    name, _, n = value.partition(":")
    if name not in POINTS:
        raise KillPointError(f"{ENV}={value!r}: no kill point {name!r}; use one of {', '.join(POINTS)} (or unset it)")
    if n and (not n.isdigit() or int(n) < 1):
        raise KillPointError(f"{ENV}={value!r}: the count after ':' must be a positive integer, e.g. {name}:2")
    return name, int(n or 1)


def arm(environ=os.environ) -> None:
    """Read PARLEY_KILL_AT once (the learner's start calls it); raises KillPointError on a bad value."""
    global _armed, _count
    _armed, _count = parse(environ.get(ENV, "")), 0
    if _armed is not None:
        log.warning("%s: this process kills itself at %r, the %d-th time it gets there", ENV, *_armed)


def armed(point: str) -> bool:
    """PARLEY_KILL_AT names `point` (for a hook to be connected only then)."""
    return _armed is not None and _armed[0] == point


def reached(point: str) -> None:
    """The process is at `point`: SIGKILL itself if PARLEY_KILL_AT names it and this is the n-th time."""
    global _count
    POINTS[point]  # noqa: B018 - an unlisted name is a bug here, not a silent no-op
    if _armed is None or _armed[0] != point:
        return
    _count += 1
    if _count < _armed[1]:
        return
    # straight to fd 2: a logging handler's buffer would die with the process
    os.write(2, f"{ENV}: killed at {point} ({POINTS[point]})\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
