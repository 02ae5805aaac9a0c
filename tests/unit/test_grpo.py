"""Unit tests for learner.grpo: advantages, clipped loss, KL, aggregation, composition, the batch loss."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from parley.config.learner import LOSS_AGG
from parley.learner.grpo import (
    aggregate,
    batch_loss,
    group_advantages,
    grpo_loss,
    kl_k3,
    policy_loss,
)

LOG = math.log


def test_group_advantages_hand_values():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]], dtype=torch.float64)
    # Group 0: mean 2, population std sqrt(2/3). Group 1: mean 4/3, population std sqrt(32)/3.
    expected = torch.tensor(
        [[-math.sqrt(1.5), 0.0, math.sqrt(1.5)], [-1 / math.sqrt(2), -1 / math.sqrt(2), math.sqrt(2)]],
        dtype=torch.float64,
    )
    assert_close(group_advantages(rewards, eps=0.0, std="population"), expected)
    assert_close(
        group_advantages(rewards, scale=False),
        torch.tensor([[-1.0, 0.0, 1.0], [-4 / 3, -4 / 3, 8 / 3]], dtype=torch.float64),
    )


def test_group_advantages_sample_std_is_the_default_and_exact():
    # n = 3, rewards 1, 2, 3: mean 2, sample std 1 (sum of squares 2 over n - 1 = 2): advantages -1, 0, 1,
    # where the population std sqrt(2/3) gives -sqrt(1.5), 0, sqrt(1.5).
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]], dtype=torch.float64)
    # group 1: mean 4/3, sample std sqrt((16/9 + 16/9 + 64/9) / 2) = 4 / sqrt(3)
    expected = torch.tensor(
        [[-1.0, 0.0, 1.0], [-1 / math.sqrt(3), -1 / math.sqrt(3), 2 / math.sqrt(3)]], dtype=torch.float64
    )
    assert_close(group_advantages(rewards, eps=0.0), expected)
    assert_close(group_advantages(rewards, eps=0.0, std="sample"), expected)
    # the two conventions differ by sqrt(n / (n - 1)) exactly
    ratio = group_advantages(rewards, eps=0.0, std="population") / expected
    assert_close(ratio[expected != 0], torch.full((5,), math.sqrt(1.5), dtype=torch.float64))
    from parley.config.learner import LearnerConfig

    assert LearnerConfig().adv_std == "sample"


def test_a_group_of_one_sample_has_zero_advantage_with_either_std():
    for std in ("sample", "population"):
        assert_close(group_advantages(torch.tensor([[0.3], [0.9]]), std=std), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="population"):
        group_advantages(torch.tensor([[0.3, 0.4]]), std="unbiased")


def test_group_advantages_match_numpy_float64():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(6, 8))
    eps = 1e-6
    expected = (rewards - rewards.mean(axis=1, keepdims=True)) / (rewards.std(axis=1, ddof=0, keepdims=True) + eps)
    got = group_advantages(torch.tensor(rewards, dtype=torch.float32), eps=eps, std="population")
    assert_close(got.double(), torch.from_numpy(expected), rtol=1e-5, atol=1e-5)
    got64 = group_advantages(torch.from_numpy(rewards), eps=eps, std="population")
    assert_close(got64, torch.from_numpy(expected))


def test_flat_group_gives_zero_advantage_and_is_masked():
    rewards = torch.tensor([[0.7, 0.7, 0.7], [0.1, 0.5, 0.9], [1.0, 1.0 + 1e-9, 1.0]])
    assert_close(group_advantages(rewards)[0], torch.zeros(3))


def test_group_advantages_rejects_1d():
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0]))


def _policy_case():
    # Token: A>0 clipped high | A>0 inside | A<0 clipped low | A<0 dual clip | A<0 inside | masked.
    ratios = [1.5, 1.1, 0.5, 5.0, 2.0, 9.0]
    advantages = torch.tensor([2.0, 1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    old_logp = torch.full((6,), -1.0, dtype=torch.float64)
    logp = (old_logp + torch.tensor([LOG(r) for r in ratios], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    return logp, old_logp, advantages, mask


def test_policy_loss_hand_cases():
    logp, old_logp, adv, mask = _policy_case()
    loss, stats = policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A>0, r=1.5 -> -2 * 1.28; A>0, r=1.1 -> -1.1; A<0, r=0.5 -> max(0.5, 0.8) = 0.8;
    # A<0, r=5 -> min(max(5, 1.28), 3) = 3; A<0, r=2 -> 2; masked -> 0.
    expected = torch.tensor([-2.56, -1.1, 0.8, 3.0, 2.0, 0.0], dtype=torch.float64)
    assert_close(loss, expected)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 5.0 + 2.0) / 5)
    assert stats["ratio_max"] == pytest.approx(5.0)

    loss.sum().backward()
    # d(-A r)/d logp = -A r where unclipped; 0 where a clip (or the dual clip) is active.
    assert_close(logp.grad, torch.tensor([0.0, -1.1, 0.0, 0.0, 2.0, 0.0], dtype=torch.float64))


def test_policy_loss_without_dual_clip():
    logp, old_logp, adv, mask = _policy_case()
    loss, stats = policy_loss(logp, old_logp, adv, mask, dual_clip=None)
    assert loss[3].item() == pytest.approx(5.0)
    assert stats["dual_clip_frac"] == 0.0


def test_policy_loss_rejects_bad_dual_clip():
    logp, old_logp, adv, mask = _policy_case()
    with pytest.raises(ValueError):
        policy_loss(logp, old_logp, adv, mask, dual_clip=1.0)


def test_kl_k3_zero_when_equal_positive_otherwise():
    logp = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64)
    assert_close(kl_k3(logp, logp), torch.zeros(3, dtype=torch.float64))
    ref = logp + torch.tensor([LOG(2.0), -0.3, 1.0], dtype=torch.float64)
    kl = kl_k3(logp, ref)
    assert bool((kl > 0).all())
    # d = log 2: 2 - log 2 - 1.
    assert kl[0].item() == pytest.approx(1.0 - LOG(2.0))


def test_kl_k3_bounded_as_verl_low_var_kl():
    """verl's low_var_kl: log-ratio clamped to [-20, 20], then the value to [-10, 10]."""
    logp = torch.tensor([-30.0, -2.0, -1.0, -0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.5, -1.5, -1.0, -25.0], dtype=torch.float64)
    kl = kl_k3(logp, ref)
    # d = 29.5 -> 20 -> exp(20) - 21 = 4.85e8 -> 10; d = 0.5 -> exp(0.5) - 1.5; d = 0 -> 0;
    # d = -24.9 -> -20 -> exp(-20) + 19 -> 10.
    expected = torch.tensor([10.0, math.exp(0.5) - 1.5, 0.0, 10.0], dtype=torch.float64)
    assert_close(kl, expected)
    kl.sum().backward()
    # gradient of exp(d) - d - 1 in logp is 1 - exp(d); none through the clamped tokens
    assert_close(logp.grad, torch.tensor([0.0, 1.0 - math.exp(0.5), 0.0, 0.0], dtype=torch.float64))
    # in the loss: the far token weighs kl_coef * 10, not kl_coef * 4.85e8
    mask = torch.ones(4, dtype=torch.bool)
    zero = torch.zeros(4, dtype=torch.float64)
    loss, stats = grpo_loss(logp.detach(), logp.detach(), zero, mask, [4], ref_logp=ref, kl_coef=0.001)
    assert loss.item() == pytest.approx(0.001 * float(expected.mean()))
    assert stats["kl_mean"] == pytest.approx(float(expected.mean()))


def _packed_batch():
    # Sequence 0: 3 tokens, all trained. Sequence 1: 3 tokens, last one masked out.
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 12.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    return values, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4 + 12) / 5),  # 4.4
        ("seq-mean-token-sum", ((1 + 2 + 3) + (4 + 12)) / 2),  # 11
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (4 + 12) / 2) / 2),  # 5
    ],
)
def test_aggregate_modes(mode, expected):
    values, mask = _packed_batch()
    by_ids = aggregate(values, mask, torch.tensor([0, 0, 0, 1, 1, 1]), mode)
    by_lengths = aggregate(values, mask, [3, 3], mode)
    by_other_ids = aggregate(values, mask, torch.tensor([7, 7, 7, 2, 2, 2]), mode)
    for got in (by_ids, by_lengths, by_other_ids):
        assert_close(got, torch.tensor(expected))


def test_aggregate_unknown_mode_raises():
    values, mask = _packed_batch()
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(values, mask, [3, 3], "sum")
    assert set(LOSS_AGG) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean"}


def test_aggregate_bad_lengths_raise():
    values, mask = _packed_batch()
    with pytest.raises(ValueError):
        aggregate(values, mask, [3, 2], "seq-mean-token-sum")


def test_aggregate_nothing_masked_is_zero():
    values = torch.tensor([1.0, 2.0], requires_grad=True)
    out = aggregate(values, torch.zeros(2, dtype=torch.bool), [2], "seq-mean-token-mean")
    assert out.item() == 0.0
    out.backward()
    assert_close(values.grad, torch.zeros(2))


def test_grpo_loss_on_policy_is_minus_mean_advantage():
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, -0.5])
    _, mask = _packed_batch()
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7, -3.0], requires_grad=True)
    old = logp.detach().clone()
    loss, stats = grpo_loss(logp, old, adv, mask, [3, 3], ref_logp=old, kl_coef=0.1)
    assert_close(loss, torch.tensor(-(3 * 1.0 - 2 * 0.5) / 5))
    assert stats["kl_mean"] == 0.0
    assert stats["clip_frac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    # d loss / d logp = -A / n_masked on trained tokens.
    assert_close(logp.grad, torch.tensor([-0.2, -0.2, -0.2, 0.1, 0.1, 0.0]))


def test_grpo_loss_composes_parts():
    torch.manual_seed(0)
    T = 7
    logp = (-torch.rand(T) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(T)
    ref = logp.detach() + 0.2 * torch.randn(T)
    adv = torch.randn(T)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    lengths = [3, 4]
    for mode in LOSS_AGG:
        loss, stats = grpo_loss(
            logp,
            old,
            adv,
            mask,
            lengths,
            ref_logp=ref,
            kl_coef=0.05,
            agg_mode=mode,
        )
        pg, _ = policy_loss(logp, old, adv, mask)
        expected = aggregate(pg + 0.05 * kl_k3(logp, ref), mask, lengths, mode)
        assert_close(loss, expected)
        assert stats["kl_mean"] > 0.0
        assert stats["ratio_max"] >= stats["ratio_mean"]


def test_grpo_loss_kl_needs_ref():
    logp = torch.zeros(2)
    with pytest.raises(ValueError):
        grpo_loss(logp, logp, logp, torch.ones(2, dtype=torch.bool), [2], kl_coef=0.1)


def test_grpo_loss_unknown_mode_raises():
    logp = torch.zeros(2)
    with pytest.raises(ValueError, match="token-mean"):
        grpo_loss(logp, logp, logp, torch.ones(2, dtype=torch.bool), [2], agg_mode="mean")


def test_a_stale_group_is_trained_with_the_clipped_ratio_against_its_behaviour_logprobs():
    """A group kept beyond max_staleness (stale_policy = "correct") is off-policy data: every token's
    ratio is taken against the behaviour log-prob the actor recorded and clipped, so a token whose
    ratio left the trust region in the direction of its advantage gets no gradient. Hand values
    (clip_low 0.2, clip_high 0.28, dual_clip 3, token-mean over 4 tokens):
      A = +1, r = 1.6 -> clipped at 1.28: loss -1.28, gradient 0
      A = +1, r = 0.9 -> inside:          loss -0.9,  gradient -0.9 / 4
      A = -1, r = 0.5 -> clipped at 0.8:  loss  0.8,  gradient 0
      A = -1, r = 4   -> dual clip at 3:  loss  3,    gradient 0
    (The ratio against the learner's own detached log-probs, times min(r, 2), gave loss 0 and
    gradients (-1.6, -0.9, 0.5, 2) / 4: no trust region at all.)"""
    from parley.config.learner import LearnerConfig
    from parley.learner.packing import Sample, build_batch

    up = Sample("up", [5, 6, 7], [0, 1, 1], [0.0, LOG(0.5), LOG(0.5)], advantage=1.0)
    down = Sample("down", [8, 9, 10], [0, 1, 1], [0.0, LOG(0.5), LOG(0.2)], advantage=-1.0)
    batch = build_batch([up, down])
    logp = torch.tensor([LOG(0.8), LOG(0.45), LOG(0.25), LOG(0.8)], requires_grad=True)
    loss, stats = batch_loss(logp, batch, LearnerConfig(kl_coef=0.0))
    assert_close(loss, torch.tensor((-1.28 - 0.9 + 0.8 + 3.0) / 4))
    loss.backward()
    assert_close(logp.grad, torch.tensor([0.0, -0.9 / 4, 0.0, 0.0]))
    assert stats["clip_frac"] == pytest.approx(0.5) and stats["dual_clip_frac"] == pytest.approx(0.25)


def test_truncated_is_weights_each_token_by_its_capped_behaviour_ratio_and_clips_nothing():
    """behaviour_correction = "truncated_is" on the batch above (is_cap 3, token-mean over 4 tokens):
    each token's weight is min(r, 3) with r = exp(logp - mu) against the actor's behaviour log-probs,
    its loss -A * weight and its gradient -A * weight / 4, whatever side of a clip range r is on:
      A = +1, r = 1.6 -> weight 1.6: loss -1.6, gradient -1.6 / 4
      A = +1, r = 0.9 -> weight 0.9: loss -0.9, gradient -0.9 / 4
      A = -1, r = 0.5 -> weight 0.5: loss  0.5, gradient  0.5 / 4
      A = -1, r = 4   -> weight 3:   loss  3,   gradient  3 / 4"""
    from parley.config.learner import LearnerConfig
    from parley.learner.packing import Sample, build_batch

    up = Sample("up", [5, 6, 7], [0, 1, 1], [0.0, LOG(0.5), LOG(0.5)], advantage=1.0)
    down = Sample("down", [8, 9, 10], [0, 1, 1], [0.0, LOG(0.5), LOG(0.2)], advantage=-1.0)
    batch = build_batch([up, down])
    logp = torch.tensor([LOG(0.8), LOG(0.45), LOG(0.25), LOG(0.8)], requires_grad=True)
    cfg = LearnerConfig(kl_coef=0.0, behaviour_correction="truncated_is", is_cap=3.0)
    loss, stats = batch_loss(logp, batch, cfg)
    assert_close(loss, torch.tensor((-1.6 - 0.9 + 0.5 + 3.0) / 4))
    loss.backward()
    assert_close(logp.grad, torch.tensor([-1.6, -0.9, 0.5, 3.0]) / 4)
    assert stats["clip_frac"] == 0.0 and stats["is_cap_frac"] == pytest.approx(0.25)
    assert stats["is_weight_mean"] == pytest.approx((1.6 + 0.9 + 0.5 + 3.0) / 4)
    assert stats["ratio_max"] == pytest.approx(4.0)


def test_truncated_is_on_policy_is_the_plain_policy_gradient():
    """On-policy (logp = mu) every weight is 1: the loss and gradient of plain REINFORCE with the
    group advantage, -A per token."""
    from parley.learner.grpo import truncated_is_loss

    mu = torch.tensor([LOG(0.3), LOG(0.6), LOG(0.9)])
    logp = mu.clone().requires_grad_(True)
    adv = torch.tensor([2.0, -1.0, 0.5])
    loss, stats = truncated_is_loss(logp, mu, adv, torch.tensor([True, True, False]))
    assert_close(loss.detach(), torch.tensor([-2.0, 1.0, 0.0]))
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([-2.0, 1.0, 0.0]))
    assert stats["is_weight_mean"] == pytest.approx(1.0)


def test_unknown_behaviour_correction_is_refused_at_config_time():
    import msgspec

    from parley.config.learner import LearnerConfig

    with pytest.raises(msgspec.ValidationError, match="behaviour_correction"):
        msgspec.convert({"behaviour_correction": "vtrace"}, LearnerConfig)
    with pytest.raises(msgspec.ValidationError, match="is_cap"):
        msgspec.convert({"is_cap": 0.5}, LearnerConfig)
