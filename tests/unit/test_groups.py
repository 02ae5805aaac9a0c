"""Group assembly: complete groups, idempotence, timeouts, staleness drop/correct, zero advantage,
and the trajectory checks that decide dead-lettering."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from parley.learner.groups import BadTrajectory, Grouper, behaviour_logprobs, behaviour_version, check_trajectory
from parley.protocol import arrays
from parley.protocol.messages import ABANDONED_STALE, Scored
from tests import factories


def scored(task: str, sample: int, reward: float, version: int = 0) -> Scored:
    traj = factories.trajectory(
        "r",
        task,
        sample,
        item_id="i",
        messages=[],
        token_ids=[1, 2, 3, 4, 5, 6],
        loss_mask=[0, 0, 1, 1, 0, 1],
        turns=[factories.turn(2, [-0.1, -0.2], version), factories.turn(5, [-0.3], version + 1)],
    )
    return factories.scored(traj, {"bleu": reward})


def grouper(**kw) -> Grouper:
    return Grouper(3, **{"max_staleness": 1, "stale_policy": "drop", "timeout_s": 60.0, **kw})


def test_group_is_ready_only_when_all_samples_are_in():
    g = grouper()
    assert g.add(scored("a", 0, 0.1), now=0) == "added"
    assert g.add(scored("a", 2, 0.5), now=1) == "added"
    assert g.take(1, learner_version=0) == ([], [])
    assert g.add(scored("a", 1, 0.9), now=2) == "complete"
    taken, dropped = g.take(1, learner_version=0)
    assert [t.group.task_id for t in taken] == ["a"] and not dropped
    assert [s.sample for s in taken[0].group.ordered()] == [0, 1, 2]
    assert taken[0].group.rewards() == [0.1, 0.9, 0.5]
    assert not taken[0].correct and taken[0].staleness == 0
    assert g.done == {"a": "trained"} and not g.buffer


def test_duplicates_and_late_samples_are_ignored():
    g = grouper()
    g.add(scored("a", 0, 0.1))
    assert g.add(scored("a", 0, 0.7)) == "duplicate"  # a redelivery: the first copy stays
    assert g.buffer["a"].samples[0].total == 0.1
    for i in (1, 2):
        g.add(scored("a", i, 0.2 * i))
    g.take(1, 0)
    assert g.add(scored("a", 1, 0.3)) == "late"  # its group was trained already
    assert g.counters["duplicate"] == 1 and g.counters["late"] == 1 and not g.buffer


def test_oldest_complete_groups_go_first_and_k_are_needed():
    g = grouper()
    for task, t0 in (("b", 10), ("a", 20), ("c", 30)):
        for i in range(3):
            g.add(scored(task, i, float(i)), now=t0 + i)
    assert g.take(4, 0) == ([], [])  # only three ready: nothing taken
    taken, _ = g.take(2, 0)
    assert [t.group.task_id for t in taken] == ["b", "a"]
    assert list(g.buffer) == ["c"]


def test_partial_group_times_out_with_a_reason():
    g = grouper(timeout_s=60.0)
    g.add(scored("a", 0, 0.1), now=100)
    g.add(scored("a", 2, 0.1), now=150)
    for i in range(3):
        g.add(scored("b", i, float(i)), now=100)  # complete groups never time out
    assert g.expire(now=150) == []
    (out,) = g.expire(now=161)
    assert (out.task_id, out.kind) == ("a", "timeout")
    assert "2/3 samples after 61s" in out.reason and "missing samples [1]" in out.reason
    assert out.samples == ["a/0", "a/2"]
    assert g.done["a"] == "timeout" and list(g.buffer) == ["b"]
    assert g.add(scored("a", 1, 0.1)) == "late"


def test_stale_group_is_dropped_under_drop_policy():
    g = grouper(max_staleness=1, stale_policy="drop")
    for i in range(3):
        g.add(scored("old", i, float(i), version=0), now=0)
        g.add(scored("new", i, float(i), version=2), now=1)
    taken, dropped = g.take(1, learner_version=3)
    assert [t.group.task_id for t in taken] == ["new"] and taken[0].staleness == 1
    assert [(o.task_id, o.kind) for o in dropped] == [("old", "stale")]
    assert "behaviour version 0, learner version 3, lag 3 > max_staleness 1" in dropped[0].reason


def test_a_partial_group_that_already_lags_too_far_is_dropped_at_once_and_its_later_samples_are_late():
    """A group's staleness is its oldest sample's behaviour version: once one sample in lags more than
    max_staleness, no later sample can make the group trainable (drop policy). It is dropped at the
    next take, freeing its admission slot then, not when its last sample comes back (an oversampled
    extra at max_staleness 0 held the slot a whole play). A partial group within the bound stays,
    and under stale_policy = "correct" nothing partial is dropped."""
    g = grouper(max_staleness=0)
    g.add(scored("doomed", 0, 0.1, version=2), now=0)
    g.add(scored("fresh", 0, 0.1, version=3), now=0)
    assert g.doomed("doomed", 3) and not g.doomed("fresh", 3) and not g.doomed("doomed", 2)
    taken, out = g.take(1, learner_version=3)
    assert not taken
    assert [(o.task_id, o.kind) for o in out] == [("doomed", "stale")]
    assert "1/3 samples in" in out[0].reason and "lag 1 > max_staleness 0" in out[0].reason
    assert list(g.buffer) == ["fresh"] and g.done["doomed"] == "stale"
    assert g.add(scored("doomed", 1, 0.2, version=3), now=1) == "late"

    kept = grouper(max_staleness=0, stale_policy="correct")
    kept.add(scored("old", 0, 0.1, version=0), now=0)
    assert not kept.doomed("old", 3)
    assert kept.take(1, learner_version=3) == ([], []) and list(kept.buffer) == ["old"]


def test_stale_group_is_corrected_under_correct_policy():
    g = grouper(max_staleness=1, stale_policy="correct")
    for i in range(3):
        g.add(scored("old", i, float(i), version=0))
    taken, dropped = g.take(1, learner_version=3)
    assert not dropped and taken[0].correct and taken[0].staleness == 3
    assert g.counters["corrected"] == 1


def test_zero_advantage_group_is_skipped_and_counted():
    g = grouper()
    for i in range(3):
        g.add(scored("flat", i, 0.5), now=0)
        g.add(scored("live", i, float(i)), now=1)
    taken, skipped = g.take(1, 0)
    assert [t.group.task_id for t in taken] == ["live"]
    assert [(o.task_id, o.kind) for o in skipped] == [("flat", "zero_advantage")]
    assert g.counters["zero_advantage"] == 1


def test_untake_restores_a_failed_step():
    g = grouper()
    for i in range(3):
        g.add(scored("a", i, float(i)))
    taken, _ = g.take(1, 0)
    g.untake(taken)
    assert list(g.buffer) == ["a"] and not g.done and g.counters["trained"] == 0


def test_sample_index_outside_the_group_is_bad():
    with pytest.raises(BadTrajectory, match="sample index 3 outside 0..2"):
        grouper().add(scored("a", 3, 0.0))


def test_behaviour_alignment_and_version():
    s = scored("a", 0, 0.0, version=4)
    expected = np.array([0.0, 0.0, -0.1, -0.2, 0.0, -0.3], dtype=np.float32)
    np.testing.assert_array_equal(behaviour_logprobs(s.trajectory), expected)
    assert behaviour_version(s.trajectory) == 4
    check_trajectory(s.trajectory)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(loss_mask=[0, 0, 1]), "loss_mask has 3 entries for 6 tokens"),
        (dict(loss_mask=[1, 0, 1, 1, 0, 1]), "token 0 is marked trained"),
        (dict(loss_mask=[0, 1, 1, 1, 0, 1]), "token 1 is trained but no turn has its behaviour log-prob"),
        (dict(loss_mask=[0, 0, 2, 1, 0, 1]), "loss_mask must hold only 0 and 1"),
        (dict(loss_mask=[0] * 6), "no trained token"),
        (dict(token_ids=[]), "no token ids"),
    ],
)
def test_bad_trajectories_are_named(change, message):
    traj = scored("a", 0, 0.0).trajectory
    pack = {"loss_mask": ("loss_mask_u8", arrays.pack_mask), "token_ids": ("token_ids_i32", arrays.pack_ids)}
    traj = msgspec.structs.replace(traj, **{pack[k][0]: pack[k][1](v) for k, v in change.items()})
    with pytest.raises(BadTrajectory, match=message):
        check_trajectory(traj)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(token_ids_i32=b"\x01\x00\x00"), r"a/0: token_ids_i32 holds 3 bytes, not a whole number of int32"),
    ],
)
def test_token_arrays_that_cannot_be_read_are_bad(change, message):
    with pytest.raises(BadTrajectory, match=message):
        check_trajectory(msgspec.structs.replace(scored("a", 0, 0.0).trajectory, **change))


def test_turn_with_a_bad_logprob_field_is_bad():
    t = scored("a", 0, 0.0).trajectory
    turns = [msgspec.structs.replace(t.turns[0], logprobs_f32=b"\x00" * 6), t.turns[1]]
    with pytest.raises(BadTrajectory, match=r"a/0: turn at 2: logprobs_f32 holds 6 bytes"):
        check_trajectory(msgspec.structs.replace(t, turns=turns))


def test_turn_outside_the_tokens_is_bad():
    t = scored("a", 0, 0.0).trajectory
    turns = [msgspec.structs.replace(t.turns[1], start=5, logprobs_f32=arrays.pack_logprobs([-0.3, -0.4]))]
    with pytest.raises(BadTrajectory, match=r"turn 0 spans \[5, 7\) outside"):
        check_trajectory(msgspec.structs.replace(t, turns=turns))


def test_abandon_gives_up_tasks_that_cannot_complete_and_keeps_those_that_can():
    g = grouper()
    g.add(scored("partial", 0, 0.1), now=0)
    for i in range(3):
        g.add(scored("complete", i, 0.1 * i), now=0)
    g.add(scored("got-it", 1, 0.2), now=0)
    # a whole Task dead: its partial group goes, with the reason; a task never seen is recorded too
    out = g.abandon("partial", "dead", "dead: its Task was dead-lettered")
    assert (out.task_id, out.kind, out.samples) == ("partial", "dead", ["partial/0"])
    assert g.abandon("unseen", "deadline", "deadline: 0/3 samples").samples == []
    # nothing to give up: a complete group trains as it is; a lost sample that is in fact buffered
    assert g.abandon("complete", "dead", "x") is None
    assert g.abandon("got-it", "dead", "x", sample=1) is None
    assert g.abandon("partial", "dead", "again") is None  # already finished
    assert g.done == {"partial": "dead", "unseen": "deadline"}
    assert g.add(scored("partial", 1, 0.3), now=1) == "late"
    assert g.counters["dead"] == 1 and g.counters["deadline"] == 1


def test_freshest_order_trains_the_newest_behaviour_first_and_drops_what_it_passed_over_once_too_stale():
    """[learner] group_order = "freshest": with a group of version 4 and one of version 5 both back at
    learner version 5, the step trains version 5's (lag 0) where "oldest" trains version 4's (lag 1);
    the group passed over stays while it may still be trained and is dropped as stale at the next
    step, even though that step finds a fresher group first. A flat group is skipped either way."""

    def fill(g):
        for i in range(3):
            g.add(scored("flat", i, 0.5, version=3), now=0)
            g.add(scored("v4", i, float(i), version=4), now=1)
            g.add(scored("v5", i, float(i), version=5), now=2)

    oldest = grouper(max_staleness=1)
    fill(oldest)
    taken, out = oldest.take(1, learner_version=5)
    assert [t.group.task_id for t in taken] == ["v4"] and taken[0].staleness == 1
    assert [(o.task_id, o.kind) for o in out] == [("flat", "zero_advantage")]

    fresh = grouper(max_staleness=1, order="freshest")
    fill(fresh)
    taken, out = fresh.take(1, learner_version=5)
    assert [t.group.task_id for t in taken] == ["v5"] and taken[0].staleness == 0
    assert [(o.task_id, o.kind) for o in out] == [("flat", "zero_advantage")] and list(fresh.buffer) == ["v4"]
    for i in range(3):
        fresh.add(scored("v6", i, float(i), version=6), now=3)
    taken, out = fresh.take(1, learner_version=6)
    assert [t.group.task_id for t in taken] == ["v6"]
    assert [(o.task_id, o.kind) for o in out] == [("v4", "stale")] and not fresh.buffer


def test_an_unknown_group_order_is_refused():
    with pytest.raises(ValueError, match="group_order='newest'"):
        grouper(order="newest")


def abandoned(task: str, sample: int, version: int = 0, turns: bool = True) -> Scored:
    """A sample its actor stopped (terminated ABANDONED_STALE): passed on unjudged, total 0."""
    s = scored(task, sample, 0.0, version)
    traj = msgspec.structs.replace(
        s.trajectory, terminated=ABANDONED_STALE, actor="a1", **({} if turns else {"turns": []})
    )
    return msgspec.structs.replace(s, trajectory=traj, metrics={}, weights={}, total=0.0)


def test_a_group_with_a_sample_its_actor_abandoned_is_dropped_as_stale_whatever_the_versions():
    """An abandoned sample is cut short and unjudged: its group is never trained, even where the
    learner's own version would allow it (a resumed learner may be behind what the actor saw
    announced), and a complete group of abandoned samples goes as stale, not as zero advantage."""
    g = grouper(max_staleness=1)
    g.add(scored("part", 0, 0.5, version=3), now=0)
    g.add(abandoned("part", 1, version=3), now=1)
    assert g.doomed("part", learner_version=3)  # its own versions lag 0: only the abandonment dooms it
    for i in range(3):
        g.add(abandoned("whole", i, version=3, turns=i != 2), now=2)
    for i, r in enumerate((0.1, 0.5, 0.9)):
        g.add(scored("ok", i, r, version=3), now=3)
    taken, out = g.take(1, learner_version=3)
    assert [t.group.task_id for t in taken] == ["ok"]
    assert sorted((o.task_id, o.kind) for o in out) == [("part", "stale"), ("whole", "stale")]
    reasons = {o.task_id: o.reason for o in out}
    assert "sample 1 was stopped by actor a1 after 2 turn(s) (versions [3, 4])" in reasons["part"]
    assert "2/3 samples in" in reasons["part"] and "3/3 samples in" in reasons["whole"]
    assert g.add(scored("part", 2, 0.7, version=3), now=4) == "late" and not g.buffer


def test_an_abandoned_sample_dooms_its_group_under_the_correct_policy_too():
    g = grouper(max_staleness=0, stale_policy="correct")
    g.add(abandoned("a", 0, version=0), now=0)
    assert g.doomed("a", learner_version=0)
    assert [(o.task_id, o.kind) for o in g.take(1, learner_version=0)[1]] == [("a", "stale")]
