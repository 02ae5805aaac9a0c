"""Training samples stay replayable after the streams forgot them: the real Learner (test-double
trainer and actor, as in test_learner_fates) on a real nats-server whose streams hold 64 KiB, so
SCORED drops the first steps' samples; the learner's archive keeps every trained and dropped group
and `parley replay RUN_DIR` re-scores them all."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from parley.evaluation.evallog import read_log, read_stream
from parley.learner.checkpoint import archive_dir
from parley.protocol import topology
from tests.integration.test_learner_fates import drive, make_cfg

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
TINY = topology.BusSettings(max_bytes=64 * 1024, max_msg_bytes=32 * 1024, ack_wait_s=4.0)


async def test_replay_of_steps_the_streams_no_longer_hold(js, nc, tmp_path):
    run, run_dir = "archived", tmp_path / "run"
    cfg = make_cfg(run, run_dir, bus=TINY, steps=3, groups_per_step=2, max_staleness=0)
    await topology.ensure_topology(js, run, TINY)
    # 10 KB per sample: the stream keeps about six; task 1's group is flat (skipped, archived as dropped)
    learner, _ = await drive(js, nc, cfg, lambda i: "flat" if i == 1 else "answer", pad=10_000)
    assert learner.state.step == 3

    stored = {s.traj_id for s in await read_stream(js, run, "scored")}
    step1 = {f"{run}-g{i:06d}/{s}" for i in (0, 2) for s in (0, 1)}
    assert not step1 & stored, "the stream should have dropped step 1's samples"

    root = archive_dir(run_dir)
    names = sorted(p.name for p in root.iterdir())
    assert names == [
        "dropped-00000000.parquet",
        "step000001-trained.parquet",
        "step000002-trained.parquet",
        "step000003-trained.parquet",
    ]
    assert {s.traj_id for s in read_log(root / "step000001-trained.parquet")} == step1
    assert [s.task_id for s in read_log(root / "dropped-00000000.parquet")] == [f"{run}-g000001"] * 2

    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "parley.deploy.cli", "replay", str(run_dir), "--weights", "bleu=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "14 conversations" in proc.stdout  # 3 steps x 2 groups x 2 samples, and the flat group
