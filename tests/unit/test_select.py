"""Unit tests for evaluation.selection: the training reward is refused, the best version is picked on a
planted set of per-version eval records, summary.jsonl is read, and regressions are detected."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from parley.deploy.cli import app
from parley.evaluation.evallog import write_parquet
from parley.evaluation.selection import SelectionError, VersionEval, load_versions, regressed, select_best
from parley.protocol.messages import ChatMessage, EvalRecord

N_ITEMS = 12


def version_records(version, bleu, inter, tokens, noise_seed):
    """Per-item records around the given means; item noise is shared across versions (paired design)."""
    item_rng = np.random.default_rng(0)
    item_effect = item_rng.normal(0, 0.05, N_ITEMS)
    rng = np.random.default_rng(noise_seed)
    recs = []
    for k in range(N_ITEMS):
        recs.append(
            EvalRecord(
                eval_id=f"v{version}/item-{k}",
                condition=f"v{version}",
                item_id=f"item-{k}",
                model="m",
                system_prompt="",
                sim_prompt="lazy_full",
                sim_model="s",
                judge_model="j",
                seed=k,
                messages=[ChatMessage("user", "write it")],
                reference="ref",
                version=version,
                assistant_tokens=int(tokens * 1000 + rng.integers(-50, 50)),
                metrics={
                    "bleu": float(bleu + item_effect[k] + rng.normal(0, 0.005)),
                    "interactivity": float(inter + rng.normal(0, 0.005)),
                },
            )
        )
    return recs


@pytest.fixture
def run_dir(tmp_path):
    # v0 base; v1 best MR; v2 best BLEU, but interactivity has collapsed so its MR is lower (the story
    # of the seed model card: later training improved one column while the benchmark regressed).
    plan = {0: (0.449, 0.83, 2.9), 1: (0.482, 0.80, 2.1), 2: (0.490, 0.70, 1.9)}
    for v, (b, i, t) in plan.items():
        write_parquet(version_records(v, b, i, t, noise_seed=v + 1), tmp_path / "eval" / f"v{v}" / "records.parquet")
    return tmp_path


def test_select_best_by_each_metric(run_dir):
    sel = select_best(run_dir, "mr")
    assert sel.version == 1 and sel.n == N_ITEMS
    assert sel.ci_low < sel.mean < sel.ci_high
    assert [v for v, _, _ in sel.ranking] == [1, 2, 0]
    assert sel.first_version == 0 and sel.vs_first.mean_diff > 0 and sel.vs_first.p < 0.05
    assert sel.runner_up == 2 and sel.vs_runner_up.n == N_ITEMS
    assert select_best(run_dir, "bleu").version == 2
    assert select_best(run_dir, "interactivity").version == 0
    assert "best by mr: v1" in sel.describe()


@pytest.mark.parametrize("metric", ["reward", "total", "Reward"])
def test_training_reward_is_refused(run_dir, metric):
    with pytest.raises(SelectionError, match="training reward is not a selection metric"):
        select_best(run_dir, metric)
    with pytest.raises(SelectionError, match="training reward"):
        regressed(load_versions(run_dir), metric)


def test_unknown_metric_and_empty_run(tmp_path):
    with pytest.raises(SelectionError, match="'tokens' not allowed; use one of bleu, interactivity, mr"):
        select_best(tmp_path, "tokens")
    with pytest.raises(SelectionError, match="no evaluated versions"):
        select_best(tmp_path, "mr")


def test_cli_select_refuses_reward_in_one_line_and_names_best(run_dir):
    runner = CliRunner()
    res = runner.invoke(app, ["select", str(run_dir), "--metric", "reward"])
    assert res.exit_code == 2
    err = res.stderr.strip()
    assert "\n" not in err and err.startswith("parley select: --metric reward: the training reward")
    assert "step 100" in err
    res = runner.invoke(app, ["select", str(run_dir), "--metric", "mr"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("best by mr: v1")


def test_summary_jsonl_versions(tmp_path):
    lines = []
    for v, shift in [(0, 0.0), (1, 0.05), (2, 0.02)]:
        items = {
            f"i{k}": {"bleu": 0.4 + shift + 0.01 * k, "interactivity": 0.8, "tokens_k": 2.0 + 0.1 * (k % 2)}
            for k in range(5)
        }
        lines.append(json.dumps({"version": v, "step": v * 10, "items": items}))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "summary.jsonl").write_text("\n".join(lines) + "\n")
    sel = select_best(tmp_path, "bleu")
    assert (sel.version, sel.step, sel.n) == (1, 10, 5)
    assert sel.mean == pytest.approx(0.45 + 0.02)
    assert sel.vs_first.mean_diff == pytest.approx(0.05)
    (tmp_path / "eval" / "summary.jsonl").write_text('{"version": 3, "items": {"a": {"bleu": 0.1}}}\n')
    with pytest.raises(
        SelectionError, match="summary.jsonl:1: item 'a' needs numeric bleu, interactivity and tokens_k"
    ):
        load_versions(tmp_path)


def test_regressed_against_best_so_far(run_dir):
    versions = load_versions(run_dir)
    assert [v.version for v in versions] == [0, 1, 2]
    assert not regressed(versions[:1], "mr")
    assert not regressed(versions[:2], "mr")  # v1 improved on v0
    assert regressed(versions, "mr", alpha=0.05)  # v2 is worse than the best so far, v1
    assert not regressed(versions, "bleu", alpha=0.05)  # but better by BLEU
    flat = [VersionEval(0, {"a": {"mr": 1.0}, "b": {"mr": 1.0}}), VersionEval(1, {"a": {"mr": 1.0}, "b": {"mr": 1.0}})]
    assert not regressed(flat, "mr")
