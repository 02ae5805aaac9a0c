"""bench/collab_table.py's arithmetic on hand-made fixtures: the 25/50/75/100 % versions, the card's
flags (metric winners, the token term's share of MR's difference), the leakage flag, the judge's
discrimination figures and the replay comparison. The statistics themselves are evaluation.benchmark's."""

from __future__ import annotations

import json
import math

import pytest

from bench import collab_table
from parley.evaluation.benchmark import summarize
from tests.factories import eval_record as record


def fixture_table():
    # Two items. "short" only writes fewer tokens (1000 fewer an item: +0.1 MR from the token term
    # alone); "better" gains 0.2 BLEU an item and writes 500 more tokens (-0.05 MR from tokens).
    recs = [
        record("v0", "a", 0.30, 0.60, 2000),
        record("v0", "b", 0.40, 0.50, 3000),
        record("short", "a", 0.30, 0.60, 1000),
        record("short", "b", 0.40, 0.50, 2000),
        record("better", "a", 0.50, 0.60, 2500),
        record("better", "b", 0.60, 0.50, 3500),
    ]
    return summarize(recs, "v0")


def test_fraction_versions_take_the_newest_kept_version_at_or_below_each_fraction():
    kept = [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60]
    assert collab_table.fraction_versions(kept, 60) == {"25%": 15, "50%": 30, "75%": 45, "100%": 60}
    # a run cut by its wall budget at step 37, checkpoints every 5 (35 kept): 9, 18, 28, 37
    assert collab_table.fraction_versions([0, 5, 10, 15, 20, 25, 30, 35, 37], 37) == {
        "25%": 5,
        "50%": 15,
        "75%": 25,
        "100%": 37,
    }
    with pytest.raises(ValueError, match="no kept version at or below 2"):
        collab_table.fraction_versions([5], 8)


def test_flags_name_each_metrics_winner_and_whether_tokens_dominate_the_mr_gain():
    f = collab_table.flags(fixture_table())
    assert f["wins_by_metric"] == {"bleu": "better", "interactivity": "v0", "tokens_k": "short", "mr": "better"}
    short, better = f["mr_token_term"]["short"], f["mr_token_term"]["better"]
    assert short["mr_diff"] == pytest.approx(0.1) and short["token_term"] == pytest.approx(0.1)
    assert short["bleu_plus_interactivity"] == pytest.approx(0.0) and short["token_share"] == pytest.approx(1.0)
    assert short["dominated_by_tokens"] is True
    assert better["mr_diff"] == pytest.approx(0.2 - 0.05) and better["token_term"] == pytest.approx(-0.05)
    assert better["dominated_by_tokens"] is False
    assert "v0" not in f["mr_token_term"]  # the baseline has no difference
    assert f["metrics_won_by_arm"]["better"] == ["bleu", "mr"]


def test_rounded_ties_count_expected_levels_on_the_rubrics_grid_of_ninths():
    d = collab_table.discrimination(
        {1: [[{"interactivity": 4.1 / 9}, {"interactivity": 3.9 / 9}, {"interactivity": 5 / 9}]]}
    )
    assert d["interactivity_pair_ties"] == 0.0
    assert d["interactivity_pair_ties_rounded"] == pytest.approx(1 / 3)  # 4.1 and 3.9 both round to level 4


def test_table_json_carries_n_means_and_paired_intervals():
    rows = {r["condition"]: r for r in collab_table.table_json(fixture_table())}
    assert rows["v0"]["n"] == 2 and rows["v0"]["diff_vs_base"] == {}
    d = rows["short"]["diff_vs_base"]["tokens_k"]
    # both items 1.0 k fewer: a constant difference, zero-width interval (evaluation.benchmark's rule)
    assert (d["diff"], d["ci_low"], d["ci_high"], d["n"]) == (
        pytest.approx(-1.0),
        pytest.approx(-1.0),
        pytest.approx(-1.0),
        2,
    )
    assert rows["better"]["means"]["bleu"] == pytest.approx(0.55)


def test_leakage_flag_fails_only_on_shared_reference_targets(tmp_path):
    assert collab_table.leakage(tmp_path)["passed"] is True
    (tmp_path / "overlap.json").write_text(json.dumps({"references": [], "prompts": [["t1", "e1"]]}))
    assert collab_table.leakage(tmp_path) == {"passed": True, "overlap": {"references": 0, "prompts": 1}}
    (tmp_path / "overlap.json").write_text(json.dumps({"references": [["t1", "e1"]], "prompts": []}))
    assert collab_table.leakage(tmp_path)["passed"] is False


def test_discrimination_counts_same_interactivity_pairs_and_within_group_std():
    s = lambda i, b: {"interactivity": i, "bleu": b}  # noqa: E731
    groups = {
        1: [
            [s(0.5, 0.1), s(0.5, 0.3), s(0.5, 0.2)],  # all tied: 3 of 3 pairs, a flat group
            [s(0.2, 0.0), s(0.8, 0.0)],
        ],  # 0 of 1 pair; BLEU std 0
        2: [[s(1.0, 0.4), s(1.0, 0.4)]],  # 1 of 1 pair, flat; no signal at all
    }
    d = collab_table.discrimination(groups)
    assert d["pairs"] == 5 and d["interactivity_pair_ties"] == pytest.approx(4 / 5)
    assert d["interactivity_pair_ties_rounded"] == pytest.approx(4 / 5)  # 0.2 and 0.8: levels 2 and 7
    assert d["groups"] == 3 and d["interactivity_flat_groups"] == pytest.approx(2 / 3)
    step1 = d["per_step"][0]
    assert step1["interactivity_pair_ties"] == pytest.approx(3 / 4)
    # population std of each group, averaged over the step's groups
    assert step1["within_group_std"]["interactivity"] == pytest.approx((0.0 + 0.3) / 2)
    assert step1["within_group_std"]["bleu"] == pytest.approx((math.sqrt(2 / 300) + 0.0) / 2)
    assert d["steps_without_signal"] == {"bleu": 1, "interactivity": 1}


def test_replay_compare_pairs_the_final_versions_items_across_judges():
    orig = [record("v60", "a", 0.3, 0.6, 1000), record("v60", "b", 0.4, 0.2, 1000), record("v0", "a", 0.1, 0.1, 10)]
    again = [record("v60", "a", 0.3, 0.4, 1000), record("v60", "b", 0.4, 0.1, 1000)]
    c = collab_table.replay_compare(orig, again, "v60")
    assert c["n"] == 2
    assert c["interactivity"]["original"] == pytest.approx(0.4) and c["interactivity"]["replayed"] == pytest.approx(
        0.25
    )
    assert c["interactivity"]["diff"] == pytest.approx(-0.15)
    assert c["interactivity"]["pearson_r"] == pytest.approx(1.0)
    assert math.isnan(c["bleu"]["pearson_r"]) is False and c["bleu"]["diff"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no item of condition 'v9'"):
        collab_table.replay_compare(orig, again, "v9")
