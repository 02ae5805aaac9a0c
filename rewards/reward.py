"""Reward assembly: weighted, optionally clamped sum of per-conversation metrics, the
average over sampled futures, and the benchmark's MR formula.
Called by the scorer (rewards for the learner) and by bench/ (MR reporting).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# Names people reach for that mean the reward the policy was trained on.
TRAINING_REWARD_NAMES = ("reward", "total", "training_reward", "train_reward")
REWARD_REFUSED = (
    "the training reward is not a selection metric: the policy is optimized against it, so it keeps rising "
    "while the benchmark can fall (in the seed model card reward rose after step 100 while MR fell from "
    "1.0761 to 1.0316 at step 129); select by bleu, interactivity or mr on held-out items"
)

# The reward terms the scorer computes, and the weights a run uses unless [scorer].weights says
# otherwise: token_amount is in thousands, so -0.1 costs 0.1 per thousand assistant tokens.
REWARD_METRICS = ("bleu", "interactivity", "token_amount")


def default_weights() -> dict[str, float]:
    return {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1}


# What an honest scorer can produce for each metric: BLEU and the rubric score are fractions;
# token_amount is thousands of assistant tokens, or words ([scorer] token_amount = "future_words"):
# a million of either would be far beyond any context.
METRIC_RANGES = {"bleu": (0.0, 1.0), "interactivity": (0.0, 1.0), "token_amount": (0.0, 1e6)}
MAX_WEIGHT = 1e6  # |weight| beyond this is no reward design, only an overflow waiting to happen


def hostile_reward(metrics: Mapping[str, float], weights: Mapping[str, float], total: float) -> str | None:
    """Why a scored reward could not come from an honest scorer (None if it could): a non-finite or
    out-of-range metric or weight, or a total beyond what those metrics and weights can sum to.
    The learner refuses such a sample: one NaN total makes its group's advantages, and then every
    weight, NaN."""
    for name, value in metrics.items():
        if not math.isfinite(value):
            return f"metric {name}={value} is not finite"
        lo, hi = METRIC_RANGES.get(name, (-math.inf, math.inf))
        if not lo <= value <= hi:
            return f"metric {name}={value} is outside [{lo:g}, {hi:g}]"
    for name, w in weights.items():
        if not (math.isfinite(w) and abs(w) <= MAX_WEIGHT):
            return f"weight {name}={w} is not a finite number within +-{MAX_WEIGHT:g}"
    if not math.isfinite(total):
        return f"total reward {total} is not finite"
    # A clamp or a futures average only narrows a term, so the terms' extremes bound the total.
    bound = 0.0
    for name, w in weights.items():
        lo, hi = METRIC_RANGES.get(name, (None, None))
        m = max(abs(lo), abs(hi)) if lo is not None else abs(metrics.get(name, 0.0))
        bound += abs(w) * m
    if abs(total) > bound * (1 + 1e-9) + 1e-9:
        return f"total reward {total} exceeds what its metrics and weights can reach (|total| <= {bound:g})"
    return None


def _clamp(name: str, value: float, bounds: Sequence[float] | None) -> float:
    if bounds is None:
        return value
    lo, hi = bounds
    if lo > hi:
        raise ValueError(f"clamp for {name!r} has lo={lo} > hi={hi}")
    return min(hi, max(lo, value))


def weighted_terms(
    metrics: Mapping[str, float],
    weights: Mapping[str, float],
    clamps: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, float]:
    """Each weighted term w_k * clamp(m_k); the diagnostics read these per term. `clamps` bound a
    metric (lo, hi) before it is weighted. Metrics not named in the weights are ignored (they are
    logged, not rewarded).
    """
    weight_map, clamp_map = weights, clamps or {}
    missing = [name for name in weight_map if name not in metrics]
    if missing:
        raise ValueError(f"metrics {missing} are weighted but missing; got metrics {sorted(metrics)}")
    return {name: w * _clamp(name, float(metrics[name]), clamp_map.get(name)) for name, w in weight_map.items()}


def total_reward(
    metrics: Mapping[str, float],
    weights: Mapping[str, float],
    clamps: Mapping[str, Sequence[float]] | None = None,
) -> float:
    """sum_k w_k * clamp(m_k); raises ValueError if a weighted metric is missing."""
    return math.fsum(weighted_terms(metrics, weights, clamps).values())


def average_futures(per_future: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per-metric mean over sampled futures (next_turn mode).

    Each metric is averaged over futures before weighting, so a clamp acts on
    the averaged metric, not on each future.
    """
    if not per_future:
        raise ValueError("average_futures needs at least one future, got none")
    names = set(per_future[0])
    for i, future in enumerate(per_future[1:], start=1):
        if set(future) != names:
            raise ValueError(f"future {i} has metrics {sorted(future)}, future 0 has {sorted(names)}")
    n = len(per_future)
    return {name: math.fsum(f[name] for f in per_future) / n for name in per_future[0]}


def mr(bleu: float, interactivity: float, tokens_k: float) -> float:
    """The benchmark metric: bleu + interactivity - 0.1 * tokens_k.

    Computed per item and then averaged. It is linear, so MR of the column means
    equals the mean of per-item MR; recomputing published MR from published
    (rounded) columns agrees within 1e-3.
    """
    return bleu + interactivity - 0.1 * tokens_k
