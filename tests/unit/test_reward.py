"""Unit tests for rewards.reward: weighting, clamps, futures averaging, the MR formula."""

import pytest

from parley.rewards.reward import average_futures, default_weights, mr, total_reward, weighted_terms


def test_default_weights():
    assert default_weights() == {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1}
    assert default_weights() is not default_weights()  # a fresh dict each time: configs may edit theirs


def test_total_reward_default_weights_hand_numbers():
    metrics = {"bleu": 0.5, "interactivity": 0.8, "token_amount": 2.0}
    assert total_reward(metrics, default_weights()) == pytest.approx(0.5 + 0.8 - 0.2)


def test_total_reward_accepts_plain_weight_mapping():
    metrics = {"bleu": 0.5, "interactivity": 0.8, "token_amount": 2.0, "logged_only": 9.0}
    assert total_reward(metrics, {"bleu": 2.0}) == pytest.approx(1.0)


def test_clamp_applies_to_metric_before_weighting():
    metrics = {"bleu": 0.5, "interactivity": 0.8, "token_amount": 3.0}
    clamps = {"token_amount": (0.0, 1.0)}
    # token_amount clamped to 1.0, then weighted by -0.1.
    assert total_reward(metrics, default_weights(), clamps) == pytest.approx(0.5 + 0.8 - 0.1)
    assert weighted_terms(metrics, default_weights(), clamps)["token_amount"] == pytest.approx(-0.1)
    assert total_reward(metrics, default_weights(), clamps={"bleu": (0.0, 0.25)}) == pytest.approx(0.25 + 0.8 - 0.3)


def test_bad_clamp_raises():
    with pytest.raises(ValueError, match="bleu"):
        total_reward({"bleu": 0.5}, {"bleu": 1.0}, clamps={"bleu": (1.0, 0.0)})


def test_missing_metric_raises():
    with pytest.raises(ValueError, match="interactivity"):
        total_reward({"bleu": 0.5, "token_amount": 1.0}, default_weights())


def test_average_futures_per_metric_mean():
    futures = [
        {"bleu": 0.2, "interactivity": 0.6, "token_amount": 1.0},
        {"bleu": 0.4, "interactivity": 1.0, "token_amount": 3.0},
    ]
    avg = average_futures(futures)
    assert avg == pytest.approx({"bleu": 0.3, "interactivity": 0.8, "token_amount": 2.0})


def test_average_futures_then_clamp_acts_on_average():
    futures = [{"token_amount": 0.5}, {"token_amount": 2.5}]
    # Average 1.5 -> clamped 1.0 -> -0.1 (clamping each future first would give -0.075).
    assert total_reward(
        average_futures(futures), {"token_amount": -0.1}, {"token_amount": (0.0, 1.0)}
    ) == pytest.approx(-0.1)


def test_average_futures_rejects_empty_and_mismatched():
    with pytest.raises(ValueError):
        average_futures([])
    with pytest.raises(ValueError, match="future 1"):
        average_futures([{"bleu": 0.1}, {"interactivity": 0.2}])


PUBLISHED_ROWS = [
    # (bleu, interactivity, tokens_k, published MR)
    (0.4491, 0.831, 2.935, 0.9870),
    (0.4524, 0.819, 2.281, 1.0433),
    (0.4827, 0.801, 2.077, 1.0761),
    (0.4825, 0.744, 1.944, 1.0316),
    (0.4669, 0.825, 1.678, 1.1236),
]


@pytest.mark.parametrize("bleu_, interactivity, tokens_k, published", PUBLISHED_ROWS)
def test_mr_matches_published_rows(bleu_, interactivity, tokens_k, published):
    assert abs(mr(bleu_, interactivity, tokens_k) - published) < 1e-3


def test_mr_hand_value():
    assert mr(0.5, 0.8, 2.0) == pytest.approx(1.1)
