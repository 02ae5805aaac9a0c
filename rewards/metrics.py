"""Per-conversation metrics for the CollabLLM "medium" document task: BLEU of the
final document, token amount, and the interactivity level from the judge.
Pure functions; called by the scorer when it turns a finished rollout into metrics.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Literal, get_args


def bleu(document: str, reference: str) -> float:
    """sacreBLEU sentence BLEU of `document` against one `reference`, on a 0..1 scale.

    Default sacreBLEU settings: 13a word tokenization, 4-gram, exp smoothing,
    effective order. An empty (or whitespace-only) document scores 0.0.
    """
    if not document.strip():
        return 0.0
    import sacrebleu  # here, not at the top: configs import this module to name the variants

    score = sacrebleu.sentence_bleu(document, [reference]).score / 100.0
    # sacreBLEU reports a perfect match as 100.00000000000004; keep the range exact.
    return min(1.0, max(0.0, score))


_CHAR_BLEU_MAX_N = 4


def _ngram_counts(seq: str, n: int) -> Counter[str]:
    return Counter(seq[i : i + n] for i in range(len(seq) - n + 1))


def char_bleu(document: str, reference: str) -> float:
    """Sentence BLEU over CHARACTER sequences, exactly what CollabLLM reported.

    CollabLLM called NLTK's `sentence_bleu([reference], document)` on raw strings with NLTK's
    defaults. NLTK iterates a string character by character, so every "token" is one character
    (spaces and punctuation included). We compute the same number without depending on NLTK
    (tests/unit/test_metrics.py checks it against NLTK itself):

    - n-grams are 1..4-grams of characters, uniform weights 1/4;
    - modified (clipped) precision p_n = matched / max(1, #document n-grams);
    - no smoothing (NLTK's method0): no unigram match at all gives 0.0; a higher order with no
      match counts as the smallest positive float, so the score is positive but negligible
      (about 1e-77), as NLTK returns it;
    - brevity penalty exp(1 - r/c) when the document has c <= r characters (1 when c > r);
    - result on a 0..1 scale.

    How it differs from `bleu` (sacreBLEU): sacreBLEU tokenizes with 13a into WORDS (splitting
    punctuation off), counts word n-grams, uses "exp" smoothing with effective order, and reports
    0..100. Character n-grams reward partial word overlap, so char_bleu is typically much higher
    than word BLEU for the same pair; the two numbers are not comparable.
    """
    hyp, ref = document, reference
    if not hyp:
        return 0.0
    log_terms = []
    for n in range(1, _CHAR_BLEU_MAX_N + 1):
        hyp_counts = _ngram_counts(hyp, n)
        ref_counts = _ngram_counts(ref, n)
        matched = sum(min(c, ref_counts[g]) for g, c in hyp_counts.items())
        if matched == 0:
            if n == 1:
                return 0.0
            precision = sys.float_info.min  # NLTK's stand-in for log(0)
        else:
            precision = matched / max(1, sum(hyp_counts.values()))
        log_terms.append(math.log(precision) / _CHAR_BLEU_MAX_N)
    c, r = len(hyp), len(ref)
    brevity = 1.0 if c > r else math.exp(1.0 - r / c)
    return min(1.0, brevity * math.exp(math.fsum(log_terms)))


BLEU_VARIANTS: dict[str, Callable[[str, str], float]] = {
    "sacrebleu": bleu,
    "char": char_bleu,
}


def token_amount(n_assistant_tokens: int) -> float:
    """Assistant tokens over the whole conversation, in thousands (the "tokens_k" metric)."""
    return n_assistant_tokens / 1000.0


def future_words(contents: Iterable[str]) -> float:
    """Whitespace-separated words of these messages, user and assistant alike, unscaled: what verl's
    CollabLLM recipe calls token_amount (recipe/collabllm/metrics/token_amount.py counts the words of
    every message after the dataset prompt: the trained turn and its future)."""
    return float(sum(len(c.split()) for c in contents))


# [scorer] token_amount: how the token_amount metric is counted. "assistant_tokens_k": the policy's
# assistant tokens over 1000 (CollabLLM's paper: assistant tokens in thousands); "future_words": the words
# of the conversation after the dataset prefix, unscaled (verl's recipe; at weight -0.1 and a clamp of
# the weighted term to [-1, 1] it saturates for any reply of ten words or more, docs/recipe.md).
TokenAmount = Literal["assistant_tokens_k", "future_words"]
TOKEN_AMOUNTS = get_args(TokenAmount)

# [scorer] extract_quotes: the document BLEU compares as extracted ("keep"), or with every double quote
# written as a single one ("single"): verl's recipe tells its extracting judge to do so
# (recipe/collabllm/metrics/bleu_score.py) and compares the result with the untouched reference.
ExtractQuotes = Literal["keep", "single"]
EXTRACT_QUOTES = get_args(ExtractQuotes)


def quoted(document: str, quotes: str) -> str:
    """`document` as [scorer] extract_quotes says BLEU sees it."""
    return document.replace('"', "'") if quotes == "single" else document


INTERACTIVITY_KEYS = ("understanding", "clarification", "suggestions")
_MAX_LEVEL = 3
_LEVEL_LABELS = {str(level): level for level in range(_MAX_LEVEL + 1)}  # how a level is written in JSON


def interactivity_from_levels(levels: Mapping[str, int]) -> float:
    """Judge levels (each an integer 0..3) -> interactivity in 0..1: their mean over 3."""
    total = 0
    for key in INTERACTIVITY_KEYS:
        if key not in levels:
            raise ValueError(
                f"interactivity level {key!r} missing; need all of {list(INTERACTIVITY_KEYS)}, got {sorted(levels)}"
            )
        level = levels[key]
        # bool is an int subclass; a True from a sloppy judge parse is not a level.
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= _MAX_LEVEL:
            raise ValueError(f"interactivity level {key!r}={level!r} must be an integer in 0..{_MAX_LEVEL}")
        total += level
    return total / len(INTERACTIVITY_KEYS) / _MAX_LEVEL


def interactivity_from_distribution(dist: Mapping[str, Mapping[str, float]]) -> float:
    """The rubric rated by expectation: per criterion the judge's probability of each level 0..3
    (criterion -> {"0": p0, ..., "3": p3}, summing to 1) -> interactivity in 0..1, the mean over the
    criteria of each one's expected level, over 3. With every probability on one level it is
    `interactivity_from_levels` of those levels."""
    total = 0.0
    for key in INTERACTIVITY_KEYS:
        if key not in dist:
            raise ValueError(
                f"interactivity distribution for {key!r} missing; need all of {list(INTERACTIVITY_KEYS)}, got {sorted(dist)}"
            )
        probs = dist[key]
        bad = [lab for lab in probs if lab not in _LEVEL_LABELS]
        if bad:
            raise ValueError(
                f"interactivity distribution for {key!r} has levels {bad}; levels are {list(_LEVEL_LABELS)}"
            )
        if any(not math.isfinite(p) or p < 0 for p in probs.values()) or abs(math.fsum(probs.values()) - 1.0) > 1e-6:
            raise ValueError(f"interactivity distribution for {key!r} is not a distribution: {dict(probs)}")
        total += math.fsum(_LEVEL_LABELS[lab] * p for lab, p in probs.items())
    return total / len(INTERACTIVITY_KEYS) / _MAX_LEVEL


# The 3-level scale of CollabLLM's interactivity judge: high / moderate / low interactivity.
INTERACTIVITY_3LEVEL = (0.0, 0.5, 1.0)
# Interactivity scales ([scorer] interactivity) -> the judge op (protocol.topology.JUDGE_OPS) that rates
# on it: the 0..3 rubric over three criteria (the levels the judge wrote), the same rubric rated by
# the judge's expected level under its own distribution (docs/rewards.md), or CollabLLM's 3-level scale.
INTERACTIVITY_SCALES = {
    "rubric": "interactivity",
    "rubric_expected": "interactivity_expected",
    "3level": "interactivity_3level",
}


def interactivity_from_3level(value: float) -> float:
    """A 3-level verdict (CollabLLM's scale) -> interactivity in 0..1, unchanged; anything but
    0, 0.5 or 1 is refused rather than rounded (a judge that invents levels is not a rating)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) not in INTERACTIVITY_3LEVEL:
        raise ValueError(f"3-level interactivity {value!r} must be one of {INTERACTIVITY_3LEVEL}")
    return float(value)
