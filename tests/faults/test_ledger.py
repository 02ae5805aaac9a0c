"""The fault suite's books (`settle`) on hand-made inputs: they must see a lost sample, a sample
trained twice, a ledger that disagrees with trained.jsonl, a poison task that no actor refused, a
task the learner gave up without a reason or kept in flight after reading its dead letter, or a
clean run proves nothing. Pure unit tests (no server, no model), so they run in the default CI command."""

from __future__ import annotations

import msgspec

from parley.learner.checkpoint import LearnerState
from parley.protocol import codec, examples
from parley.protocol.messages import DeadLetter
from tests.faults.chaos import reason_kind, settle


def tasks(n_tasks: int = 4, n: int = 2):
    return [msgspec.structs.replace(examples.task("r", f"r-g{i:06d}"), n=n) for i in range(n_tasks)]


def letter(subject: str, payload: bytes, reason: str, consumer: str = "actor-0") -> DeadLetter:
    return DeadLetter(subject=subject, reason=reason, consumer=consumer, payload=payload)


def poison() -> dict[str, bytes]:
    return {
        "n": codec.encode(msgspec.structs.replace(examples.task("r", "poison-n"), n=5000)),
        "other run": codec.encode(examples.task("elsewhere", "poison-run")),
        "undecodable": b"\xc1 not a task",
    }


def test_every_sample_accounted_for():
    lines = [
        {"step": 1, "traj_ids": ["r-g000000/0", "r-g000000/1"], "not_trained": {"r-g000001": "zero advantage: 0.5"}}
    ]
    state = LearnerState(
        step=1, done={"r-g000000": "trained", "r-g000001": "zero_advantage"}, in_flight=["r-g000002", "r-g000003"]
    )
    dead = [(1, letter("parley.r.tasks", codec.encode(tasks()[3]), "task r-g000003: n=0 must be >= 1"))]
    led = settle(tasks(), dead, lines, state, buffered_ids={"r-g000002/0"}, unacked_ids={"scored": {"r-g000002/1"}})
    assert (led.tasks, led.samples, led.trained, led.steps) == (4, 8, 2, 1)
    assert led.dropped == {"zero_advantage": 2} and led.reasons["r-g000001"] == "zero advantage: 0.5"
    assert led.dead == {"tasks": 2} and "n=0" in led.reasons["r-g000003"]
    assert sum(led.pending.values()) == 2
    assert led.fates == {"trained": 1, "dropped": 1, "dead": 1, "waiting": 1}
    assert led.lost == [] and led.trained_twice == [] and led.inconsistent == []


def test_lost_twice_and_inconsistent_are_caught():
    lines = [
        {"step": 1, "traj_ids": ["r-g000000/0", "r-g000000/1"]},
        {"step": 2, "traj_ids": ["r-g000000/1", "r-g000001/0"]},
        {"step": 3, "traj_ids": ["r-g000099/0"]},
    ]
    state = LearnerState(step=2, done={"r-g000000": "trained"}, in_flight=["r-g000001"])
    led = settle(tasks(2), [], lines, state, buffered_ids=set(), unacked_ids={})
    assert led.trained_twice == ["r-g000000/1"]
    assert led.lost == ["r-g000001/1 (task unknown to the learner)"]
    assert led.fates == {"trained": 1, "lost": 1}
    assert any("steps [1, 2, 3]" in x for x in led.inconsistent)  # trained.jsonl ahead of the ledger
    assert any("r-g000001/0" in x and "ledger says None" in x for x in led.inconsistent)
    assert any("r-g000099/0" in x and "never published" in x for x in led.inconsistent)


def test_tasks_the_learner_gave_up_are_dropped_with_its_reason_not_lost():
    # one sample of r-g000000 dead-lettered by the scorer: the learner gives the whole task up; the
    # other sample (acked, no longer buffered) would otherwise count as lost. r-g000001 passed its deadline.
    dead = [
        (
            1,
            letter(
                "parley.r.traj",
                codec.encode(examples.trajectory("r", "r-g000000", 0)),
                "judge failed",
                consumer="scorer-0",
            ),
        )
    ]
    state = LearnerState(
        step=0,
        done={"r-g000000": "dead", "r-g000001": "deadline"},
        dead_seq=2,
        reasons={
            "r-g000000": "dead: sample 0 was dead-lettered by scorer-0 (traj): judge failed",
            "r-g000001": "deadline: 0/2 samples 7300s after it was issued",
        },
    )
    led = settle(tasks(2), dead, [], state, buffered_ids=set(), unacked_ids={})
    assert led.lost == [] and led.inconsistent == []
    assert led.dropped == {"dead": 2, "deadline": 2} and led.fates == {"dropped": 2}
    assert led.reasons["r-g000001"].startswith("deadline: 0/2 samples")


def test_a_drop_without_a_recorded_reason_is_caught():
    state = LearnerState(step=0, done={"r-g000000": "timeout"}, in_flight=["r-g000001"])
    led = settle(tasks(2), [], [], state, buffered_ids={"r-g000001/0", "r-g000001/1"}, unacked_ids={})
    assert led.lost == []
    assert led.inconsistent == ["task r-g000000 dropped as 'timeout' without a recorded reason"]


def test_a_dead_letter_the_learner_read_must_have_freed_its_task():
    # The learner read DEAD up to sequence 3 (dead_seq=3): the letter at 1 about r-g000000's Task and
    # the one at 2 about sample 1 of r-g000001 should have finished both; r-g000001 is still in flight
    # with only sample 0 buffered, so its slot is held for good. r-g000002's letter (sequence 3) came
    # after the learner's last read: dead-lettered, not an inconsistency. r-g000003 has a complete
    # group buffered, which trains as it is whatever the letter says.
    t = tasks()
    dead = [
        (1, letter("parley.r.tasks", codec.encode(t[0]), "task r-g000000: max_tokens=9999 exceeds 1024")),
        (2, letter("parley.r.traj", codec.encode(examples.trajectory("r", "r-g000001", 1)), "judge failed")),
        (3, letter("parley.r.tasks", codec.encode(t[2]), "delivered 6 times (max_deliver=5)")),
        (2, letter("parley.r.tasks", codec.encode(t[3]), "delivered 6 times (max_deliver=5)")),
    ]
    state = LearnerState(
        step=0,
        done={"r-g000000": "dead"},
        dead_seq=3,
        in_flight=["r-g000001", "r-g000002", "r-g000003"],
        reasons={"r-g000000": "dead: its Task was dead-lettered by actor-0 (tasks): ..."},
    )
    buffered = {"r-g000001/0", "r-g000003/0", "r-g000003/1"}
    led = settle(t, dead, [], state, buffered_ids=buffered, unacked_ids={})
    assert len(led.inconsistent) == 1 and "still holds task r-g000001 in flight" in led.inconsistent[0]
    assert led.fates == {"dropped": 1, "dead": 2, "waiting": 1}


def test_a_task_the_learner_never_recorded_is_caught():
    state = LearnerState(step=0, in_flight=["r-g000000"])
    led = settle(tasks(2), [], [], state, buffered_ids=set(), unacked_ids={"tasks": {"r-g000000", "r-g000001"}})
    assert led.lost == []
    assert led.inconsistent == ["task r-g000001 is in TASKS but the learner's ledger neither issued nor finished it"]


def test_poison_tasks_must_be_in_dead_and_are_not_counted_as_issued():
    p = poison()
    published = tasks(1) + [codec.decode("tasks", p["n"]), codec.decode("tasks", p["other run"]), None]
    dead = [
        (1, letter("parley.r.tasks", p["n"], "task poison-n: n=5000 exceeds 1024 (the most a task may ask)")),
        (2, letter("parley.r.tasks", p["undecodable"], "decode error: MessagePack data is malformed")),
    ]
    state = LearnerState(step=0, in_flight=["r-g000000"])
    led = settle(published, dead, [], state, buffered_ids={"r-g000000/0", "r-g000000/1"}, unacked_ids={}, poison=p)
    assert (led.tasks, led.samples) == (1, 2)  # the poison is not an issued task
    assert led.poison == {"n": dead[0][1].reason, "undecodable": dead[1][1].reason}
    assert led.poison_missing == ["other run"]  # nobody refused it: the books say so
    assert led.dead_reasons == {"n=N exceeds N": 1, "decode error": 1}
    assert led.lost == [] and led.inconsistent == []


def test_reason_kind_drops_what_differs_per_message():
    assert (
        reason_kind(
            "task chaos-g000003: max_new_turns=1000000 exceeds 1000 (the most a task may ask); lower "
            "[rollout] max_new_turns"
        )
        == "max_new_turns=N exceeds N"
    )
    assert reason_kind("delivered 6 times (max_deliver=5); last error: x") == "delivered N times"
    assert (
        reason_kind("task poison-run belongs to run 'elsewhere', not 'chaos'")
        == "task poison-run belongs to run 'elsewhere', not 'chaos'"
    )


def test_a_slot_held_past_its_deadline_is_caught():
    from parley.learner.checkpoint import IssuedTask

    state = LearnerState(
        step=0,
        in_flight=["r-g000000", "r-g000001"],
        saved=10_000.0,
        issued=[
            IssuedTask(task_id="r-g000000", at=10_000.0 - 7300, version=0),
            IssuedTask(task_id="r-g000001", at=10_000.0 - 60, version=0),
        ],
    )
    led = settle(
        tasks(2),
        [],
        [],
        state,
        buffered_ids=set(),
        unacked_ids={"tasks": {"r-g000000", "r-g000001"}},
        task_deadline_s=7200,
    )
    assert led.past_deadline == ["r-g000000 (7300s)"] and led.lost == []
    assert (
        settle(
            tasks(2),
            [],
            [],
            state,
            buffered_ids=set(),
            unacked_ids={"tasks": {"r-g000000", "r-g000001"}},
            task_deadline_s=None,
        ).past_deadline
        == []
    )


def test_tasks_under_the_ledgers_watermark_count_as_trained():
    # read_state gives done as a Finished: tasks under done_below have no entry (trained), those the
    # reasons log names have their kind; before, settle called every trained task under it inconsistent
    from parley.learner.groups import Finished

    lines = [{"step": 1, "traj_ids": ["r-g000000/0", "r-g000000/1"], "not_trained": {"r-g000001": "zero advantage"}}]
    state = LearnerState(step=1, done=Finished("r-g", 2, {"r-g000001": "zero_advantage"}), in_flight=[])
    led = settle(tasks(2), [], lines, state, buffered_ids=set(), unacked_ids={})
    assert led.inconsistent == [] and led.lost == []
    assert led.fates == {"trained": 1, "dropped": 1} and led.trained == 2
