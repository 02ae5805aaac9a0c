"""bench/gpu_run.sh part M (part PS with `up.gpu_share="mps"` on the lent GPU) on an image without the
MPS daemon's binary: it says so and runs nothing. What `parley up` does with the setting is in
tests/unit/test_mps.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _part_m(tmp_path: Path, path: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": path, "MPS_PART": "NO_SUCH_PART"}
    res = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_run.sh"), "M"], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    return res, (out / "mps.log").read_text()


def _bin_with(tmp_path: Path) -> Path:
    """A folder of links to the tools part M runs before it looks for the daemon (no nvidia-* among them)."""
    b = tmp_path / "bin"
    b.mkdir()
    for tool in ("bash", "dirname", "date", "mkdir", "tee"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (b / tool).symlink_to(found)
    return b


def test_without_the_daemon_part_m_says_so_and_runs_nothing(tmp_path):
    res, log = _part_m(tmp_path, str(_bin_with(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert "no nvidia-cuda-mps-control on PATH" in log
    assert "usage:" not in res.stderr  # MPS_PART was never reached
