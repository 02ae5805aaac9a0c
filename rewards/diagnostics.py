"""Reward-signal diagnostics: per-term mean, within-group spread and correlation with
the total, and a monitor that flags terms whose within-group spread stays flat.
Read by the learner (step logging, through diagnose_groups on its Scored groups) and the live
view; pure Python + numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from parley.protocol.messages import Scored
from parley.rewards.reward import weighted_terms

# Below this a standard deviation is treated as exactly zero (constant series).
_CONSTANT_STD = 1e-12


class TermStats(msgspec.Struct, frozen=True):
    mean: float  # over all samples of the step
    within_group_std: float  # population std inside each group, averaged over groups
    corr_with_total: float  # Pearson over all samples; 0.0 when either side is constant


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    dx, dy = x - x.mean(), y - y.mean()
    sx, sy = math.sqrt(float(np.mean(dx * dx))), math.sqrt(float(np.mean(dy * dy)))
    # A constant series has no defined correlation; 0.0 keeps logs and plots finite.
    if sx < _CONSTANT_STD or sy < _CONSTANT_STD:
        return 0.0
    corr = float(np.mean(dx * dy)) / (sx * sy)
    return max(-1.0, min(1.0, corr))


def step_diagnostics(
    groups: Sequence[Sequence[Mapping[str, float]]],
    totals: Sequence[Sequence[float]],
) -> dict[str, TermStats]:
    """Per-term statistics for one learner step.

    groups[g][i] is the term -> value dict of sample i in group g (the same
    terms in every sample); totals[g][i] is that sample's total reward.
    GRPO only learns from differences inside a group, so a term whose
    within-group std is ~0 contributes nothing to the advantages.
    """
    if len(groups) != len(totals):
        raise ValueError(f"{len(groups)} groups but {len(totals)} total rows")
    if not groups:
        return {}
    for g, (group, total_row) in enumerate(zip(groups, totals)):
        if len(group) != len(total_row):
            raise ValueError(f"group {g} has {len(group)} samples but {len(total_row)} totals")
        if not group:
            raise ValueError(f"group {g} is empty")

    terms = list(groups[0][0])
    for g, group in enumerate(groups):
        for i, sample in enumerate(group):
            if set(sample) != set(terms):
                raise ValueError(f"sample {i} of group {g} has terms {sorted(sample)}, expected {sorted(terms)}")

    flat_totals = np.array([t for row in totals for t in row], dtype=np.float64)  # (N,)
    stats: dict[str, TermStats] = {}
    for term in terms:
        per_group = [np.array([s[term] for s in group], dtype=np.float64) for group in groups]
        flat = np.concatenate(per_group)  # (N,)
        stats[term] = TermStats(
            mean=float(flat.mean()),
            within_group_std=float(np.mean([v.std() for v in per_group])),
            corr_with_total=_pearson(flat, flat_totals),
        )
    return stats


def diagnose_groups(groups: Sequence[Sequence[Scored]]) -> dict[str, TermStats]:
    """step_diagnostics over the learner's Scored groups of one step.

    Each sample's terms are its weighted terms w_k * clamp(m_k) (rewards.reward.weighted_terms,
    with the weights and clamps the scorer recorded in Scored.weights and Scored.clamps); the
    total is Scored.total, the reward the learner trains on.
    """
    terms = [
        [
            weighted_terms(s.metrics, s.weights, {k: (float(v[0]), float(v[1])) for k, v in s.clamps.items()})
            for s in group
        ]
        for group in groups
    ]
    totals = [[s.total for s in group] for group in groups]
    return step_diagnostics(terms, totals)


class SignalMonitor:
    """Flags terms that carry no signal: within-group std below `min_std` for `window` consecutive
    steps, or on every step seen so far.

    Such a term "carries no signal": e.g. a length penalty that saturates at its clamp for every
    sample gives every member of a group the same value. The second rule is for short runs: a term
    dead from the first step (BLEU of 0.0 for every sample, as a judge that cannot extract gives) is
    flagged at once, so a 3-step run shows it in its table and live view instead of never reaching
    the window. A term that did vary and then went flat needs the whole window, since a few flat
    steps in a healthy run are noise.
    """

    def __init__(self, window: int = 5, min_std: float = 1e-3) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if min_std < 0:
            raise ValueError(f"min_std must be >= 0, got {min_std}")
        self.window = window
        self.min_std = min_std
        self._steps_flat: dict[str, int] = {}  # consecutive flat steps, up to now
        self._steps_seen: dict[str, int] = {}
        self._steps_signal: dict[str, int] = {}  # steps on which the term varied within groups

    def _no_signal(self, term: str) -> bool:
        flat = self._steps_flat[term]
        return flat >= self.window or 0 < flat == self._steps_seen[term]

    def update(self, step_stats: Mapping[str, TermStats]) -> list[str]:
        """Record one step; return the terms currently carrying no signal."""
        for term in self._steps_flat:
            if term not in step_stats:
                # Absent this step: no evidence it stayed flat, start counting again.
                self._steps_flat[term] = 0
        for term, st in step_stats.items():
            # NaN compares False, so a NaN std resets the count rather than flagging.
            flat = st.within_group_std < self.min_std
            self._steps_flat[term] = self._steps_flat.get(term, 0) + 1 if flat else 0
            self._steps_seen[term] = self._steps_seen.get(term, 0) + 1
            self._steps_signal[term] = self._steps_signal.get(term, 0) + (st.within_group_std >= self.min_std)
        return [t for t in self._steps_flat if self._no_signal(t)]

    def report(self) -> dict[str, dict[str, bool | int]]:
        return {
            term: {
                "no_signal": self._no_signal(term),
                "steps_flat": n,
                "steps_seen": self._steps_seen[term],
                "steps_with_signal": self._steps_signal[term],
            }
            for term, n in self._steps_flat.items()
        }
