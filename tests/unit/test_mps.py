"""`[up] gpu_share = "mps"` (deploy/mps.py): `parley up` runs its own CUDA MPS control daemon for the run,
refuses before anything starts where it cannot, and tells the daemon to quit at the end. The daemon here
is a test double: a script named nvidia-cuda-mps-control on PATH that records its arguments, what it was
sent and its pipe folder; the CUDA probe is a plain Python command (no GPU on this machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from parley.deploy.cli import app
from parley.deploy.mps import BINARY, MpsDaemon, MpsError

ROOT = Path(__file__).resolve().parents[2]
GPU1 = ROOT / "deploy" / "configs" / "gpu-1.toml"
TINY = ROOT / "deploy" / "configs" / "tiny.toml"

# the double: one JSON line per call, with its arguments, its standard input and the pipe folder it was given
DOUBLE = """#!{python}
import json, os, sys
stdin = "" if sys.stdin.isatty() else sys.stdin.read()
with open({calls!r}, "a") as f:
    f.write(json.dumps({{"args": sys.argv[1:], "stdin": stdin, "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}}) + "\\n")
sys.exit({rc})
"""


def double(tmp_path: Path, monkeypatch, rc: int = 0) -> Path:
    """Put the daemon's double first on PATH; returns the file its calls go to."""
    bindir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bindir.mkdir()
    (bindir / BINARY).write_text(DOUBLE.format(python=sys.executable, calls=str(calls), rc=rc))
    (bindir / BINARY).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")
    return calls


def calls_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_daemon_starts_with_the_runs_folders_and_is_told_to_quit(tmp_path, monkeypatch):
    calls = double(tmp_path, monkeypatch)
    probe = [sys.executable, "-c", "import os; assert os.environ['CUDA_MPS_PIPE_DIRECTORY']"]
    mps = MpsDaemon(tmp_path / "run", probe=probe)
    mps.start()
    env = mps.env()
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert pipe.is_dir() and len(str(pipe)) < 80  # a UNIX socket's path is short
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "run" / "mps") and (tmp_path / "run" / "mps").is_dir()
    mps.stop()
    mps.stop()  # idempotent: one quit
    assert [(c["args"], c["stdin"], c["pipe"]) for c in calls_of(calls)] == [
        (["-d"], "", str(pipe)),
        ([], "quit\n", str(pipe)),
    ]
    assert not pipe.exists()


def test_a_cuda_process_that_cannot_run_under_the_daemon_refuses_the_run_and_quits_it(tmp_path, monkeypatch):
    calls = double(tmp_path, monkeypatch)
    probe = [sys.executable, "-c", "import sys; sys.exit('CUDA error: all CUDA-capable devices are busy')"]
    mps = MpsDaemon(tmp_path / "run", probe=probe)
    with pytest.raises(
        MpsError,
        match=r"could not run under it \(exit code 1: CUDA error: all CUDA-capable devices "
        r"are busy;.*gpu_share = \"plain\"",
    ):
        mps.start()
    assert [c["stdin"] for c in calls_of(calls)] == ["", "quit\n"]  # started, then told to quit
    with pytest.raises(MpsError, match="not started"):
        mps.env()


def test_a_daemon_that_does_not_start_is_an_error_with_its_output(tmp_path, monkeypatch):
    double(tmp_path, monkeypatch, rc=3)
    with pytest.raises(MpsError, match=f"{BINARY} -d exited with code 3"):
        MpsDaemon(tmp_path / "run", probe=[sys.executable, "-c", "pass"]).start()


def test_without_the_binary_the_error_names_it_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsError, match=f'needs {BINARY}.*set \\[up\\] gpu_share = "plain"'):
        MpsDaemon(tmp_path / "run")


def test_parley_up_refuses_mps_before_any_work_where_the_binary_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    run_dir = tmp_path / "run"
    out = CliRunner().invoke(
        app,
        [
            "up",
            "--config",
            str(GPU1),
            "--set",
            'up.gpu_share="mps"',
            "--set",
            "up.gpu_memory_gib=80",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert out.exit_code == 2 and f"needs {BINARY}" in out.output
    assert not run_dir.exists()  # refused before the run directory, nats-server or any role
    # a dry run (perhaps on another machine than the run) says so in a note and exits 0
    dry = CliRunner().invoke(app, ["up", "--config", str(GPU1), "--set", 'up.gpu_share="mps"', "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"# GPU sharing: MPS; {BINARY} is not on this machine's PATH" in dry.output
    assert 'gpu_share = "mps"' in dry.output


def test_parley_up_refuses_mps_for_a_config_with_nothing_on_a_gpu(tmp_path, monkeypatch):
    double(tmp_path, monkeypatch)
    out = CliRunner().invoke(app, ["up", "--config", str(TINY), "--set", 'up.gpu_share="mps"', "--dry-run"])
    assert out.exit_code == 2 and "puts nothing on a GPU" in out.output


def test_a_share_other_than_plain_or_mps_is_refused_with_the_key():
    out = CliRunner().invoke(app, ["up", "--config", str(GPU1), "--set", 'up.gpu_share="streams"', "--dry-run"])
    assert out.exit_code != 0 and "up.gpu_share" in out.output


def test_every_child_parley_up_starts_carries_the_daemons_variables(tmp_path, monkeypatch):
    from parley.deploy.up import child_env

    double(tmp_path, monkeypatch)
    mps = MpsDaemon(tmp_path / "run", probe=[sys.executable, "-c", "pass"])
    mps.start()
    creds = {r: (r, f"{r}-pw") for r in ("actor", "scorer", "learner", "services", "eval")}
    try:
        for name in ("actor-0", "scorer-0", "learner", "services"):
            env = child_env(name, creds, 1, mps.env())
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(mps.pipe_dir) and env["CUDA_MPS_LOG_DIRECTORY"] == str(
                mps.log_dir
            )
        assert "CUDA_MPS_PIPE_DIRECTORY" not in child_env("actor-0", creds, 1)  # gpu_share = "plain"
        assert child_env("learner", creds, 1)["PARLEY_NATS_USER"] == "learner"
    finally:
        mps.stop()


def test_auto_takes_mps_where_the_daemon_serves_and_plain_otherwise_saying_why(tmp_path, monkeypatch):
    from parley.deploy.mps import start_for

    assert start_for("auto", tmp_path / "cpu", gpu=False) == (None, "")  # nothing on a GPU: nothing to share
    assert start_for("plain", tmp_path / "plain", gpu=True) == (None, "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no binary: plain, said so
    mps, line = start_for("auto", tmp_path / "none", gpu=True)
    assert mps is None and f'plain (gpu_share = "auto" and {BINARY} is not on this machine\'s PATH)' in line
    calls = double(tmp_path, monkeypatch)
    fails = [sys.executable, "-c", "import sys; sys.exit('CUDA error: all CUDA-capable devices are busy')"]
    mps, line = start_for("auto", tmp_path / "busy", gpu=True, probe=fails)
    assert mps is None and "MPS cannot serve" in line and "devices are busy" in line
    assert [c["stdin"] for c in calls_of(calls)] == ["", "quit\n"]  # the daemon it tried was told to quit
    with pytest.raises(MpsError, match="devices are busy"):  # asked for by name, the same is a refusal
        start_for("mps", tmp_path / "named", gpu=True, probe=fails)
    mps, line = start_for("auto", tmp_path / "ok", gpu=True, probe=[sys.executable, "-c", "pass"])
    assert mps is not None and line.startswith('CUDA MPS (gpu_share = "auto"): daemon started')
    mps.stop()


def test_a_gpu_run_shares_by_auto_by_default_and_the_dry_run_says_which(monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no MPS binary on this machine
    dry = CliRunner().invoke(app, ["up", "--config", str(GPU1), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f'# GPU sharing: plain (gpu_share = "auto" and {BINARY} is not on this machine\'s PATH)' in dry.output
    assert 'gpu_share = "auto"' in dry.output
    cpu = CliRunner().invoke(app, ["up", "--config", str(TINY), "--dry-run"])
    assert cpu.exit_code == 0 and "GPU sharing" not in cpu.output  # nothing on a GPU: nothing said
