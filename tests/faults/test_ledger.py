"""The fault suite's books (`settle`) on hand-made inputs: they must see a lost sample, a sample
trained twice and a ledger that disagrees with trained.jsonl, or a clean run proves nothing.
Pure unit tests (no server, no model), so they run in the default CI command."""

from __future__ import annotations

import msgspec

from learner.checkpoint import LearnerState
from protocol import codec, examples
from protocol.messages import DeadLetter
from tests.faults.chaos import settle


def tasks(n_tasks: int = 4, n: int = 2):
    return [msgspec.structs.replace(examples.task("r", f"r-g{i:06d}"), n=n) for i in range(n_tasks)]


def test_every_sample_accounted_for():
    lines = [{"step": 1, "traj_ids": ["r-g000000/0", "r-g000000/1"],
              "not_trained": {"r-g000001": "zero advantage: 0.5"}}]
    state = LearnerState(step=1, done={"r-g000000": "trained", "r-g000001": "zero_advantage"})
    dead = [DeadLetter(subject="parley.r.tasks", reason="task r-g000003: n=0 must be >= 1", consumer="actor-0",
                       payload=codec.encode(tasks()[3]))]
    led = settle(tasks(), dead, lines, state, buffered_ids={"r-g000002/0"}, unacked_ids={"scored": {"r-g000002/1"}})
    assert (led.tasks, led.samples, led.trained, led.steps) == (4, 8, 2, 1)
    assert led.dropped == {"zero_advantage": 2} and led.reasons["r-g000001"] == "zero advantage: 0.5"
    assert led.dead == {"tasks": 2} and "n=0" in led.reasons["r-g000003"]
    assert sum(led.pending.values()) == 2
    assert led.lost == [] and led.trained_twice == [] and led.inconsistent == []


def test_lost_twice_and_inconsistent_are_caught():
    lines = [{"step": 1, "traj_ids": ["r-g000000/0", "r-g000000/1"]},
             {"step": 2, "traj_ids": ["r-g000000/1", "r-g000001/0"]},
             {"step": 3, "traj_ids": ["r-g000099/0"]}]
    state = LearnerState(step=2, done={"r-g000000": "trained"})
    led = settle(tasks(2), [], lines, state, buffered_ids=set(), unacked_ids={})
    assert led.trained_twice == ["r-g000000/1"]
    assert led.lost == ["r-g000001/1 (task unknown to the learner)"]
    assert any("steps [1, 2, 3]" in x for x in led.inconsistent)  # trained.jsonl ahead of the ledger
    assert any("r-g000001/0" in x and "ledger says None" in x for x in led.inconsistent)
    assert any("r-g000099/0" in x and "never published" in x for x in led.inconsistent)


def test_tasks_the_learner_gave_up_are_dropped_with_its_reason_not_lost():
    # one sample of r-g000000 dead-lettered by the scorer: the learner gives the whole task up; the
    # other sample (acked, no longer buffered) would otherwise count as lost. r-g000001 passed its deadline.
    dead = [DeadLetter(subject="parley.r.traj", reason="judge failed", consumer="scorer-0",
                       payload=codec.encode(examples.trajectory("r", "r-g000000", 0)))]
    state = LearnerState(step=0, done={"r-g000000": "dead", "r-g000001": "deadline"},
                         reasons={"r-g000000": "dead: sample 0 was dead-lettered by scorer-0 (traj): judge failed",
                                  "r-g000001": "deadline: 0/2 samples 7300s after it was issued"})
    led = settle(tasks(2), dead, [], state, buffered_ids=set(), unacked_ids={})
    assert led.lost == [] and led.inconsistent == []
    assert led.dropped == {"dead": 2, "deadline": 2}
    assert led.reasons["r-g000001"].startswith("deadline: 0/2 samples")
