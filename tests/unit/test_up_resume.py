"""`parley up --resume RUN_DIR`: the run's own config.toml (with --set / --steps on top), the same run
directory (its NATS store, the learner's ledger and checkpoint), the learner started with --resume;
a directory without a run, or another config source beside it, refused in one line before anything
starts. up_main is replaced by a test double that records what it was given."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from parley.config.run import dump_config, load_config
from parley.deploy.cli import app
from parley.runtime.supervisor import Supervisor

TINY = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "tiny.toml"


def up(*args: str):
    return CliRunner().invoke(app, ["up", *args])


@pytest.fixture
def stopped_run(tmp_path):
    """A run directory as `parley up` leaves it: the resolved config it wrote (a run of 3 steps)."""
    run_dir = tmp_path / "runs" / "tiny-1"
    run_dir.mkdir(parents=True)
    cfg = load_config(TINY, ["learner.steps=3", f'run.dir="{run_dir}"', 'nats.url="nats://127.0.0.1:41234"'])
    (run_dir / "config.toml").write_text(dump_config(cfg))
    return run_dir


@pytest.fixture
def started(monkeypatch):
    import parley.deploy.up as up_module

    calls = []

    async def up_main_double(stop, cfg, live, resume=False):
        calls.append((cfg, resume))
        return 0

    monkeypatch.setattr(up_module, "up_main", up_main_double)
    return calls


def test_resume_starts_the_runs_own_config_in_its_directory(stopped_run, started):
    out = up("--resume", str(stopped_run), "--steps", "5", "--no-live")
    assert out.exit_code == 0, out.output
    [(cfg, resume)] = started
    assert resume is True
    assert Path(cfg.run.dir) == stopped_run.resolve() and cfg.learner.steps == 5
    assert cfg.run.name == load_config(stopped_run / "config.toml").run.name


def test_the_learner_child_resumes_and_only_it(tmp_path):
    from parley.deploy.up import plan_children

    cfg = load_config(TINY)
    plan = dict(plan_children(cfg, Supervisor(tmp_path), tmp_path / "c.toml", resume=True))
    assert "--resume" in plan["learner"]
    assert not any("--resume" in argv for name, argv in plan.items() if name != "learner")
    assert "--resume" not in dict(plan_children(cfg, Supervisor(tmp_path), tmp_path / "c.toml"))["learner"]


def test_a_directory_without_a_run_is_refused_in_one_line(tmp_path, started):
    out = up("--resume", str(tmp_path))
    assert out.exit_code == 2 and not started
    assert out.stderr.strip().count("\n") == 0 and "no config.toml" in out.stderr and str(tmp_path) in out.stderr


@pytest.mark.parametrize("other", [["--config", str(TINY)], ["--run-dir", "/tmp/elsewhere"]])
def test_another_config_source_beside_resume_is_refused(stopped_run, started, other):
    out = up("--resume", str(stopped_run), *other)
    assert out.exit_code == 2 and not started and f"drop {other[0]}" in out.stderr
