"""Unit tests for rewards.metrics: BLEU variants, token amount, interactivity levels."""

import math

import pytest
import sacrebleu

from rewards.metrics import (
    BLEU_VARIANTS,
    bleu,
    char_bleu,
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
    assert bleu("the cat sat on the mat", "the cat sat on a mat") == pytest.approx(
        (1.0 / 12.0) ** 0.25, abs=1e-9
    )


def test_bleu_empty_document_is_zero():
    assert bleu("", "some reference text") == 0.0
    assert bleu("   \n", "some reference text") == 0.0


def test_bleu_identical_is_one():
    text = "Dear team, the launch moves to Friday. Please update your plans."
    assert bleu(text, text) == 1.0


def test_char_bleu_identical_is_one():
    text = "A short memo about the budget."
    assert char_bleu(text, text) == pytest.approx(1.0, abs=1e-12)


def test_char_bleu_hand_case_with_smoothing():
    # "abcd" vs "abce": p1 = 3/4, p2 = 2/3, p3 = 1/2, p4 = 0/1 -> epsilon 0.1 / 1; BP = 1.
    expected = (0.75 * (2 / 3) * 0.5 * 0.1) ** 0.25
    assert char_bleu("abcd", "abce") == pytest.approx(expected, abs=1e-12)


def test_char_bleu_hand_case_with_brevity_penalty():
    # "ab" vs "abcd": p1 = 2/2, p2 = 1/1, p3 and p4 have no n-grams -> 0.1 / 1 each;
    # BP = exp(1 - 4/2).
    expected = math.exp(1 - 4 / 2) * (1.0 * 1.0 * 0.1 * 0.1) ** 0.25
    assert char_bleu("ab", "abcd") == pytest.approx(expected, abs=1e-12)


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
    assert interactivity_from_levels(
        {"understanding": 3, "clarification": 3, "suggestions": 3}
    ) == pytest.approx(1.0)
    assert interactivity_from_levels(
        {"understanding": 1, "clarification": 2, "suggestions": 3}
    ) == pytest.approx(2 / 3)
    assert interactivity_from_levels(
        {"understanding": 0, "clarification": 0, "suggestions": 0}
    ) == 0.0


def test_interactivity_missing_key_raises():
    with pytest.raises(ValueError, match="suggestions"):
        interactivity_from_levels({"understanding": 1, "clarification": 2})


@pytest.mark.parametrize("bad", [4, -1, 2.5, True, "2"])
def test_interactivity_out_of_range_raises(bad):
    with pytest.raises(ValueError, match="clarification"):
        interactivity_from_levels({"understanding": 1, "clarification": bad, "suggestions": 2})
