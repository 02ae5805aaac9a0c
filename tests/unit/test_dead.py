"""protocol.dead.task_ref: which task a dead letter is about, also when its payload is damaged."""

from __future__ import annotations

import msgspec

from parley.protocol import codec, topology
from parley.protocol.dead import task_ref
from parley.protocol.messages import DeadLetter, Task
from tests.unit.test_groups import scored


def letter(key: str, payload: bytes, run: str = "r") -> DeadLetter:
    return DeadLetter(subject=topology.subject(run, key), reason="because", consumer="c", payload=payload)


def test_a_dead_task_names_the_whole_task_and_a_dead_sample_its_index():
    task = Task(task_id="r-g000003", run="r", item_id="i", n=4)
    ref = task_ref("r", letter("tasks", codec.encode(task)))
    assert (ref.key, ref.task_id, ref.sample, ref.message) == ("tasks", "r-g000003", None, task)
    s = scored("r-g000003", 2, 0.5)
    for key, msg in (("traj", s.trajectory), ("scored", s)):
        ref = task_ref("r", letter(key, codec.encode(msg)))
        assert (ref.key, ref.task_id, ref.sample) == (key, "r-g000003", 2)


def test_a_payload_that_fails_its_type_check_still_names_its_task():
    # dead-lettered for a decode error: n is not an int, yet task_id is there
    bad = msgspec.msgpack.encode({"task_id": "r-g000001", "run": "r", "item_id": "i", "n": "four"})
    ref = task_ref("r", letter("tasks", bad))
    assert (ref.task_id, ref.sample, ref.message) == ("r-g000001", None, None)


def test_letters_of_other_runs_and_channels_or_without_an_identity_are_not_about_a_task():
    task = codec.encode(Task(task_id="x-g000001", run="x", item_id="i", n=2))
    assert task_ref("r", letter("tasks", task, run="x")) is None
    assert task_ref("r", letter("eval", task)) is None
    assert task_ref("r", letter("tasks", b"\xc1 not msgpack")) is None
    assert task_ref("r", letter("traj", msgspec.msgpack.encode({"task_id": "r-g000001"}))) is None  # which sample?
