"""Trajectories as the learner trains them (`Sample`), packed into micro-batches without padding
by a token budget and sharded over ranks by tokens. Pure tensor bookkeeping, no model: used by
learner.trainer, learner.stepper and the tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class Sample:
    """One trajectory as the learner trains it: numpy arrays aligned with token_ids (lists are
    converted), so a batch is built with array operations and ranks receive it pickled as raw
    buffers, not as Python numbers."""

    traj_id: str
    token_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) bool: True where the token is trained
    behaviour: np.ndarray  # (T,) float32 behaviour log-prob of each trained token (0.0 elsewhere)
    advantage: float
    # (T,) float32 reference log-prob of each token given its prefix (0.0 at token 0), computed before
    # the step by the reference service ([policy] reference = "service"); None: the learner's own
    ref: np.ndarray | None = None
    # the temperature the behaviour policy sampled at (Trajectory.temperature): behaviour holds log-probs
    # of softmax(logits / temperature), and the learner recomputes that distribution
    temperature: float = 1.0

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask).astype(bool, copy=False)
        self.behaviour = np.asarray(self.behaviour, dtype=np.float32)
        if self.ref is not None:
            self.ref = np.asarray(self.ref, dtype=np.float32)
        n = self.token_ids.shape
        if self.token_ids.ndim != 1 or self.loss_mask.shape != n or self.behaviour.shape != n:
            raise ValueError(
                f"sample {self.traj_id}: token_ids {self.token_ids.shape}, loss_mask "
                f"{self.loss_mask.shape} and behaviour {self.behaviour.shape} must be one length"
            )
        if not (self.temperature > 0 and np.isfinite(self.temperature)):
            raise ValueError(
                f"sample {self.traj_id}: temperature {self.temperature!r} must be a finite number > 0 "
                "(a greedy sample has no distribution to train on)"
            )
        if self.ref is not None and self.ref.shape != n:
            raise ValueError(f"sample {self.traj_id}: ref {self.ref.shape} and token_ids {n} must be one length")

    @property
    def n_trained(self) -> int:
        """Trained tokens that can be predicted (token 0 never is)."""
        return int(np.count_nonzero(self.loss_mask[1:]))


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
    ref: Tensor | None = None  # (N,) the samples' reference log-probs, when every sample carries them
    inv_temp: Tensor | None = None  # (N,) 1 / the sample's temperature; None when every sample is at 1.0

    @property
    def n_loss_tokens(self) -> int:
        return int(self.targets.numel())


def build_batch(samples: list[Sample], device: torch.device | str = "cpu") -> PackedBatch:
    lengths = np.array([s.token_ids.size for s in samples], dtype=np.int64)  # (S,)
    starts = np.cumsum(lengths) - lengths  # (S,) packed offset of each sample's token 0
    ids = np.concatenate([s.token_ids for s in samples]) if samples else np.zeros(0, np.int32)  # (T,)
    trained = np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, bool)  # (T,)
    trained[starts[lengths > 0]] = False  # token p is predicted by the logits at p-1; token 0 never is
    idx = np.flatnonzero(trained)  # (N,) packed index of each trained token
    seq = np.repeat(np.arange(len(samples)), lengths)  # (T,) sample of each packed token
    pos = np.arange(ids.size) - starts[seq]  # (T,) positions restart at every sample
    beh = np.concatenate([s.behaviour for s in samples]) if samples else np.zeros(0, np.float32)  # (T,)
    adv = np.array([s.advantage for s in samples], dtype=np.float32)  # (S,)
    with_ref = bool(samples) and all(s.ref is not None for s in samples)
    ref = np.concatenate([s.ref for s in samples]) if with_ref else None  # (T,)
    temps = np.array([s.temperature for s in samples], dtype=np.float32)  # (S,)
    inv_temp = (1.0 / temps)[seq[idx]] if bool((temps != 1.0).any()) else None  # (N,)

    def t(x: np.ndarray, dtype: torch.dtype) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)

    return PackedBatch(
        input_ids=t(ids, torch.long)[None],
        position_ids=t(pos, torch.long)[None],
        src=t(idx - 1, torch.long),
        targets=t(ids[idx], torch.long),
        seq=t(seq[idx], torch.long),
        behaviour=t(beh[idx], torch.float32),
        advantages=t(adv[seq[idx]], torch.float32),
        ref=t(ref[idx], torch.float32) if ref is not None else None,
        inv_temp=t(inv_temp, torch.float32) if inv_temp is not None else None,
    )
