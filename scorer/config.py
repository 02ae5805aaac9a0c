"""Typed configuration of `parley judge` ([judge]) and `parley scorer` ([scorer]).

Decoded by deploy/config.py; read by scorer/judge.py, scorer/scorer.py and rollout/score.py.
"""

from __future__ import annotations

import msgspec

from engines.config import ServiceBackend
from rewards.extract import EXTRACTORS
from rewards.metrics import BLEU_VARIANTS, INTERACTIVITY_SCALES


class JudgeConfig(ServiceBackend, kw_only=True, forbid_unknown_fields=True):
    """[judge]: the judge service (same backends as the simulator)."""

    temperature: float = 0.0
    # A greedy retry would repeat the same malformed output, so retries sample at this temperature.
    retry_temperature: float = 0.7
    # Conversation tokens the judge prompt may hold; 0 = derive from engine.max_model_len (vllm
    # backend) or no limit (openai backend). Longer conversations keep their newest turns.
    max_conversation_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature < 0 or self.retry_temperature < 0:
            raise ValueError(
                f"temperature={self.temperature}, retry_temperature={self.retry_temperature} must be >= 0"
            )
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries} must be >= 0")
        if self.max_conversation_tokens < 0:
            raise ValueError(f"max_conversation_tokens={self.max_conversation_tokens} must be >= 0 (0 = derive)")


class ScorerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[scorer]: reward assembly."""

    concurrency: int = 8  # trajectories scored at once
    # metric -> weight in the total; {} = the environment's default weights. The names are checked
    # against the run's environment by deploy/config.py (RunConfig), which fills this in.
    weights: dict[str, float] = {}
    clamps: dict[str, list[float]] = {}  # metric -> [lo, hi], applied before weighting
    bleu_variant: str = "sacrebleu"  # "sacrebleu" | "char" (CollabLLM's character-level BLEU)
    extract: str = "judge"  # "judge" | "last_document": who finds the document BLEU compares
    # "rubric" (0..3 on three criteria, the levels the judge wrote) | "rubric_expected" (the same rubric,
    # each criterion's expected level under the judge's own distribution; needs a local vllm judge) |
    # "3level" (CollabLLM's 1 / 0.5 / 0)
    interactivity: str = "rubric"
    judge_timeout_s: float = 300.0  # one judge request
    judge_concurrency: int = 16  # judge requests in flight from one scorer
    retry_delay_s: float = 5.0  # first back-off when the judge is down or fails; doubles each time
    retry_max_delay_s: float = 30.0
    # While the judge (or the reference service) is unreachable a trajectory is held and asked again
    # (its deliveries are not spent: a restart can take minutes); after this long it is nak'ed and
    # counts one delivery.
    judge_wait_s: float = 900.0
    # [learner] reference = "service": one reference-service request per trajectory; waits for an
    # unreachable service as for the judge (judge_wait_s), spending no delivery.
    reference_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.bleu_variant not in BLEU_VARIANTS:
            raise ValueError(f"bleu_variant={self.bleu_variant!r} not allowed; use one of {tuple(BLEU_VARIANTS)}")
        if self.extract not in EXTRACTORS:
            raise ValueError(f"extract={self.extract!r} not allowed; use one of {EXTRACTORS}")
        if self.interactivity not in INTERACTIVITY_SCALES:
            raise ValueError(f"interactivity={self.interactivity!r} not allowed; use one of {tuple(INTERACTIVITY_SCALES)}")
        for k, v in self.clamps.items():
            if len(v) != 2 or v[0] > v[1]:
                raise ValueError(f"clamps.{k}={v} must be [lo, hi] with lo <= hi")
        if self.concurrency < 1 or self.judge_concurrency < 1:
            raise ValueError(
                f"concurrency={self.concurrency}, judge_concurrency={self.judge_concurrency} must be >= 1"
            )
        if self.judge_timeout_s <= 0:
            raise ValueError(f"judge_timeout_s={self.judge_timeout_s} must be > 0")
        if self.reference_timeout_s <= 0:
            raise ValueError(f"reference_timeout_s={self.reference_timeout_s} must be > 0")
        if self.judge_wait_s < 0:
            raise ValueError(f"judge_wait_s={self.judge_wait_s} must be >= 0")
        if not 0 < self.retry_delay_s <= self.retry_max_delay_s:
            raise ValueError(
                f"retry_delay_s={self.retry_delay_s}, retry_max_delay_s={self.retry_max_delay_s}: "
                "need 0 < retry_delay_s <= retry_max_delay_s"
            )

    def retry_delay(self, delivered: int) -> float:
        """Back-off before redelivery number `delivered` + 1: doubles from retry_delay_s, capped."""
        return min(self.retry_max_delay_s, self.retry_delay_s * 2 ** max(0, delivered - 1))
