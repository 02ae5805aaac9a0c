"""`parley up` starts a learner that was SIGKILLed mid-run again with --resume (deploy.up.learner_restart),
under up's own per-role NATS credentials, and the run ends well: every step trained, each trajectory in
the ledger once, nothing dead-lettered. The whole chain, which no unit test covers: up's restart policy,
the learner's lease expiring, the resumed feeder reading back its published tasks (it could not under the
learner's credentials until 2026-12-07), the checkpoint. The toy model; extended tier (46 s alone on 2
cores)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.extended, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def test_a_learner_killed_mid_run_is_started_again_with_resume_and_the_run_ends_well(tmp_path):
    run_dir = tmp_path / "run"
    out_path = tmp_path / "up.out"
    argv = [sys.executable, "-m", "parley.deploy.cli", "up", "--config", str(ROOT / "deploy/configs/tiny.toml")]
    argv += ["--steps", str(STEPS), "--no-live", "--run-dir", str(run_dir), "--set", "learner.eval_every=0"]
    with out_path.open("w") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        learner_log = run_dir / "logs" / "learner.log"
        deadline = time.monotonic() + 600
        # kill it once it has stepped twice (its ledger and a checkpoint exist)
        while not (learner_log.exists() and "step 2:" in learner_log.read_text(errors="replace")):
            assert up.poll() is None, out_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 2 within 600 s"
            time.sleep(0.5)
        pid = int(re.search(r"started learner: pid (\d+)", out_path.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        assert up.wait(timeout=900) == 0, out_path.read_text()[-4000:]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(60)
    text = out_path.read_text()
    assert "learner exited with code -9; starting it again" in text
    again = re.search(r"started learner again: pid \d+ as: (.*) \[", text)
    assert again is not None and again.group(1).endswith("--resume"), text[-3000:]
    assert "resumed at step" in learner_log.read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == STEPS
    trained = [t for line in (run_dir / "trained.jsonl").read_text().splitlines() for t in json.loads(line)["traj_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * 2  # groups_per_step 1 x n 2, each trajectory once
    assert (run_dir / "learner" / "ckpt" / f"step{STEPS:06d}").is_dir()
    progress = [line for line in text.splitlines() if " | dead " in line]
    assert progress and " | dead 0 | " in progress[-1], progress[-1:]
