"""Typed configuration of `parley judge` ([judge]) and `parley scorer` ([scorer])."""

from __future__ import annotations

import msgspec

from actors.config import ServiceBackend

BLEU_VARIANTS = ("sacrebleu", "char")


class JudgeConfig(ServiceBackend, kw_only=True, forbid_unknown_fields=True):
    """[judge]: the judge service (same backends as the simulator)."""

    temperature: float = 0.0


class ScorerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[scorer]: reward assembly."""

    concurrency: int = 8  # trajectories scored at once
    weights: dict[str, float] = msgspec.field(
        default_factory=lambda: {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1}
    )
    clamps: dict[str, list[float]] = {}  # metric -> [lo, hi], applied before weighting
    bleu_variant: str = "sacrebleu"  # "sacrebleu" | "char" (CollabLLM's character-level BLEU)
    judge_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.bleu_variant not in BLEU_VARIANTS:
            raise ValueError(f"bleu_variant={self.bleu_variant!r} not allowed; use one of {BLEU_VARIANTS}")
        known = {"bleu", "interactivity", "token_amount"}
        for k in [*self.weights, *self.clamps]:
            if k not in known:
                raise ValueError(f"unknown reward metric {k!r}; known: {sorted(known)}")
        for k, v in self.clamps.items():
            if len(v) != 2 or v[0] > v[1]:
                raise ValueError(f"clamps.{k}={v} must be [lo, hi] with lo <= hi")
