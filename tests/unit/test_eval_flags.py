"""`parley eval` prints, under its table, each metric's winner and MR's difference to the baseline by
term, flagged where the token term dominates a gain; and writes them to flags.json."""

from __future__ import annotations

import json

import pytest

from parley.evaluation.benchmark import flags, flags_markdown, summarize
from parley.evaluation.commands import report
from tests.factories import eval_record as record

# "short" only writes 1000 fewer tokens an item (+0.1 MR, all of it the token term); "better" gains
# 0.2 BLEU an item and writes 500 more tokens (-0.05 MR from the token term)
RECORDS = [
    record("v0", "a", 0.30, 0.60, 2000),
    record("v0", "b", 0.40, 0.50, 3000),
    record("short", "a", 0.30, 0.60, 1000),
    record("short", "b", 0.40, 0.50, 2000),
    record("better", "a", 0.50, 0.60, 2500),
    record("better", "b", 0.60, 0.50, 3500),
]


def test_the_token_term_is_split_out_and_flagged_where_it_dominates():
    f = flags(summarize(RECORDS, "v0"))
    assert f["wins_by_metric"] == {"bleu": "better", "interactivity": "v0", "tokens_k": "short", "mr": "better"}
    short, better = f["mr_token_term"]["short"], f["mr_token_term"]["better"]
    assert short["token_term"] == pytest.approx(0.1) and short["dominated_by_tokens"] is True
    assert better["token_term"] == pytest.approx(-0.05) and better["dominated_by_tokens"] is False


def test_parley_eval_prints_the_flag_and_writes_flags_json(tmp_path, capsys):
    assert report(RECORDS, [], len(RECORDS), "v0", tmp_path) == 0
    out = capsys.readouterr().out
    assert (
        "Best mean of each metric: BLEU `better`, interactivity `v0`, tokens (k) `short` (lowest), MR `better`." in out
    )
    (short_line,) = [line for line in out.splitlines() if line.startswith("| short | +0.1000 |")]
    assert short_line.endswith("| 100% | MR gain dominated by the token term |")
    (better_line,) = [line for line in out.splitlines() if line.startswith("| better | +0.1500 |")]
    assert better_line.endswith("|  |")
    assert json.loads((tmp_path / "flags.json").read_text())["mr_token_term"]["short"]["dominated_by_tokens"] is True


def test_one_condition_has_no_flags():
    assert flags_markdown(summarize(RECORDS[:2], "v0")) == ""
