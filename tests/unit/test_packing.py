"""Packing trajectories into micro-batches by a token budget, sharding over ranks, and the packed
batch layout the learner's forward pass reads."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from parley.learner.packing import Sample, build_batch, pack_by_tokens, shard_by_tokens


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
    b = Sample("b", [9, 10, 11], [0, 1, 0], [0.0, -2.0, 0.0], advantage=-1.0)
    batch = build_batch([a, b])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]  # restart per sequence: no cross-attention
    # token p is predicted by the logits at p-1 (packed index)
    assert batch.src.tolist() == [1, 2, 4]
    assert batch.targets.tolist() == [7, 8, 10]
    assert batch.seq.tolist() == [0, 0, 1]
    torch.testing.assert_close(batch.behaviour, torch.tensor([-0.5, -0.25, -2.0]))
    assert batch.advantages.tolist() == [1.0, 1.0, -1.0]
    assert batch.n_loss_tokens == 3


def _reference_batch(samples):
    """The token-by-token layout build_batch must reproduce with array operations."""
    ids, pos, src, tgt, seq, beh, adv, offset = [], [], [], [], [], [], [], 0
    for s_idx, s in enumerate(samples):
        n = len(s.token_ids)
        ids += [int(x) for x in s.token_ids]
        pos += range(n)
        for p in range(1, n):
            if s.loss_mask[p]:
                src.append(offset + p - 1)
                tgt.append(int(s.token_ids[p]))
                seq.append(s_idx)
                beh.append(float(s.behaviour[p]))
                adv.append(s.advantage)
        offset += n
    return ids, pos, src, tgt, seq, beh, adv


def test_packed_batch_matches_the_token_by_token_layout():
    rng = random.Random(1)
    samples = []
    for i in range(20):
        n = rng.choice([1, 2, rng.randint(3, 400)])
        mask = [rng.random() < 0.5 for _ in range(n)]  # token 0 marked too: it must be left out
        samples.append(
            Sample(
                f"s{i}",
                [rng.randint(0, 150_000) for _ in range(n)],
                mask,
                [-rng.random() if m else 0.0 for m in mask],
                advantage=rng.uniform(-2, 2),
            )
        )
    batch = build_batch(samples)
    ids, pos, src, tgt, seq, beh, adv = _reference_batch(samples)
    assert batch.input_ids.tolist() == [ids] and batch.position_ids.tolist() == [pos]
    assert (batch.src.tolist(), batch.targets.tolist(), batch.seq.tolist()) == (src, tgt, seq)
    torch.testing.assert_close(batch.behaviour, torch.tensor(beh, dtype=torch.float32))
    torch.testing.assert_close(batch.advantages, torch.tensor(adv, dtype=torch.float32))
    assert sum(s.n_trained for s in samples) == batch.n_loss_tokens
    empty = build_batch([])
    assert empty.input_ids.shape == (1, 0) and empty.n_loss_tokens == 0


def test_sample_holds_arrays_that_pickle_as_buffers():
    """The learner broadcasts its samples to the other ranks pickled: as arrays that is a few bytes
    per token, as Python lists it was one pickled number per token and array."""
    import pickle

    n = 10_000
    s = Sample("s", list(range(n)), [i % 2 for i in range(n)], [-0.5] * n, advantage=1.0)
    assert (s.token_ids.dtype, s.loss_mask.dtype, s.behaviour.dtype) == (np.int32, np.bool_, np.float32)
    assert len(pickle.dumps(s)) < n * (4 + 1 + 4) + 1024
    with pytest.raises(ValueError, match="sample t: token_ids \\(3,\\), loss_mask \\(2,\\)"):
        Sample("t", [1, 2, 3], [0, 1], [0.0, 0.0, 0.0], advantage=0.0)


def test_each_trained_token_carries_its_samples_temperature():
    a = Sample("a", [5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], advantage=1.0, temperature=0.5)
    b = Sample("b", [9, 10], [0, 1], [0.0, -2.0], advantage=-1.0)
    batch = build_batch([a, b])
    torch.testing.assert_close(batch.inv_temp, torch.tensor([2.0, 2.0, 1.0]))
    # every sample at 1.0: no scaling at all, so such batches compute exactly what they did before
    assert build_batch([b, Sample("c", [1, 2], [0, 1], [0.0, -1.0], advantage=0.0)]).inv_temp is None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sample d: temperature .* must be a finite number > 0"):
            Sample("d", [1, 2], [0, 1], [0.0, -1.0], advantage=0.0, temperature=bad)
