"""Values that decode but that no honest producer sends are refused where they arrive, each with a
reason naming the value: rewards and log-probs and token ids at the learner's intake, task sizes at
the actor, weight announcements at the actor's follower (issue 14, item 10)."""

from __future__ import annotations

import math

import msgspec
import pytest

from parley.config.learner import RolloutConfig
from parley.config.run import ConfigError, load_config
from parley.learner.groups import BadTrajectory, Grouper, check_hostile_values, check_trajectory
from parley.protocol import arrays, examples
from parley.protocol.bus import Poison
from parley.protocol.messages import TASK_MAX_N, WeightVersion
from parley.rewards.reward import hostile_reward
from parley.rollout.conversation import check_task_limits
from parley.weights.payloads import MAX_WEIGHT_BYTES, announcement_problem
from tests.unit.test_groups import scored

VOCAB = 100
NAN, INF = math.nan, math.inf


def test_an_honest_sample_passes():
    check_hostile_values(scored("t", 0, 0.5), VOCAB)
    assert (
        hostile_reward(
            {"bleu": 1.0, "interactivity": 0.0, "token_amount": 3.2},
            {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1},
            1.0 - 0.32,
        )
        is None
    )


@pytest.mark.parametrize(
    "metrics, weights, total, needle",
    [
        ({"bleu": 0.5}, {"bleu": 1.0}, NAN, "total reward nan is not finite"),
        ({"bleu": 0.5}, {"bleu": 1.0}, INF, "total reward inf is not finite"),
        ({"bleu": NAN}, {"bleu": 1.0}, 0.5, "metric bleu=nan is not finite"),
        ({"bleu": 7.0}, {"bleu": 1.0}, 0.5, "metric bleu=7.0 is outside [0, 1]"),
        ({"token_amount": -1.0}, {"token_amount": -0.1}, 0.1, "outside [0, 1e+06]"),
        ({"bleu": 0.5}, {"bleu": INF}, 0.5, "weight bleu=inf"),
        ({"bleu": 0.5}, {"bleu": 1.0}, 1e30, "exceeds what its metrics and weights can reach"),
        ({"custom": NAN}, {"custom": 1.0}, 0.0, "metric custom=nan is not finite"),
    ],
)
def test_hostile_rewards_are_refused_with_the_value(metrics, weights, total, needle):
    s = msgspec.structs.replace(scored("t", 0, 0.5), metrics=metrics, weights=weights, total=total)
    with pytest.raises(BadTrajectory, match="t/0: ") as e:
        check_hostile_values(s, VOCAB)
    assert needle in str(e.value)


def intake(s, **kw) -> None:
    """What the learner's SCORED consumer runs on every sample, in its order."""
    check_trajectory(s.trajectory)
    check_hostile_values(s, VOCAB, **kw)


def set_logprobs(turn, values) -> None:
    turn.logprobs_f32 = arrays.pack_logprobs(values)


@pytest.mark.parametrize("logprob", [NAN, INF, -INF, 0.5])
def test_non_finite_or_positive_behaviour_logprobs_are_refused(logprob):
    s = scored("t", 0, 0.5)
    set_logprobs(s.trajectory.turns[1], [logprob])
    with pytest.raises(BadTrajectory, match=f"turn 1 log-prob 0 is {logprob}"):
        intake(s)


def test_a_logprob_of_zero_within_float_rounding_is_honest():
    s = scored("t", 0, 0.5)
    set_logprobs(s.trajectory.turns[1], [0.0])
    set_logprobs(s.trajectory.turns[0], [-0.0, 1e-7])
    intake(s)


@pytest.mark.parametrize("token", [VOCAB, -1])
def test_token_ids_outside_the_vocabulary_are_refused(token):
    s = scored("t", 0, 0.5)
    ids = arrays.token_ids(s.trajectory).tolist()
    ids[3] = token
    s.trajectory.token_ids_i32 = arrays.pack_ids(ids)
    msg = f"token id {token} is outside the policy's vocabulary 0..{VOCAB - 1}"
    with pytest.raises(BadTrajectory, match=msg):
        intake(s)


def test_a_conversation_longer_than_the_policy_positions_is_refused():
    s = scored("t", 0, 0.5)
    intake(s, max_positions=6)
    with pytest.raises(BadTrajectory, match="6 tokens, more than the policy's 5 positions"):
        intake(s, max_positions=5)


def test_a_refused_step_makes_its_groups_final_and_untrained():
    g = Grouper(2, max_staleness=1, stale_policy="drop", timeout_s=60.0)
    for i, r in enumerate((0.1, 0.9)):
        g.add(scored("t", i, r))
    taken, _ = g.take(1, 0)
    out = g.reject(taken, "not trained: loss nan")
    assert [(o.task_id, o.kind, o.samples) for o in out] == [("t", "nonfinite", ["t/0", "t/1"])]
    assert g.done["t"] == "nonfinite" and g.counters["trained"] == 0 and g.counters["nonfinite"] == 1
    assert g.add(scored("t", 0, 0.1)) == "late"  # a redelivered sample of it is not trained later


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("n", TASK_MAX_N + 1, f"n={TASK_MAX_N + 1} exceeds {TASK_MAX_N}"),
        ("max_new_turns", 10**9, "max_new_turns=1000000000 exceeds"),
        ("max_tokens", 4097, "max_tokens=4097 exceeds 4096 (this actor's max_model_len)"),
        ("futures", 10**6, "futures=1000000 exceeds"),
    ],
)
def test_absurd_task_sizes_are_poison_at_the_actor(field, value, needle):
    task = msgspec.structs.replace(examples.task("r"), **{field: value})
    with pytest.raises(Poison, match="task ") as e:
        check_task_limits(task, max_model_len=4096)
    assert needle in str(e.value)
    check_task_limits(examples.task("r"), max_model_len=4096)


def test_the_feeder_config_is_held_to_the_same_task_bounds():
    """[rollout] is decoded with the Task's bounds as constraints (config.learner.RolloutConfig)."""
    with pytest.raises(ConfigError, match=rf"rollout.n = {TASK_MAX_N + 1}: expected an int >= 2 and <= {TASK_MAX_N}"):
        load_config(None, [f"rollout.n={TASK_MAX_N + 1}"])
    assert msgspec.convert({"n": TASK_MAX_N}, RolloutConfig).n == TASK_MAX_N


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"bytes": 0}, "bytes=0 is outside"),
        ({"bytes": MAX_WEIGHT_BYTES + 1}, "is outside 1.."),
        ({"version": -5}, "version=-5"),
        ({"files": ["v1/x"] * 65}, "65 extra files"),
        ({"sha256": "../../../../tmp/x" + "0" * 47}, "is not 64 hex digits"),
    ],
)
def test_absurd_weight_announcements_are_refused(change, needle):
    good = WeightVersion(
        version=1,
        step=1,
        transport="objstore",
        location="v000001-ab/model.safetensors",
        sha256="a" * 64,
        bytes=1000,
        created=0.0,
    )
    assert announcement_problem(good) is None
    assert needle in announcement_problem(msgspec.structs.replace(good, **change))


@pytest.mark.parametrize("temperature", [0.0, -0.7, NAN, INF])
def test_a_temperature_the_learner_cannot_recompute_is_refused_at_intake(temperature):
    """Behaviour log-probs are of softmax(logits / temperature): a sample claiming 0, a negative, NaN or
    infinite temperature is dead-lettered at intake, not left to fail the step that packs it."""
    s = scored("t", 0, 0.5)
    s.trajectory.temperature = temperature
    with pytest.raises(BadTrajectory, match=f"t/0: temperature {temperature} is not a finite number >= 1e-05"):
        intake(s)
    s.trajectory.temperature = 0.7
    intake(s)  # any positive temperature is the learner's to recompute
