"""Unit tests for evaluation.benchmark: paired t statistics against scipy, the summarize() path on the
published rows, pairing by item, and the Markdown / CSV / PNG outputs."""

import csv
import math

import numpy as np
import pytest
import scipy.stats

from parley.evaluation.benchmark import mean_interval, paired_stats, summarize, to_markdown, write_table
from parley.protocol.messages import EvalRecord
from tests.factories import eval_record

# The reference benchmark's published rows: (condition, BLEU, interactivity, tokens (k), MR).
PUBLISHED = [
    ("base", 0.4491, 0.831, 2.935, 0.9870),
    ("grpo-50", 0.4524, 0.819, 2.281, 1.0433),
    ("grpo-100", 0.4827, 0.801, 2.077, 1.0761),
    ("grpo-129", 0.4825, 0.744, 1.944, 1.0316),
    ("proactive", 0.4669, 0.825, 1.678, 1.1236),
]


def record(condition, item, bleu, inter, tokens, seed=0, **kw):
    return eval_record(condition, item, bleu, inter, tokens, seed, **kw)


def published_records():
    # Four items per condition whose values spread symmetrically around the published column means.
    offsets = [0.03, -0.03, 0.01, -0.01]
    token_offsets = [400, -400, 150, -150]
    recs = []
    for c, (cond, b, i, tk, _) in enumerate(PUBLISHED):
        for k in range(4):
            # The spread differs by condition so the paired differences are not constant.
            o = offsets[(k + c) % 4]
            recs.append(record(cond, f"item-{k}", b + o, i - o / 2, round(tk * 1000) + token_offsets[(k + c) % 4]))
    return recs


def test_summarize_reproduces_published_columns_and_mr():
    table = summarize(published_records(), baseline="base")
    assert [r.condition for r in table.rows] == [p[0] for p in PUBLISHED]
    for cond, b, i, tk, published_mr in PUBLISHED:
        row = table.row(cond)
        assert row.n == 4
        assert row.means["bleu"] == pytest.approx(b, abs=1e-12)
        assert row.means["interactivity"] == pytest.approx(i, abs=1e-12)
        assert row.means["tokens_k"] == pytest.approx(tk, abs=1e-12)
        assert abs(row.means["mr"] - published_mr) < 1e-3


def test_summarize_diffs_are_paired_by_item():
    table = summarize(published_records(), baseline="base")
    assert table.row("base").diffs == {}
    s = table.row("grpo-100").diffs["mr"]
    assert s.n == 4 and s.df == 3
    assert s.mean_diff == pytest.approx(1.0761 - 0.9870, abs=1e-3)
    recs = published_records()
    a = [next(r for r in recs if r.condition == "grpo-100" and r.item_id == f"item-{k}") for k in range(4)]
    b = [next(r for r in recs if r.condition == "base" and r.item_id == f"item-{k}") for k in range(4)]
    mr_a = [x.metrics["bleu"] + x.metrics["interactivity"] - 0.1 * x.assistant_tokens / 1000 for x in a]
    mr_b = [x.metrics["bleu"] + x.metrics["interactivity"] - 0.1 * x.assistant_tokens / 1000 for x in b]
    t_ref = scipy.stats.ttest_rel(mr_a, mr_b)
    assert s.t == pytest.approx(t_ref.statistic, rel=1e-9)
    assert s.p == pytest.approx(t_ref.pvalue, rel=1e-9)


@pytest.mark.parametrize("n,seed", [(2, 0), (5, 1), (30, 2), (100, 3)])
def test_paired_stats_match_scipy_ttest_rel_and_t_interval(n, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(0.45, 0.1, n)
    b = a + rng.normal(0.02, 0.05, n)
    s = paired_stats(a.tolist(), b.tolist())
    ref = scipy.stats.ttest_rel(a, b)
    assert s.n == n and s.df == n - 1
    assert s.t == pytest.approx(ref.statistic, rel=1e-10)
    assert s.p == pytest.approx(ref.pvalue, rel=1e-9)
    d = a - b
    half = scipy.stats.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n)
    assert s.mean_diff == pytest.approx(d.mean(), abs=1e-15)
    assert s.ci_low == pytest.approx(d.mean() - half, rel=1e-10)
    assert s.ci_high == pytest.approx(d.mean() + half, rel=1e-10)


def test_paired_stats_degenerate_cases():
    same = paired_stats([0.1, 0.2, 0.3], [0.1, 0.2, 0.3])
    assert (same.mean_diff, same.t, same.p, same.ci_low, same.ci_high) == (0.0, 0.0, 1.0, 0.0, 0.0)
    shifted = paired_stats([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])
    assert shifted.t == math.inf and shifted.p == 0.0 and shifted.ci_low == shifted.ci_high == pytest.approx(0.5)
    one = paired_stats([1.0], [0.0])
    assert one.mean_diff == 1.0 and math.isnan(one.t) and math.isnan(one.ci_low) and one.n == 1
    with pytest.raises(ValueError, match="equal lengths"):
        paired_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least one pair"):
        paired_stats([], [])
    with pytest.raises(ValueError, match="non-finite"):
        paired_stats([1.0, math.nan], [1.0, 2.0])


def test_mean_interval_matches_scipy():
    x = [0.2, 0.5, 0.4, 0.9, 0.3]
    mean, lo, hi = mean_interval(x)
    ref_lo, ref_hi = scipy.stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=scipy.stats.sem(x))
    assert mean == pytest.approx(np.mean(x)) and lo == pytest.approx(ref_lo) and hi == pytest.approx(ref_hi)


def test_seeds_of_one_item_are_averaged_and_only_shared_items_are_paired():
    recs = [
        record("base", "a", 0.2, 0.5, 1000, seed=0),
        record("base", "a", 0.4, 0.7, 3000, seed=1),
        record("base", "b", 0.5, 0.5, 1000),
        record("base", "c", 0.1, 0.1, 1000),
        record("new", "a", 0.6, 0.6, 1000),
        record("new", "b", 0.6, 0.6, 1000),
    ]
    table = summarize(recs, baseline="base")
    base = table.row("base")
    assert base.n == 3 and base.records == 4
    assert base.means["bleu"] == pytest.approx((0.3 + 0.5 + 0.1) / 3)
    assert base.means["tokens_k"] == pytest.approx((2.0 + 1.0 + 1.0) / 3)
    diff = table.row("new").diffs["bleu"]
    assert diff.n == 2 and diff.mean_diff == pytest.approx(((0.6 - 0.3) + (0.6 - 0.5)) / 2)


def test_summarize_errors_name_the_problem():
    recs = [record("base", "a", 0.2, 0.5, 1000)]
    with pytest.raises(ValueError, match="baseline condition 'nope'.*base"):
        summarize(recs, baseline="nope")
    unscored = EvalRecord(
        eval_id="x",
        condition="base",
        item_id="b",
        model="m",
        system_prompt="",
        sim_prompt="lazy_full",
        sim_model="s",
        judge_model="j",
        seed=0,
        messages=[],
        reference="r",
        assistant_tokens=5,
    )
    with pytest.raises(ValueError, match="record 'x'.*no 'bleu' metric"):
        summarize([*recs, unscored], baseline="base")


def test_extra_metric_column_reward():
    recs = [record("base", "a", 0.2, 0.5, 1000, reward=1.0), record("new", "a", 0.2, 0.5, 1000, reward=2.0)]
    table = summarize(recs, baseline="base", metrics=("bleu", "reward"))
    assert table.row("new").diffs["reward"].mean_diff == 1.0
    assert "| reward |" in to_markdown(table)


def test_write_table_outputs(tmp_path):
    table = summarize(published_records(), baseline="base")
    paths = write_table(table, tmp_path / "out")
    md = paths["md"].read_text()
    assert md.startswith("| condition | n | BLEU | interactivity | tokens (k) | MR |")
    # MR from the rounded published columns is 0.9866 (published 0.9870, within 1e-3).
    assert "| base | 4 | 0.4491 | 0.831 | 2.935 | 0.9866 |" in md
    assert "Paired differences to `base`" in md
    rows = list(csv.DictReader(paths["csv"].open()))
    assert len(rows) == 5 * 4
    base_mr = next(r for r in rows if r["condition"] == "base" and r["metric"] == "mr")
    assert float(base_mr["mean"]) == pytest.approx(0.4491 + 0.831 - 0.2935) and base_mr["diff"] == ""
    p100 = next(r for r in rows if r["condition"] == "grpo-100" and r["metric"] == "bleu")
    assert float(p100["diff"]) == pytest.approx(0.4827 - 0.4491) and int(p100["n_paired"]) == 4
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
