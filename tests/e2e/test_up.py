"""`parley up` on the toy model for 2 steps: every role as a real child process over a real nats-server,
with `[log] wandb` on (no key: offline run directories, read back from their files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]


def test_up_runs_two_steps_and_writes_summary_checkpoint_and_charts(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "parley.deploy.cli",
            "up",
            "--config",
            str(ROOT / "deploy/configs/tiny.toml"),
            "--steps",
            "2",
            "--no-live",
            "--run-dir",
            str(run_dir),
            "--set",
            "log.wandb=true",
        ],
        capture_output=True,
        text=True,
        timeout=1400,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all roles ready" in out.stdout
    assert "reward terms per step" in out.stdout

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert set(rows[0]["reward_terms"]) == {"bleu", "interactivity", "token_amount"}

    # Weights were broadcast after each step (versions 1 and 2) and the actor served them.
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "published weights version 1" in learner_log and "published weights version 2" in learner_log
    actor_log = (run_dir / "logs" / "actor-0.log").read_text()
    assert "now serving weights version 2" in actor_log

    # Exactly the trained trajectories are in the ledger, each once.
    trained = [t for line in (run_dir / "trained.jsonl").read_text().splitlines() for t in json.loads(line)["traj_ids"]]
    assert len(trained) == len(set(trained)) == 2 * 2  # groups_per_step 1 x n 2 x 2 steps

    assert sorted(p.name for p in (run_dir / "learner" / "ckpt").glob("step*")) == ["step000001", "step000002"]
    for png in ("rewards.png", "kl.png", "eval.png"):
        assert (run_dir / "report" / png).stat().st_size > 1000
    # The learner's periodic eval (tiny.toml: every version) played versions 0, 1 and 2 on the same
    # held-out items through `parley eval` and the sim/judge services, under the eval role's credentials.
    from parley.evaluation.evallog import read_records

    for v in (0, 1, 2):
        recs = read_records(run_dir / "eval" / f"v{v}" / "records.parquet")
        assert {r.version for r in recs} == {v} and {r.condition for r in recs} == {f"v{v}"}
        assert sorted(r.item_id for r in recs) == sorted(
            r.item_id for r in read_records(run_dir / "eval" / "v0" / "records.parquet")
        )
    assert "eval: version 2 (step 2) on" in learner_log
    # One eval child with one policy engine played all three versions, loading versions 1 and 2 in place.
    assert "engine starts 1, in-place loads 2" in (run_dir / "eval" / "v2" / "eval.log").read_text()
    assert "| v0 |" in out.stdout and "| v2 |" in out.stdout and "best by mr: v" in out.stdout
    sel = subprocess.run(
        [sys.executable, "-m", "parley.deploy.cli", "select", str(run_dir), "--metric", "mr"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sel.returncode == 0 and "best by mr: v" in sel.stdout, sel.stderr
    best = int(sel.stdout.split("best by mr: v")[1].split()[0])
    assert [p.name for p in (run_dir / "eval" / "models").iterdir()] == ([f"v{best}"] if best else [])
    for role in ("services", "actor-0", "scorer-0", "learner"):
        assert (run_dir / "roles" / f"{role}.cmd").exists() and (run_dir / "roles" / f"{role}.toml").exists()
        assert "--metrics-port" in (run_dir / "roles" / f"{role}.cmd").read_text()  # up asks each child for metrics
    targets = json.loads((run_dir / "prometheus-targets.json").read_text())
    assert {t["labels"]["child"] for t in targets} == {"services", "actor-0", "scorer-0", "learner"}

    # [log] wandb: the learner's run holds each step's metrics (the numbers of metrics.jsonl and
    # TensorBoard), and each evaluated version's means; up's report run holds the eval table and charts.
    from tests.wandb_files import offline_runs

    runs = offline_runs(run_dir / "wandb")
    assert set(runs) == {"learner", "report"} and {r["run"].run_group for r in runs.values()} == {"tiny"}
    stepped = {h["_step"]: h for h in runs["learner"]["history"] if "loss" in h}
    assert sorted(stepped) == [1, 2]
    for r in rows:
        assert stepped[r["step"]]["reward_mean"] == pytest.approx(r["reward_mean"])
        assert stepped[r["step"]]["reward_terms/bleu/mean"] == pytest.approx(r["reward_terms"]["bleu"]["mean"])
    assert {h["eval/version"] for h in runs["learner"]["history"] if "eval/version" in h} == {0, 1, 2}
    report = {k for h in runs["report"]["history"] for k in h}
    assert {"eval/table/_type", "report/rewards/_type", "report/kl/_type"} <= report
    assert "wandb sync" in out.stdout
