"""`parley --help` and a command's `--help` read no bus and train nothing: they import no NATS client,
torch or vLLM (config.run once imported nats through protocol.topology for two names: ~1 s a --help)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import runpy, sys
sys.argv = ["parley", *sys.argv[1:]]
try:
    runpy.run_module("parley.deploy.cli", run_name="__main__")
except SystemExit:
    pass
print("IMPORTED", sorted(m for m in ("nats", "torch", "vllm") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["up", "--help"], ["eval", "--help"]])
def test_help_imports_no_bus_client_torch_or_vllm(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "IMPORTED []" in out.stdout, out.stdout[-500:]
