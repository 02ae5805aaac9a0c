"""The feeder's staleness gate and its deterministic task order (no NATS: the gate is pure)."""

from __future__ import annotations

import pytest

from parley.learner.feeder import Feeder, FeederState, Issued, admission_limit, item_order, may_admit, task_id


def test_admission_limit_is_version_plus_staleness_plus_one_steps():
    assert admission_limit(version=0, max_staleness=1, groups_per_step=2) == 4
    assert admission_limit(version=3, max_staleness=0, groups_per_step=5) == 20


def test_gate_admits_until_the_limit_is_reached():
    # version 0, max_staleness 1, 2 groups per step: 4 groups may be out before the first step
    assert may_admit(in_flight=0, consumed=0, version=0, max_staleness=1, groups_per_step=2)
    assert may_admit(in_flight=3, consumed=0, version=0, max_staleness=1, groups_per_step=2)
    assert not may_admit(in_flight=4, consumed=0, version=0, max_staleness=1, groups_per_step=2)
    # consuming does not reopen the gate by itself: issued groups are in flight or consumed
    assert not may_admit(in_flight=2, consumed=2, version=0, max_staleness=1, groups_per_step=2)
    # a step does
    assert may_admit(in_flight=2, consumed=2, version=1, max_staleness=1, groups_per_step=2)
    assert not may_admit(in_flight=4, consumed=2, version=1, max_staleness=1, groups_per_step=2)


def test_gate_bounds_staleness_of_every_admitted_group():
    """Simulate issue-order training: no group is trained more than max_staleness versions after
    the version at which it was admitted."""
    for s in (0, 1, 3):
        for g in (1, 2, 4):
            admitted_at = []  # version at which group i was admitted
            version, consumed = 0, 0
            while len(admitted_at) < 40:
                while may_admit(len(admitted_at) - consumed, consumed, version, s, g):
                    admitted_at.append(version)
                # train one step on the oldest g groups
                assert len(admitted_at) - consumed >= g
                for i in range(consumed, consumed + g):
                    assert version - admitted_at[i] <= s
                consumed += g
                version += 1


def _rounds(oversample: int, signal, s: int = 1, steps: int = 30) -> tuple[int, int]:
    """Rounds of one play time: a round plays every group the gate admits at once (each comes back
    complete, sampled at its admitted version, with differing rewards where `signal(index)`), then
    the learner's real Grouper takes one group for a step. (rounds, groups it dropped as stale)."""
    from parley.learner.groups import Grouper
    from tests import factories

    grouper = Grouper(2, max_staleness=s, stale_policy="drop", timeout_s=3600.0)
    in_flight: set[str] = set()
    version = consumed = index = played = 0
    while version < steps:
        played += 1
        while may_admit(len(in_flight), consumed, version, s, 1, oversample):
            task = f"g{index}"
            for sample in (0, 1):
                traj = factories.trajectory(
                    "r",
                    task,
                    sample,
                    item_id="i",
                    messages=[],
                    token_ids=[1, 2, 3],
                    loss_mask=[0, 1, 1],
                    turns=[factories.turn(1, [-0.1, -0.2], version)],
                )
                grouper.add(factories.scored(traj, {"bleu": float(sample) if signal(index) else 0.5}))
            in_flight.add(task)
            index += 1
        taken, finished = grouper.take(1, learner_version=version)
        in_flight -= {o.task_id for o in finished} | {t.group.task_id for t in taken}
        if taken:
            consumed, version = consumed + 1, version + 1
    return played, grouper.counters["stale"]


def test_oversampled_groups_replace_skipped_ones_at_once_and_the_rest_come_back_too_stale():
    """[learner] oversample_groups: k groups beyond the gate. Two of three groups come back with
    equal rewards (skipped, their slots given back): without extras a third of the steps wait a whole
    extra play, with two no step waits. When no group is skipped the extras come back too late and
    the grouper drops them as stale, never training them past the bound."""
    plain, dropped_plain = _rounds(0, lambda i: i % 3 == 0)
    extra, _ = _rounds(2, lambda i: i % 3 == 0)
    every, dropped_every = _rounds(2, lambda i: True)
    assert plain >= 40 and dropped_plain == 0  # 30 steps in 40 or more play times
    assert extra == 30
    assert every == 30 and dropped_every > 0


def test_oversampling_refuses_a_stale_policy_that_would_train_the_extras():
    from parley.config.learner import LearnerConfig

    with pytest.raises(ValueError, match="oversample_groups=2 with stale_policy='correct'"):
        LearnerConfig(oversample_groups=2, stale_policy="correct")
    LearnerConfig(oversample_groups=2)


def test_task_ids_and_item_order_are_deterministic():
    assert task_id("r1", 7) == "r1-g000007"
    first = [item_order(5, i, seed=3) for i in range(10)]
    assert first == [item_order(5, i, seed=3) for i in range(10)]
    assert sorted(first[:5]) == list(range(5)) and sorted(first[5:]) == list(range(5))  # each epoch a permutation
    assert first != [item_order(5, i, seed=4) for i in range(10)]


def test_feeder_state_accounting(tmp_path):
    from parley.config.learner import RolloutConfig
    from parley.tasks.data import load_items

    items = load_items()[:3]
    f = Feeder(
        None,
        "r1",
        items,
        RolloutConfig(n=3),
        max_staleness=0,
        groups_per_step=2,
        seed=1,
        state=FeederState(next_index=2, in_flight={"r1-g000000": Issued(0.0, 0), "r1-g000001": Issued(0.0, 0)}),
    )
    assert not f.is_open()
    assert f.mark_consumed("r1-g000000") and not f.mark_consumed("r1-g000000")
    assert not f.mark_consumed("someone-else")
    assert f.state.consumed == 1 and set(f.state.in_flight) == {"r1-g000001"}
    f.set_version(1)
    assert f.is_open()
    t = f.task(5)
    assert (t.task_id, t.n, t.run) == ("r1-g000005", 3, "r1")
    assert t.item_id == items[item_order(3, 5, 1)].item_id
    assert f.task(5).seed == t.seed


def test_feeder_refuses_an_empty_split():
    from parley.config.learner import RolloutConfig

    with pytest.raises(ValueError, match="training split is empty"):
        Feeder(None, "r1", [], RolloutConfig(), max_staleness=1, groups_per_step=1)


def test_dropped_groups_give_their_slot_back_instead_of_shrinking_the_window():
    # Regression: counting dropped/skipped groups as consumed shrank the window for good and, at
    # max_staleness 0, one zero-advantage group stopped admission for the rest of the run.
    from parley.config.learner import RolloutConfig
    from parley.tasks.data import load_items

    f = Feeder(
        None,
        "r1",
        load_items()[:3],
        RolloutConfig(n=2),
        max_staleness=0,
        groups_per_step=2,
        seed=1,
        state=FeederState(next_index=2, in_flight={"r1-g000000": Issued(0.0, 0), "r1-g000001": Issued(0.0, 0)}),
    )
    assert not f.is_open()
    assert f.mark_consumed("r1-g000000", trained=False)  # skipped: zero advantage
    assert f.state.consumed == 0 and f.is_open()  # its slot is refilled at the same version
    assert f.mark_consumed("r1-g000001")  # trained
    assert f.state.consumed == 1 and not f.state.in_flight


def test_overdue_lists_tasks_past_their_deadline_oldest_first():
    from parley.config.learner import RolloutConfig
    from parley.tasks.data import load_items

    f = Feeder(
        None,
        "r1",
        load_items()[:3],
        RolloutConfig(n=2),
        max_staleness=0,
        groups_per_step=2,
        state=FeederState(next_index=3, in_flight={"a": Issued(100.0, 0), "b": Issued(50.0, 0), "c": Issued(190.0, 1)}),
    )
    assert f.overdue(30.0, now=200.0) == [("b", 150.0), ("a", 100.0)]
    assert f.overdue(300.0, now=200.0) == []
    assert f.mark_consumed("b", trained=False) == Issued(50.0, 0)
    assert f.mark_consumed("b") is None


def test_a_run_of_n_steps_issues_no_group_its_last_step_will_not_train():
    # Before: at the last version the gate still admitted max_staleness+1 steps' worth of groups,
    # played beside the final eval and never trained (in `make run`: 4 of 12 groups).
    from parley.config.learner import RolloutConfig
    from parley.tasks.data import load_items

    f = Feeder(
        None,
        "r1",
        load_items()[:3],
        RolloutConfig(n=2),
        max_staleness=1,
        groups_per_step=2,
        steps=3,
        state=FeederState(
            next_index=6, consumed=4, in_flight={"r1-g000004": Issued(0.0, 2), "r1-g000005": Issued(0.0, 2)}
        ),
    )
    f.set_version(2)
    assert may_admit(2, 4, 2, 1, 2) and f.all_issued() and not f.is_open()  # the gate alone would admit
    assert f.mark_consumed("r1-g000004", trained=False)  # dropped (stale): its slot is needed again
    assert not f.all_issued() and f.is_open()
    unbounded = Feeder(
        None,
        "r1",
        load_items()[:3],
        RolloutConfig(n=2),
        max_staleness=1,
        groups_per_step=2,
        state=FeederState(next_index=6, consumed=4, in_flight={"a": Issued(0.0, 2), "b": Issued(0.0, 2)}),
    )
    unbounded.set_version(2)
    assert unbounded.is_open()  # steps = 0: no last step


async def test_the_feeder_publishes_through_an_outage_longer_than_publish_retries(monkeypatch):
    """A NATS outage of 150 s (simulated clock): the feeder keeps retrying the task's publish and
    issues it once the server answers. Before, publish gave up after its 8 attempts (about 100 s of
    outage) and the exception ended the learner."""
    import asyncio

    import nats

    from parley.config.learner import RolloutConfig
    from parley.protocol import bus
    from parley.tasks.data import load_items

    clock = [0.0]
    real_sleep = asyncio.sleep

    async def sleep(s):  # test double of asyncio.sleep: the simulated clock moves, nothing waits
        clock[0] += s
        await real_sleep(0)

    class OutageJetStream:
        """Test double of a JetStream context whose server is away for the first 150 s."""

        def __init__(self):
            self.stored = []

        async def publish(self, subject, data, headers=None, timeout=None):
            clock[0] += 10.0 if clock[0] < 150.0 else 0.0  # each publish waits for its timeout meanwhile
            if clock[0] < 150.0:
                raise nats.errors.TimeoutError
            self.stored.append(subject)

    monkeypatch.setattr(bus.asyncio, "sleep", sleep)
    monkeypatch.setattr(bus.time, "monotonic", lambda: clock[0])
    js = OutageJetStream()
    f = Feeder(js, "r1", load_items()[:3], RolloutConfig(n=2), max_staleness=0, groups_per_step=1, steps=1)
    f.set_version(0)
    stop = asyncio.Event()
    job = asyncio.create_task(f.run(stop))
    for _ in range(1000):
        if f.state.in_flight:
            break
        await real_sleep(0)
    stop.set()
    f.wake()
    await asyncio.wait_for(job, 5)
    assert clock[0] >= 150.0 and js.stored == ["parley.r1.tasks"] and set(f.state.in_flight) == {"r1-g000000"}
