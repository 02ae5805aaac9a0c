"""Trajectories as the learner trains them (`Sample`), packed into micro-batches without padding
by a token budget and sharded over ranks by tokens. Pure tensor bookkeeping, no model: used by
learner.trainer, learner.service and the tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Sample:
    """One trajectory as the learner trains it; all lists are aligned with token_ids."""

    traj_id: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 where the token is trained
    behaviour: list[float]  # behaviour log-prob of each trained token (0.0 elsewhere)
    advantage: float
    correct: bool = False  # stale group: truncated importance sampling instead of the PPO ratio


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of sequences grouped into micro-batches of at most `budget` tokens (first-fit
    decreasing). A sequence longer than the budget gets a micro-batch of its own."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)  # negative for an oversized sequence: nothing else fits
    return [sorted(b) for b in bins]


def shard_by_tokens(lengths: list[int], world: int) -> list[list[int]]:
    """Split sequence indices over `world` ranks, balancing tokens (longest first to the lightest rank)."""
    shards: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


@dataclass
class PackedBatch:
    """One micro-batch: sequences concatenated without padding, positions restarting per sequence."""

    input_ids: Tensor  # (1, T)
    position_ids: Tensor  # (1, T)
    src: Tensor  # (N,) packed index p-1 whose logits predict each trained token
    targets: Tensor  # (N,) the trained token ids
    seq: Tensor  # (N,) which sample (0..S-1 within the batch) each trained token belongs to
    behaviour: Tensor  # (N,)
    advantages: Tensor  # (N,)
    correct: Tensor  # (N,) bool

    @property
    def n_loss_tokens(self) -> int:
        return int(self.targets.numel())


def build_batch(samples: list[Sample], device: torch.device | str = "cpu") -> PackedBatch:
    ids, pos, src, tgt, seq, beh, adv, cor = [], [], [], [], [], [], [], []
    offset = 0
    for s_idx, s in enumerate(samples):
        n = len(s.token_ids)
        ids += s.token_ids
        pos += range(n)
        for p in range(1, n):  # token p is predicted by the logits at p-1; token 0 never is
            if s.loss_mask[p]:
                src.append(offset + p - 1)
                tgt.append(s.token_ids[p])
                seq.append(s_idx)
                beh.append(s.behaviour[p])
                adv.append(s.advantage)
                cor.append(s.correct)
        offset += n

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return PackedBatch(
        input_ids=t(ids, torch.long)[None],
        position_ids=t(pos, torch.long)[None],
        src=t(src, torch.long),
        targets=t(tgt, torch.long),
        seq=t(seq, torch.long),
        behaviour=t(beh, torch.float32),
        advantages=t(adv, torch.float32),
        correct=t(cor, torch.bool),
    )
