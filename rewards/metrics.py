"""Per-conversation metrics for the CollabLLM "medium" document task: BLEU of the
final document, token amount, and the interactivity level from the judge.
Pure functions; called by the scorer when it turns a finished rollout into metrics.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Mapping



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
_CHAR_BLEU_EPSILON = 0.1


def _ngram_counts(seq: str, n: int) -> Counter[str]:
    return Counter(seq[i : i + n] for i in range(len(seq) - n + 1))


def char_bleu(document: str, reference: str) -> float:
    """Sentence BLEU over CHARACTER sequences, the variant CollabLLM reported.

    CollabLLM passed raw strings to an NLTK-style `sentence_bleu`, which iterates
    a string character by character, so every "token" is one character (spaces
    and punctuation included). We reproduce that here without depending on NLTK:

    - n-grams are 1..4-grams of characters, uniform weights 1/4;
    - modified (clipped) precision p_n = matched / max(1, #hypothesis n-grams);
    - smoothing like NLTK's method1: a p_n with zero matches becomes
      epsilon / denominator (epsilon = 0.1) instead of zeroing the score,
      except that no unigram match at all gives 0.0 (as NLTK does);
    - brevity penalty exp(1 - r/c) when the document has c < r characters;
    - result on a 0..1 scale.

    How it differs from `bleu` (sacreBLEU): sacreBLEU tokenizes with 13a into
    WORDS (splitting punctuation off), counts word n-grams, uses "exp" smoothing
    with effective order, and reports 0..100. Character n-grams reward partial
    word overlap, so char_bleu is typically much higher than word BLEU for the
    same pair; the two numbers are not comparable.
    """
    hyp, ref = document, reference
    if not hyp or not ref:
        return 0.0

    log_sum = 0.0
    for n in range(1, _CHAR_BLEU_MAX_N + 1):
        hyp_counts = _ngram_counts(hyp, n)
        ref_counts = _ngram_counts(ref, n)
        matched = sum(min(c, ref_counts[g]) for g, c in hyp_counts.items())
        denominator = max(1, sum(hyp_counts.values()))
        if matched == 0:
            if n == 1:
                return 0.0
            precision = _CHAR_BLEU_EPSILON / denominator
        else:
            precision = matched / denominator
        log_sum += math.log(precision) / _CHAR_BLEU_MAX_N

    c, r = len(hyp), len(ref)
    brevity = 1.0 if c > r else math.exp(1.0 - r / c)
    return min(1.0, brevity * math.exp(log_sum))


BLEU_VARIANTS: dict[str, Callable[[str, str], float]] = {
    "sacrebleu": bleu,
    "char": char_bleu,
}


def token_amount(n_assistant_tokens: int) -> float:
    """Assistant tokens over the whole conversation, in thousands (the "tokens_k" metric)."""
    return n_assistant_tokens / 1000.0


INTERACTIVITY_KEYS = ("understanding", "clarification", "suggestions")
_MAX_LEVEL = 3


def interactivity_from_levels(levels: Mapping[str, int]) -> float:
    """Judge levels (each an integer 0..3) -> interactivity in 0..1: their mean over 3."""
    total = 0
    for key in INTERACTIVITY_KEYS:
        if key not in levels:
            raise ValueError(
                f"interactivity level {key!r} missing; need all of {list(INTERACTIVITY_KEYS)}, "
                f"got {sorted(levels)}"
            )
        level = levels[key]
        # bool is an int subclass; a True from a sloppy judge parse is not a level.
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= _MAX_LEVEL:
            raise ValueError(
                f"interactivity level {key!r}={level!r} must be an integer in 0..{_MAX_LEVEL}"
            )
        total += level
    return total / len(INTERACTIVITY_KEYS) / _MAX_LEVEL
