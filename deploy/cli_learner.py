"""`parley learner` and `parley export`: option parsing only. The learner lives in learner/service.py
(rank 0) and learner/trainer.py (every rank) and is imported when the command runs, so
`parley --help` never imports torch or DeepSpeed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from parley.deploy.common import (
    ConfigOpt,
    DryRunOpt,
    MetricsHostOpt,
    MetricsPortOpt,
    NatsOpt,
    RunOpt,
    SetOpt,
    check_inputs,
    dry_run,
    refuse,
    resolve,
    run_main,
    setup_logging,
    start_metrics,
)
from parley.deploy.flags import flag, with_flags


def register(app: typer.Typer) -> None:
    app.command("learner", help="GRPO learner: feed tasks, group scored samples, train on DeepSpeed, publish weights.")(
        learner_cmd
    )
    app.command("export", help="Write one weights version of a learner run as a standalone HF checkpoint.")(export_cmd)


@with_flags(
    flag("learner.steps", help="Stop once this many optimizer steps are done in total"),
    flag("data.allow_overlap", help="Start even if train and eval share reference targets (recorded in the run)"),
)
def learner_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the run directory's learner state and checkpoint.")
    ] = False,
    reset_streams: Annotated[
        bool,
        typer.Option(
            "--reset-streams",
            help="A fresh start over a run name whose streams hold an older learner's work: purge them first (with access control on, this needs the admin credential).",
        ),
    ] = False,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
    flagged=(),
) -> None:
    """Run the learner until `steps` steps are done (exit 0) or Ctrl-C / SIGTERM (state saved).

    Several GPUs: start it under the deepspeed launcher or torchrun (docs/learner.md); rank 0
    talks to NATS and the other ranks follow its training calls.
    """
    cfg = resolve(config, sets, nats=nats, run=run, extra=flagged, training=True)
    problems, _ = check_inputs(cfg, fields={"policy.model": cfg.policy.model})
    if problems:  # under --dry-run too: every start check
        refuse("learner", problems)
    if dry:
        dry_run(cfg)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(f"learner{rank or ''}")
    if rank == 0:  # the other ranks send no heartbeats: rank 0 speaks for the learner
        start_metrics(metrics_port, metrics_host, "learner")
    from parley.learner.service import run as learner_run

    if reset_streams and resume:
        raise typer.BadParameter("--reset-streams purges the run's streams; --resume continues them: pass one")
    run_main(learner_run, cfg, resume, rank, reset_streams)


def export_cmd(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/<name>).")],
    out: Annotated[Path, typer.Argument(help="Directory to write the HF checkpoint to.")],
    version: Annotated[int, typer.Option("--version", help="Weights version (= optimizer step) to export.")],
    merge: Annotated[
        bool,
        typer.Option(
            "--merge",
            help="A LoRA run: base + adapter merged into a standalone checkpoint (without it, the adapter alone).",
        ),
    ] = False,
) -> None:
    """Copy or consolidate version V into OUT with the base model's tokenizer, ready for vLLM or transformers."""
    setup_logging("export")
    from parley.learner.checkpoint import CorruptWeights, UnsafeCheckpoint, export_version

    try:
        path = export_version(run_dir, version, out, merge=merge)
    except (FileNotFoundError, UnsafeCheckpoint, CorruptWeights) as e:
        typer.echo(f"parley export: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))
