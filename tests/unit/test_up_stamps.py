"""`parley up`'s start-up lines say how long the command has run (deploy.common.stamped), counted from
the process's start, so a launch's seconds before the first child can be split by the lines' stamps."""

from __future__ import annotations

import re
import subprocess
import sys

from parley.deploy import up
from parley.deploy.common import process_age, stamped


def test_a_stamped_line_ends_with_the_seconds_since_the_process_started():
    line = stamped("run directory: /tmp/r")
    m = re.fullmatch(r"run directory: /tmp/r \[\+([0-9]+\.[0-9]) s\]", line)
    assert m, line
    assert 0.0 < float(m.group(1)) <= process_age() + 0.1


def test_the_age_counts_from_the_process_start_not_from_the_import():
    # a process that waits 0.5 s before it imports the helper: the age counts the wait too
    code = "import time; time.sleep(0.5); from parley.deploy.common import process_age; print(process_age())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert 0.5 <= float(out.stdout.split()[-1]) < 60.0, out.stdout


def test_the_model_lines_are_stamped(monkeypatch, capsys, tmp_path):
    import parley.engines.models as models

    monkeypatch.setattr(models, "ensure_model", lambda name: tmp_path / name)  # test double: no build
    from parley.config.run import load_config

    up.prepare_models(load_config(None, []))
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(re.fullmatch(r"model \S+: \S+ \([0-9]+s\) \[\+[0-9.]+ s\]", line) for line in lines), lines


def test_the_memory_plans_head_is_stamped_before_anything_starts(monkeypatch):
    from pathlib import Path

    from typer.testing import CliRunner

    from parley.deploy.cli import app

    async def up_main_double(stop, cfg, live, *rest):  # test double: the run itself is not started
        return 0

    monkeypatch.setattr(up, "up_main", up_main_double)
    gpu1 = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "gpu-1.toml"
    out = CliRunner().invoke(
        app,
        ["up", "--config", str(gpu1), "--set", "up.gpu_memory_gib=80", "--set", 'up.gpu_share="plain"', "--no-live"],
    )
    assert out.exit_code == 0, out.output
    head = next(line for line in out.output.splitlines() if line.startswith("GPU memory plan"))
    assert re.search(r"GPU total 80\.0 GiB \(up\.gpu_memory_gib\) \[\+[0-9.]+ s\]$", head), head
    assert any(line.startswith("  actor-0") for line in out.output.splitlines())  # the rest of the plan as before
