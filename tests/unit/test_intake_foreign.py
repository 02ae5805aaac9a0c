"""The intake's decision on a Scored by its task (learner.intake.Intake.foreign / on_scored): a task in
flight (issued, being published, restored by --resume), buffered or finished is this learner's; any
other is refused with a reason that names the option, counted, unless accept_foreign."""

from __future__ import annotations

import asyncio

import pytest

from parley.learner import checkpoint as ckpt
from parley.learner import envrecord
from parley.learner.feeder import Issued, task_id
from parley.learner.groups import Grouper
from parley.learner.intake import FOREIGN, Intake
from parley.learner.resume import restore
from parley.learner.runstate import RunState
from parley.protocol.bus import Poison
from tests.unit.test_groups import scored
from tests.unit.test_learner_clock import _NoSteps, feeder


def intake(tmp_path, *, accept_foreign=False, fs=None, grouper=None) -> Intake:
    g = grouper or Grouper(3, max_staleness=0, stale_policy="drop", timeout_s=600.0)
    g.done.prefix = "r1-g"
    return Intake(
        RunState(steps=0),
        g,
        feeder(fs),
        ckpt.Ledger(tmp_path),
        limits=(100, None),
        reference_service=False,
        ack_wait_s=30.0,
        flush_s=1.0,
        started=0.0,
        accept_foreign=accept_foreign,
    )


class MsgDouble:
    """Stands in for a nats Msg: the intake only keeps it for the ack."""


def test_only_tasks_this_learner_issued_are_let_in(tmp_path):
    i = intake(tmp_path)
    issued, finished = task_id("r1", 0), task_id("r1", 2)
    i.feeder.state.in_flight[issued] = Issued(at=0.0, version=0)
    i.grouper.done[finished] = "trained"
    i.feeder.publishing = task_id("r1", 3)  # its samples may in principle beat the store's ack
    for t in (issued, finished, task_id("r1", 3)):
        assert i.foreign(t) == "", t
    i.grouper.done.below = 1  # under the watermark: finished too
    assert i.foreign(task_id("r1", 0)) == ""
    for t in (task_id("r1", 4), "r2-g000000", "anything"):
        why = i.foreign(t)
        assert why.startswith(FOREIGN) and repr(t) in why and "accept_foreign_scored = true" in why


def test_a_foreign_sample_is_refused_and_counted_or_let_in_under_the_option(tmp_path):
    i = intake(tmp_path)
    with pytest.raises(Poison, match=FOREIGN):
        asyncio.run(i.on_scored(scored("r1-g000009", 0, 0.1), MsgDouble()))
    assert i.state.counters["scored.foreign"] == 1 and not i.grouper.buffer and not i.pending

    i = intake(tmp_path, accept_foreign=True)
    asyncio.run(i.on_scored(scored("r1-g000009", 0, 0.1), MsgDouble()))
    asyncio.run(i.on_scored(scored("r1-g000009", 1, 0.1), MsgDouble()))
    assert i.state.counters["scored.foreign_accepted"] == 2 and "r1-g000009" in i.grouper.buffer


def test_tasks_in_flight_before_a_crash_are_in_flight_after_resume(tmp_path, monkeypatch):
    """The ledger's in-flight tasks, its buffered groups and the groups trained after the last
    checkpoint (put back in flight) stay this learner's after --resume."""
    before = intake(tmp_path)
    t0, t1, t2 = task_id("r1", 0), task_id("r1", 1), task_id("r1", 2)
    before.feeder.state.in_flight[t0] = Issued(at=0.0, version=0)
    before.feeder.state.in_flight[t1] = Issued(at=0.0, version=0)
    before.feeder.state.next_index = 3
    before.grouper.add(scored(t1, 0, 0.1))
    trained = Grouper(3, max_staleness=0, stale_policy="drop", timeout_s=600.0)
    for s in range(3):
        trained.add(scored(t2, s, float(s)))
    (taken,), _ = trained.take(1, 0)
    before.grouper.done[t2] = "trained"
    before.state.uncommitted.append((taken.group, Issued(at=0.0, version=0)))  # trained, not checkpointed
    before.ledger.write(before.snapshot())
    before.ledger.close()

    monkeypatch.setattr(envrecord, "differs", lambda run_dir, record: "")  # no environment record here
    state, g = RunState(steps=0), Grouper(3, max_staleness=0, stale_policy="drop", timeout_s=600.0)
    g.done.prefix = "r1-g"
    fs = restore(
        tmp_path, None, None, ledger=ckpt.Ledger(tmp_path), driver=None, state=state, grouper=g, steplog=_NoSteps()
    )
    after = intake(tmp_path, fs=fs, grouper=g)
    assert [after.foreign(t) for t in (t0, t1, t2)] == ["", "", ""]
    assert after.foreign(task_id("r1", 3)).startswith(FOREIGN)
