"""Typed configuration of `parley judge` ([judge]) and `parley scorer` ([scorer]).

Decoded by config/run.py; read by services/judge/server.py, scorer/scorer.py and rollout/score.py.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from parley.engines.config import ServiceBackend
from parley.rewards.extract import EXTRACTORS
from parley.rewards.metrics import BLEU_VARIANTS, INTERACTIVITY_SCALES, ExtractQuotes, TokenAmount


class JudgeConfig(ServiceBackend, kw_only=True, forbid_unknown_fields=True):
    """[judge]: the judge service (same backends as the simulator)."""

    temperature: Annotated[float, Meta(ge=0.0, description="0 is greedy")] = 0.0
    # A greedy retry would repeat the same malformed output, so retries sample at this temperature.
    retry_temperature: Annotated[float, Meta(ge=0.0)] = 0.7
    # Conversation tokens the judge prompt may hold; 0 = derive from engine.max_model_len (vllm
    # backend) or no limit (openai backend). Longer conversations keep their newest turns.
    max_conversation_tokens: Annotated[int, Meta(ge=0, description="0 = derive")] = 0


class ScorerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[scorer]: reward assembly."""

    concurrency: Annotated[int, Meta(ge=1)] = 8  # trajectories scored at once
    # metric -> weight in the total; {} = the environment's default weights. The names are checked
    # against the run's environment by config/run.py (RunConfig), which fills this in.
    weights: dict[str, float] = {}
    clamps: dict[str, list[float]] = {}  # metric -> [lo, hi], applied before weighting
    bleu_variant: str = "sacrebleu"  # "sacrebleu" | "char" (CollabLLM's character-level BLEU)
    extract: str = "judge"  # "judge" | "last_document": who finds the document BLEU compares
    # "rubric" (0..3 on three criteria, the levels the judge wrote) | "rubric_expected" (the same rubric,
    # each criterion's expected level under the judge's own distribution; needs a local vllm judge) |
    # "3level" (CollabLLM's 1 / 0.5 / 0)
    interactivity: str = "rubric"
    judge_timeout_s: Annotated[float, Meta(gt=0)] = 300.0  # one judge request
    judge_concurrency: Annotated[int, Meta(ge=1)] = 16  # judge requests in flight from one scorer
    # first back-off when the judge is down or fails; doubles each time
    retry_delay_s: Annotated[float, Meta(gt=0)] = 5.0
    retry_max_delay_s: Annotated[float, Meta(gt=0)] = 30.0
    # While the judge (or the reference service) is unreachable a trajectory is held and asked again
    # (its deliveries are not spent: a restart can take minutes); after this long it is nak'ed and
    # counts one delivery.
    judge_wait_s: Annotated[float, Meta(ge=0)] = 900.0
    # [policy] reference = "service": one reference-service request per trajectory; waits for an
    # unreachable service as for the judge (judge_wait_s), spending no delivery.
    reference_timeout_s: Annotated[float, Meta(gt=0)] = 300.0
    # The judge's reliability, watched while training (rewards.reliability): this share of judged
    # trajectories (chosen by id, the same on every replica) is judged a second time, by the same
    # judge at another seed, sampled at audit_temperature (a greedy judge asked again greedily
    # would only repeat itself). The second verdict is stored (Scored.audit), never rewarded.
    audit_fraction: Annotated[float, Meta(ge=0.0, le=1.0, description="0 = no second verdicts")] = 0.0
    audit_temperature: Annotated[float, Meta(ge=0.0)] = 0.7
    # two verdicts of a judge metric agree when they differ by at most this much (metrics are 0..1)
    audit_tolerance: Annotated[float, Meta(ge=0.0)] = 0.1
    # flagged (a warning and judge_audit.flagged = 1) while agreement over the last audit_window
    # audited values is below this, once audit_min_samples were audited; 0 = never flagged
    audit_min_agreement: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.8
    audit_window: Annotated[int, Meta(ge=1)] = 200
    audit_min_samples: Annotated[int, Meta(ge=1)] = 20
    # how token_amount is counted (rewards.metrics.TokenAmount): "assistant_tokens_k" (the paper's,
    # assistant tokens / 1000) | "future_words" (verl's recipe: words after the dataset prefix, unscaled)
    token_amount: TokenAmount = "assistant_tokens_k"
    # the extracted document's double quotes for BLEU (rewards.metrics.ExtractQuotes): "keep" | "single"
    # (every " written ', as verl's recipe asks its extracting judge; applied here after extraction)
    extract_quotes: ExtractQuotes = "keep"

    def __post_init__(self) -> None:
        if self.bleu_variant not in BLEU_VARIANTS:
            raise ValueError(f"bleu_variant={self.bleu_variant!r} not allowed; use one of {tuple(BLEU_VARIANTS)}")
        if self.extract not in EXTRACTORS:
            raise ValueError(f"extract={self.extract!r} not allowed; use one of {EXTRACTORS}")
        if self.interactivity not in INTERACTIVITY_SCALES:
            raise ValueError(
                f"interactivity={self.interactivity!r} not allowed; use one of {tuple(INTERACTIVITY_SCALES)}"
            )
        for k, v in self.clamps.items():
            if len(v) != 2 or v[0] > v[1]:
                raise ValueError(f"clamps.{k}={v} must be [lo, hi] with lo <= hi")
        if self.retry_delay_s > self.retry_max_delay_s:
            raise ValueError(
                f"retry_delay_s={self.retry_delay_s}, retry_max_delay_s={self.retry_max_delay_s}: "
                "need 0 < retry_delay_s <= retry_max_delay_s"
            )

    def retry_delay(self, delivered: int) -> float:
        """Back-off before redelivery number `delivered` + 1: doubles from retry_delay_s, capped."""
        return min(self.retry_max_delay_s, self.retry_delay_s * 2 ** max(0, delivered - 1))
