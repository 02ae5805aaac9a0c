"""learner.flops: the model FLOPs MFU divides by, worked by hand for a tiny shape, full fine-tuning
and a frozen base (LoRA), so the live learner, the bench and bench/floor.py count alike."""

from __future__ import annotations

import pytest

from parley.learner.flops import train_flops


def test_full_fine_tuning_counts_six_n_a_token_and_causal_attention_per_sequence():
    # N = 1000, L = 2 layers, 4 heads of 8: attention 6 * 64 * s^2 a sequence
    # sequences of 10 and 20 tokens: 6 * 1000 * 30 = 180,000; 6 * 64 * (100 + 400) = 192,000
    assert train_flops(1000, 2, 4, 8, [10, 20], frozen_base=False, reference_forward=False) == 372_000.0


def test_a_frozen_base_counts_four_n_a_token_and_the_same_attention():
    # no weight gradients for the base: 4 * 1000 * 30 = 120,000; attention unchanged, 192,000
    assert train_flops(1000, 2, 4, 8, [10, 20], frozen_base=True, reference_forward=False) == 312_000.0


def test_the_basis_must_be_named():
    # a LoRA learner reported MFU on a 6 N basis (1.5x its linear FLOPs) while the doc's LoRA floor
    # counted 4 N: the caller now says which it trains
    with pytest.raises(TypeError):
        train_flops(1000, 2, 4, 8, [10])  # type: ignore[call-arg]
    with pytest.raises(TypeError):  # and whether a local reference's forward is in the step
        train_flops(1000, 2, 4, 8, [10], frozen_base=False)  # type: ignore[call-arg]


def test_a_local_reference_adds_one_forward_whatever_the_policy_trains():
    # the reference's forward: 2 * 1000 * 30 = 60,000; attention 2 * 64 * (100 + 400) = 64,000
    assert train_flops(1000, 2, 4, 8, [10, 20], frozen_base=False, reference_forward=True) == 372_000.0 + 124_000.0
    # a LoRA learner's reference (the base, adapters off) costs the same forward, not a third of 4 N
    assert train_flops(1000, 2, 4, 8, [10, 20], frozen_base=True, reference_forward=True) == 312_000.0 + 124_000.0
