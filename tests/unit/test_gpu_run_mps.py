"""bench/gpu_run.sh part M (CUDA MPS on the lent GPU), its paths that a machine without a GPU can take:
no daemon binary, and a daemon whose server gives no CUDA context. The daemon here is a test double (a
script named nvidia-cuda-mps-control that records what it was asked); part P never runs in these tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _part_m(tmp_path: Path, path: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": path, "MPS_PART": "NO_SUCH_PART"}
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "M"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    return res, (out / "mps.log").read_text()


def _bin_with(tmp_path: Path, *names: str) -> Path:
    """A folder of links to the tools part M needs besides the daemon (bash, coreutils, python3)."""
    b = tmp_path / "bin"
    b.mkdir()
    for tool in ("bash", "dirname", "date", "mkdir", "tee", "tr", "tail", "cat", *names):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if found:
            (b / tool).symlink_to(found)
    (b / "python3").symlink_to(sys.executable)
    return b


def test_without_the_daemon_part_m_says_so_and_runs_nothing(tmp_path):
    res, log = _part_m(tmp_path, str(_bin_with(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert "no nvidia-cuda-mps-control on PATH" in log
    assert "usage:" not in res.stderr  # MPS_PART was never reached


def test_a_daemon_without_a_cuda_context_is_reported_and_told_to_quit(tmp_path):
    b = _bin_with(tmp_path)
    calls = tmp_path / "calls"
    daemon = b / "nvidia-cuda-mps-control"
    daemon.write_text(f'#!/bin/bash\necho "args=$* stdin=$( [ -t 0 ] || cat )" >> {calls}\n')
    daemon.chmod(0o755)
    res, log = _part_m(tmp_path, str(b))
    assert res.returncode == 0, res.stderr
    probe = "import torch; print(torch.cuda.is_available())"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "True":
        return  # a GPU here: the context comes up and part M goes on to MPS_PART, not this test's path
    assert "no CUDA context under MPS" in log
    asked = calls.read_text().splitlines()
    assert asked[0].startswith("args=-d") and asked[-1] == "args= stdin=quit"  # started, then told to quit
    assert "usage:" not in res.stderr
