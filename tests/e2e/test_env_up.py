"""Environments through `parley up` on the toy model, every role a real child process over a real
nats-server: `parrot`, pip-installed from tests/data into a directory of this test's and found only
through its entry point, trains one step; `hidden_goal` runs without a simulator or judge process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# extended tier (make test-extended): two whole `parley up` runs; the entry-point discovery of an
# installed environment (tests/unit/test_env_plugin.py) and hidden_goal's children without a simulator
# or judge (tests/unit/test_engine_cpu_binding.py) are held in `make test` by unit tests
pytestmark = [pytest.mark.e2e, pytest.mark.extended, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]
PARROT = ROOT / "tests" / "data" / "parley_env_parrot"


def _up(env_name: str, run_dir: Path, *extra: str) -> list[str]:
    # no periodic eval: it plays through `parley eval` (the sim/judge services), not what is tested here
    return [
        sys.executable,
        "-m",
        "parley.deploy.cli",
        "up",
        "--config",
        str(ROOT / "deploy/configs/tiny.toml"),
        "--env",
        env_name,
        "--no-live",
        "--run-dir",
        str(run_dir),
        "--set",
        "learner.eval_every=0",
        *extra,
    ]


def _no_services(run_dir: Path) -> None:
    started = sorted(p.stem for p in (run_dir / "roles").glob("*.cmd"))
    assert started == ["actor-0", "learner", "scorer-0"], started


def test_an_environment_installed_from_a_package_trains_one_step(tmp_path):
    src, site = tmp_path / "src", tmp_path / "site"
    shutil.copytree(PARROT, src)  # pip builds in the source tree; tests/data stays as committed
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--quiet",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    # Only the children's path holds the package: every role finds `parrot` through its entry point.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    run_dir = tmp_path / "run"
    out = subprocess.run(
        _up("parrot", run_dir, "--steps", "1"), capture_output=True, text=True, timeout=1400, cwd=tmp_path, env=env
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    record = json.loads((run_dir / "environment.json").read_text())
    assert record == {
        "name": "parrot",
        "distribution": "parley-parrot",
        "version": "0.3.1",
        "entry_point": "parley_parrot:ENVIRONMENT",
        "options": {},
    }
    assert json.loads((run_dir / "learner" / "ckpt" / "step000001" / "environment.json").read_text()) == record
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert set(rows[0]["reward_terms"]) == {"echo", "similarity"}
    _no_services(run_dir)
    assert "published weights version 1" in (run_dir / "logs" / "learner.log").read_text()


def test_up_with_hidden_goal_starts_no_simulator_or_judge(tmp_path):
    """The toy model never writes a FINAL line, so every hidden_goal sample of a group gets the same
    reward (goal match 0, the same number of turns): the learner drops each group as zero-advantage
    and would never reach a step. The run is stopped once a complete group reached it."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _up("hidden_goal", run_dir, "--steps", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    learner_log = run_dir / "logs" / "learner.log"
    deadline = time.monotonic() + 1200
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if learner_log.exists() and "zero advantage" in learner_log.read_text():
                break
            time.sleep(2)
        assert proc.poll() is None, "parley up ended before the learner got a group"
        assert "zero advantage" in learner_log.read_text(), "no group reached the learner in time"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)  # up's own Ctrl-C: it stops every role in order
        out, _ = proc.communicate(timeout=120)
    assert "all roles ready" in out, out[-3000:]
    _no_services(run_dir)
    assert json.loads((run_dir / "environment.json").read_text())["name"] == "hidden_goal"
    scorer_log = (run_dir / "logs" / "scorer-0.log").read_text()
    assert "environment hidden_goal" in scorer_log and "judge ops none" in scorer_log
    assert "goal_match" in scorer_log and "assistant_turns" in scorer_log
