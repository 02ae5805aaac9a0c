"""Unit tests for rewards.metrics: BLEU variants, token amount, interactivity levels."""

import math
import sys
import warnings

import pytest
import sacrebleu

from parley.rewards.metrics import (
    BLEU_VARIANTS,
    INTERACTIVITY_3LEVEL,
    bleu,
    char_bleu,
    interactivity_from_3level,
    interactivity_from_distribution,
    interactivity_from_levels,
    token_amount,
)


def test_bleu_is_sacrebleu_score_over_100():
    doc = "The quick brown fox jumps over the lazy dog near the river bank."
    ref = "A quick brown fox jumped over a lazy dog by the river."
    expected = sacrebleu.sentence_bleu(doc, [ref]).score / 100.0
    assert 0.0 < expected < 1.0
    assert bleu(doc, ref) == pytest.approx(expected, abs=1e-12)


def test_bleu_hand_case():
    # Same length (BP = 1); clipped precisions 5/6, 3/5, 2/4, 1/3 -> (1/12) ** (1/4).
    assert bleu("the cat sat on the mat", "the cat sat on a mat") == pytest.approx((1.0 / 12.0) ** 0.25, abs=1e-9)


def test_bleu_empty_document_is_zero():
    assert bleu("", "some reference text") == 0.0
    assert bleu("   \n", "some reference text") == 0.0


def test_bleu_identical_is_one():
    text = "Dear team, the launch moves to Friday. Please update your plans."
    assert bleu(text, text) == 1.0


def test_char_bleu_identical_is_one():
    text = "A short memo about the budget."
    assert char_bleu(text, text) == pytest.approx(1.0, abs=1e-12)


def test_char_bleu_hand_case_all_orders_match():
    # "abcdab" vs "abcd": p1 = 4/6 (a, b clipped to 1 each), p2 = 3/5 (ab clipped), p3 = 2/4,
    # p4 = 1/3; c = 6 > r = 4, so BP = 1.
    expected = ((4 / 6) * (3 / 5) * (2 / 4) * (1 / 3)) ** 0.25
    assert char_bleu("abcdab", "abcd") == pytest.approx(expected, abs=1e-12)


def test_char_bleu_unmatched_order_is_negligible_not_smoothed():
    # "abcd" vs "abce": p1 = 3/4, p2 = 2/3, p3 = 1/2, p4 = 0/1. No smoothing (NLTK's default, as
    # CollabLLM used it): the unmatched order counts as the smallest float, not as epsilon 0.1.
    expected = math.exp((math.log(0.75) + math.log(2 / 3) + math.log(0.5) + math.log(sys.float_info.min)) / 4)
    assert char_bleu("abcd", "abce") == pytest.approx(expected, rel=1e-12)
    assert 0.0 < char_bleu("abcd", "abce") < 1e-70


def test_char_bleu_hand_case_with_brevity_penalty():
    # "abc" vs "abcabc": p1..p3 = 1, p4 has no 4-gram in the document (0/1); BP = exp(1 - 6/3).
    expected = math.exp(1 - 6 / 3) * math.exp(math.log(sys.float_info.min) / 4)
    assert char_bleu("abc", "abcabc") == pytest.approx(expected, rel=1e-12)


NLTK_CASES = [
    ("A short memo about the budget.", "A short memo about the budget."),
    (
        "The launch moves to Friday; update your plans.",
        "Dear team, the launch moves to Friday. Please update your plans.",
    ),
    (
        "Three Days in Lisbon",
        "Three Days in Lisbon: Hills, Tiles and Too Many Pastries\n\nI landed in Lisbon on a gray morning.",
    ),
    ("abcd", "abce"),
    ("abc", "xyz"),
    ("ab", "abcd"),
    ("", "xyz"),
    ("x", ""),
    ("Héllo wörld, ça va? 😀", "Hello world, ca va?"),
]


@pytest.mark.parametrize("hyp,ref", NLTK_CASES)
def test_char_bleu_equals_nltk_sentence_bleu_on_raw_strings(hyp, ref):
    nltk_bleu = pytest.importorskip("nltk.translate.bleu_score")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NLTK warns when an order has no match; that case is tested too
        expected = float(nltk_bleu.sentence_bleu([ref], hyp))
    assert char_bleu(hyp, ref) == pytest.approx(expected, rel=1e-12, abs=0.0)


def test_char_bleu_on_bundled_documents_equals_nltk():
    nltk_bleu = pytest.importorskip("nltk.translate.bleu_score")
    from parley.tasks.data import load_items

    items = load_items("bundled")[:4]
    for a in items:
        for b in items:
            hyp = b.reference[: len(b.reference) // 2]  # also exercises the brevity penalty
            assert char_bleu(hyp, a.reference) == pytest.approx(
                float(nltk_bleu.sentence_bleu([a.reference], hyp)), rel=1e-12
            )


def test_char_bleu_counts_spaces_as_characters():
    # Differs from the reference only in spacing: word BLEU sees different tokens,
    # character BLEU still sees most character n-grams.
    assert char_bleu("ab cd", "abcd") > 0.0
    assert char_bleu("ab cd", "abcd") < 1.0


def test_char_bleu_no_overlap_and_empty_are_zero():
    assert char_bleu("abc", "xyz") == 0.0
    assert char_bleu("", "xyz") == 0.0


def test_bleu_variants_registry():
    assert BLEU_VARIANTS == {"sacrebleu": bleu, "char": char_bleu}


def test_token_amount_is_thousands():
    assert token_amount(2935) == pytest.approx(2.935)
    assert token_amount(0) == 0.0


def test_interactivity_from_levels():
    assert interactivity_from_levels({"understanding": 3, "clarification": 3, "suggestions": 3}) == pytest.approx(1.0)
    assert interactivity_from_levels({"understanding": 1, "clarification": 2, "suggestions": 3}) == pytest.approx(2 / 3)
    assert interactivity_from_levels({"understanding": 0, "clarification": 0, "suggestions": 0}) == 0.0


def test_interactivity_missing_key_raises():
    with pytest.raises(ValueError, match="suggestions"):
        interactivity_from_levels({"understanding": 1, "clarification": 2})


@pytest.mark.parametrize("bad", [4, -1, 2.5, True, "2"])
def test_interactivity_out_of_range_raises(bad):
    with pytest.raises(ValueError, match="clarification"):
        interactivity_from_levels({"understanding": 1, "clarification": bad, "suggestions": 2})


def test_interactivity_3level_passes_the_three_levels():
    assert INTERACTIVITY_3LEVEL == (0.0, 0.5, 1.0)
    assert [interactivity_from_3level(v) for v in (0, 0.5, 1)] == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("bad", [0.25, 2, -1, True, "1", None, float("nan")])
def test_interactivity_3level_refuses_other_values(bad):
    with pytest.raises(ValueError, match="must be one of"):
        interactivity_from_3level(bad)


def test_interactivity_from_distribution_is_the_mean_expected_level_over_3():
    dist = {
        "understanding": {"0": 0.0, "1": 0.5, "2": 0.5, "3": 0.0},  # E = 1.5
        "clarification": {"0": 0.2, "3": 0.8},  # E = 2.4
        "suggestions": {"2": 1.0},  # E = 2
    }
    assert interactivity_from_distribution(dist) == pytest.approx((1.5 + 2.4 + 2.0) / 9)  # 0.65556
    # all mass on one level per criterion: the sampled rubric's value
    assert interactivity_from_distribution({k: {"1": 1.0} for k in dist}) == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "dist, match",
    [
        ({"understanding": {"1": 1.0}, "clarification": {"1": 1.0}}, "'suggestions' missing"),
        ({"understanding": {"4": 1.0}, "clarification": {"1": 1.0}, "suggestions": {"1": 1.0}}, r"levels \['4'\]"),
        ({"understanding": {"1": 0.7}, "clarification": {"1": 1.0}, "suggestions": {"1": 1.0}}, "not a distribution"),
        (
            {"understanding": {"1": 1.5, "2": -0.5}, "clarification": {"1": 1.0}, "suggestions": {"1": 1.0}},
            "not a distribution",
        ),
        (
            {"understanding": {"1": float("nan")}, "clarification": {"1": 1.0}, "suggestions": {"1": 1.0}},
            "not a distribution",
        ),
    ],
)
def test_interactivity_from_distribution_refuses_what_is_not_one(dist, match):
    with pytest.raises(ValueError, match=match):
        interactivity_from_distribution(dist)
