"""bench/gpu_run.sh part S (issue 56: the sleep/wake and merged-LoRA checks before a phased throughput
run) with test doubles for python3 and nvidia-smi: which tests it runs, each under its own limit, and
the card it names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_gpu_run_time_to_target import _run_part

ROOT = Path(__file__).resolve().parents[2]


def test_part_s_runs_the_sleep_tests_then_the_merged_ones_and_names_the_card(tmp_path):
    res, calls, out = _run_part(tmp_path, "S")
    assert res.returncode == 0, res.stderr
    assert "import vllm" in calls[0]  # the versions, beside the card, in gpu.log
    sleep, merged = (c.split("|") for c in calls[1:])
    assert sleep[:2] == ["-m", "pytest"] and "tests/e2e/test_engine_sleep.py" in sleep
    assert sleep[sleep.index("-m", 1) + 1] == "gpu"
    assert "tests/e2e/test_cuda_ipc.py" in merged and merged[merged.index("-k") + 1] == "merged"
    assert "H100" in (out / "gpu.log").read_text()
    assert {p.name for p in out.iterdir()} >= {"gpu.log", "sleep.log", "merged.log"}
    assert "[gpu_run] sleep: rc=0" in res.stdout and "[gpu_run] merged: rc=0" in res.stdout


def test_the_sleep_test_file_is_gpu_marked_and_skips_here():
    """Collected with the CPU build of vLLM, skipped without CUDA: the default suite pays nothing."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/e2e/test_engine_sleep.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert res.returncode == 0 and " skipped in " in res.stdout and "passed" not in res.stdout, res.stdout + res.stderr
