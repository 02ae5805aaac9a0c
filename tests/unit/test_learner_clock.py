"""The learner's timers (group timeouts, task deadlines, the time it was down) run on the
monotonic clock: a wall clock that jumps (an NTP step, an operator setting the date) neither fires
a timeout early nor holds one back. The wall clock is moved with a test double of time.time; the
monotonic clock with one of time.monotonic. The ledger keeps wall-clock times (ages against its
`saved`), so a resume counts only the learner's uptime, whatever the clock did while it was down."""

from __future__ import annotations

import time

from parley.config.learner import RolloutConfig
from parley.learner import checkpoint as ckpt
from parley.learner.feeder import Feeder, FeederState, task_id
from parley.learner.groups import Grouper
from tests.unit.test_groups import scored

HOUR = 3600.0


class ClockDouble:
    """Stands in for time.time and time.monotonic: each moves only when the test moves it."""

    def __init__(self, wall: float = 1_800_000_000.0, mono: float = 5_000.0):
        self.wall, self.mono = wall, mono

    def install(self, monkeypatch) -> ClockDouble:
        monkeypatch.setattr(time, "time", lambda: self.wall)
        monkeypatch.setattr(time, "monotonic", lambda: self.mono)
        return self


def feeder(state: FeederState | None = None) -> Feeder:
    from parley.tasks.data import load_items

    return Feeder(None, "r1", load_items()[:3], RolloutConfig(n=3), max_staleness=0, groups_per_step=1, state=state)


def test_a_wall_clock_jump_does_not_time_a_group_out(monkeypatch):
    clock = ClockDouble().install(monkeypatch)
    g = Grouper(3, max_staleness=0, stale_policy="drop", timeout_s=600.0)
    g.add(scored("a", 0, 0.1))
    clock.wall += 2 * HOUR  # NTP steps the clock forward; 10 s of real time pass
    clock.mono += 10.0
    assert g.expire() == []
    clock.wall -= 4 * HOUR  # ... and back, past the first sample: the timeout still fires on time
    clock.mono += 600.0
    (out,) = g.expire()
    assert out.kind == "timeout" and "after 610s" in out.reason


def test_a_wall_clock_jump_does_not_make_a_task_overdue(monkeypatch):
    clock = ClockDouble().install(monkeypatch)
    f = feeder()
    f.state.in_flight[task_id("r1", 0)] = _issued_now()
    clock.wall += 5 * HOUR
    clock.mono += 1.0
    assert f.overdue(2 * HOUR) == []
    clock.mono += 2 * HOUR
    assert [t for t, _ in f.overdue(2 * HOUR)] == [task_id("r1", 0)]


def _issued_now():
    from parley.learner.feeder import Issued

    return Issued(at=time.monotonic(), version=0)


def test_a_resume_counts_uptime_only_whatever_the_wall_clock_did(monkeypatch, tmp_path):
    """A group 100 s old and a task 200 s old are written to the ledger; the learner is down for
    a while and the host's clock is set back a day meanwhile (the monotonic clock restarts at boot):
    the resumed ages are still 100 s and 200 s."""
    from parley.learner import envrecord
    from parley.learner.intake import Intake
    from parley.learner.resume import restore
    from parley.learner.runstate import RunState

    clock = ClockDouble().install(monkeypatch)
    g = Grouper(3, max_staleness=0, stale_policy="drop", timeout_s=600.0)
    g.done.prefix = "r1-g"
    f = feeder()
    clock.mono -= 200.0
    f.state.in_flight[task_id("r1", 0)] = _issued_now()
    f.state.next_index = 1
    clock.mono += 100.0
    g.add(scored(task_id("r1", 0), 0, 0.1))
    clock.mono += 100.0
    ledger = ckpt.Ledger(tmp_path)
    intake = Intake(
        RunState(steps=0),
        g,
        f,
        ledger,
        limits=(100, None),
        reference_service=False,
        ack_wait_s=30.0,
        flush_s=1.0,
        started=clock.mono,
    )
    ledger.write(intake.snapshot())
    ledger.close()

    clock.wall -= 24 * HOUR  # set back while the learner was down; the monotonic clock restarted
    clock.mono = 42.0
    state, g2 = RunState(steps=0), Grouper(3, max_staleness=0, stale_policy="drop", timeout_s=600.0)
    g2.done.prefix = "r1-g"
    monkeypatch.setattr(envrecord, "differs", lambda run_dir, record: "")  # no environment record here
    fs = restore(
        tmp_path, None, None, ledger=ckpt.Ledger(tmp_path), driver=None, state=state, grouper=g2, steplog=_NoSteps()
    )
    assert abs((clock.mono - g2.buffer[task_id("r1", 0)].first_seen) - 100.0) < 1e-6
    assert [(t, round(age)) for t, age in feeder(fs).overdue(150.0)] == [(task_id("r1", 0), 200)]


class _NoSteps:
    """Stands in for learner.steplog.StepLog: no step was logged."""

    def truncate(self, step: int) -> None:
        pass

    def reported(self) -> set[str]:
        return set()
