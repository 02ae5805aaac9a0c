"""Experiment tracking in Weights & Biases for `[log] wandb = true`: the learner logs its step metrics
and eval means through it (learner.steplog), `parley up` its eval table and report charts
(deploy/up.py), each a run of the W&B group named after the parley run. wandb is imported here
only, and only when tracking is on. Online when WANDB_API_KEY is set (or WANDB_MODE says so), else
offline: a run directory under RUN_DIR/wandb that `wandb sync` uploads later.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)


def wandb_mode() -> str:
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


class Tracker:
    """One W&B run. Numbers by step, tables and images; `finish` closes it (its files are complete then)."""

    def __init__(self, run):
        self.run = run

    def axis(self, pattern: str, step_metric: str) -> None:
        """Plot the series matching `pattern` (e.g. "eval/*") against `step_metric` instead of the step."""
        self.run.define_metric(step_metric)
        self.run.define_metric(pattern, step_metric=step_metric)

    def log(self, values: dict[str, float], step: int | None = None) -> None:
        self.run.log(values, step=step)

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        import wandb

        self.run.log({key: wandb.Table(columns=columns, data=rows)})

    def images(self, paths: dict[str, Path]) -> None:
        import wandb

        self.run.log({key: wandb.Image(str(path)) for key, path in paths.items()})

    @property
    def dir(self) -> Path:
        """The run's directory (offline: what `wandb sync` takes)."""
        return Path(self.run.dir).parent

    def finish(self) -> None:
        self.run.finish()


def open_tracker(section, *, run_dir: Path, run_name: str, job_type: str, config: dict | None = None) -> Tracker | None:
    """A Tracker for `job_type` ("learner", "report") of run `run_name` if `section` ([log]) turns
    W&B on, else None. The W&B run id is kept in RUN_DIR/wandb/<job_type>.id, so a resumed learner
    goes on logging into the run it started."""
    if not section.wandb:
        return None
    import wandb

    root = Path(run_dir) / "wandb"
    root.mkdir(parents=True, exist_ok=True)
    id_file = root / f"{job_type}.id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B ids: [a-z0-9]
    id_file.write_text(run_id + "\n")
    mode = wandb_mode()
    run = wandb.init(
        project=section.wandb_project,
        entity=section.wandb_entity or None,
        group=run_name,
        job_type=job_type,
        name=f"{run_name}-{job_type}",
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=mode,
        config=config or {},
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )
    log.info("W&B %s run %s (%s) in %s", job_type, run_id, mode, run.dir)
    return Tracker(run)
