"""Packing trajectories into micro-batches by a token budget, sharding over ranks, and the packed
batch layout the learner's forward pass reads."""

from __future__ import annotations

import random

import pytest
import torch

from learner.packing import Sample, build_batch, pack_by_tokens, shard_by_tokens


def test_every_sequence_is_packed_once_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(50)]
    bins = pack_by_tokens(lengths, 512)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(50))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    # first-fit decreasing stays close to the lower bound
    assert len(bins) <= -(-sum(lengths) // 512) + 2


def test_oversized_sequence_gets_its_own_micro_batch():
    assert pack_by_tokens([700, 100, 300], 512) == [[0], [1, 2]]
    assert pack_by_tokens([], 512) == []
    with pytest.raises(ValueError):
        pack_by_tokens([1], 0)


def test_shards_balance_tokens():
    lengths = [100, 90, 80, 10, 10, 10]
    shards = shard_by_tokens(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert loads == [130, 170]  # the best split of these lengths
    assert shard_by_tokens(lengths, 1) == [list(range(6))]


def test_packed_batch_layout():
    a = Sample("a", [5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25], advantage=1.0)
    b = Sample("b", [9, 10, 11], [0, 1, 0], [0.0, -2.0, 0.0], advantage=-1.0, correct=True)
    batch = build_batch([a, b])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]  # restart per sequence: no cross-attention
    # token p is predicted by the logits at p-1 (packed index)
    assert batch.src.tolist() == [1, 2, 4]
    assert batch.targets.tolist() == [7, 8, 10]
    assert batch.seq.tolist() == [0, 0, 1]
    torch.testing.assert_close(batch.behaviour, torch.tensor([-0.5, -0.25, -2.0]))
    assert batch.advantages.tolist() == [1.0, 1.0, -1.0]
    assert batch.correct.tolist() == [False, False, True]
    assert batch.n_loss_tokens == 3
