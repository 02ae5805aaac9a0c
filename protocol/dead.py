"""Reading a run's DEAD stream back: dead letters by stream sequence, and which task (and sample)
a dead-lettered Task, Trajectory or Scored belonged to. Used by the learner (to learn that an issued
task will never become a group) and by the fleet eval (to stop waiting for lost conversations).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from nats.js.errors import NotFoundError

from parley.protocol import codec, topology
from parley.protocol.messages import DeadLetter


@dataclass(frozen=True)
class DeadRef:
    """What a dead letter says about the flow of one task."""

    key: str  # channel the original came from: "tasks" | "traj" | "scored"
    task_id: str
    sample: int | None  # None: the whole task (a dead Task); else the one sample that is lost
    message: object  # the decoded original (Task, Trajectory or Scored)


class _TaskRef(msgspec.Struct):
    """Just the identity fields, so a dead letter whose original fails its full type check (the very
    reason it may have been dead-lettered) still names its task."""

    task_id: str
    sample: int | None = None


async def read_since(js, run: str, seq: int) -> tuple[list[tuple[int, DeadLetter | None]], int]:
    """Dead letters of `run` from stream sequence `seq` on, as (seq, letter) pairs (None for one that
    does not decode), and the next sequence to read. Sequences the stream already discarded (limits)
    are skipped: a reader must have another way to learn of those (the learner's task deadline)."""
    name = topology.stream_name(run, "dead")
    state = (await js.stream_info(name)).state
    seq = max(seq, state.first_seq or 1)
    out: list[tuple[int, DeadLetter | None]] = []
    while seq <= state.last_seq:
        try:
            raw = await js.get_msg(name, seq)
        except NotFoundError:  # deleted or aged out meanwhile
            seq += 1
            continue
        try:
            out.append((seq, codec.decode("dead", raw.data)))
        except (msgspec.DecodeError, msgspec.ValidationError):
            out.append((seq, None))
        seq += 1
    return out, seq


def task_ref(run: str, dl: DeadLetter) -> DeadRef | None:
    """The task a dead letter of `run` is about, or None (another subject, or a payload too damaged
    to name its task)."""
    for key in ("tasks", "traj", "scored"):
        if dl.subject == topology.subject(run, key):
            break
    else:
        return None
    try:
        message = codec.decode(key, dl.payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        message = None
    try:
        ref = msgspec.msgpack.decode(dl.payload, type=_TaskRef)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    sample = None if key == "tasks" else ref.sample
    if key != "tasks" and sample is None:
        return None
    return DeadRef(key=key, task_id=ref.task_id, sample=sample, message=message)
