"""`parley judge` and `parley scorer`: option parsing only; the roles live in services/judge/server.py and
scorer/scorer.py and are imported when a command runs, so `parley --help` stays light."""

from __future__ import annotations

import os
import socket
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
    dry_run,
    resolve,
    run_main,
    setup_logging,
    start_metrics,
)

IdOpt = Annotated[
    str | None, typer.Option("--id", help="Replica id in heartbeats and logs (default: <role>-<host>-<pid>).")
]


def register(app: typer.Typer) -> None:
    app.command("judge", help="Judge service: extract the final document, rate interactivity (NATS request/reply).")(
        judge_cmd
    )
    app.command("scorer", help="Score trajectories (TRAJ) with the judge and publish rewards (SCORED).")(scorer_cmd)


def _default_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def judge_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    ident: IdOpt = None,
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", help="Requests handled at once; overrides judge.concurrency.")
    ] = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
) -> None:
    """Serve the judge on parley.svc.judge.{extract,interactivity} until Ctrl-C / SIGTERM."""
    _launch(
        "judge",
        "parley.services.judge.server",
        concurrency,
        config,
        sets,
        nats,
        run,
        dry,
        ident,
        metrics_port,
        metrics_host,
    )


def scorer_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    ident: IdOpt = None,
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", help="Trajectories scored at once; overrides scorer.concurrency.")
    ] = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
) -> None:
    """Pull trajectories of the run, score them through the judge service, publish Scored."""
    _launch(
        "scorer", "parley.scorer.scorer", concurrency, config, sets, nats, run, dry, ident, metrics_port, metrics_host
    )


def _launch(
    role: str,
    module: str,
    concurrency,
    config,
    sets,
    nats,
    run,
    dry: bool,
    ident,
    metrics_port=None,
    metrics_host: str = "0.0.0.0",
) -> None:
    """Resolve the config (with --concurrency into [role]), then call `module.run` under that role's id."""
    import importlib

    extra = [f"{role}.concurrency={concurrency}"] if concurrency is not None else []
    cfg = resolve(config, sets, nats=nats, run=run, extra=extra)
    if dry:
        dry_run(cfg)
    ident = ident or _default_id(role)
    setup_logging(ident)
    start_metrics(metrics_port, metrics_host, role)
    run_main(importlib.import_module(module).run, cfg, ident)
