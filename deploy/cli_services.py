"""`parley sim`, `parley judge`, `parley reference` and `parley services`: option parsing only. Each
service's server, client, prompts and start checks live together under services/ (services/sim,
services/judge, services/reference, services/combined.py) and are imported when a command runs, so
`parley --help` never imports torch or vLLM."""

from __future__ import annotations

import typer

from parley.deploy.common import (
    ConfigOpt,
    DryRunOpt,
    IdOpt,
    MetricsHostOpt,
    MetricsPortOpt,
    NatsOpt,
    RunOpt,
    SetOpt,
    check_models,
    launch,
    resolve,
)
from parley.deploy.flags import flag, with_flags


def register(app: typer.Typer) -> None:
    app.command(
        "sim", help="User-simulator service (NATS request/reply) on a local vLLM engine or an OpenAI-compatible URL."
    )(sim_cmd)
    app.command("judge", help="Judge service: extract the final document, rate interactivity (NATS request/reply).")(
        judge_cmd
    )
    app.command("services", help="User simulator and judge in one process sharing one local engine.")(services_cmd)
    app.command(
        "reference",
        help='Reference service: the frozen initial policy\'s per-token log-probs ([policy] reference = "service").',
    )(reference_cmd)


@with_flags(
    flag("sim.prompt", "--user-sim-prompt", help="Prompt variant for requests that name none"),
    flag("sim.backend"),
    flag("sim.base_url", help="OpenAI-compatible endpoint, e.g. http://host:8000/v1"),
    flag("sim.model_name", help="Model name the endpoint serves"),
    flag("sim.concurrency"),
)
def sim_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    ident: IdOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
    flagged=(),
) -> None:
    """Serve the user simulator on parley.svc.sim (queue group "sim") until Ctrl-C / SIGTERM."""
    from parley.services.sim.server import start_problems

    cfg = resolve(config, sets, nats=nats, run=run, extra=flagged)
    launch("sim", "parley.services.sim.server", cfg, dry, ident, metrics_port, metrics_host, start_problems(cfg))


@with_flags(flag("judge.concurrency"))
def judge_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    ident: IdOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
    flagged=(),
) -> None:
    """Serve the judge on parley.svc.judge.{extract,interactivity} until Ctrl-C / SIGTERM."""
    cfg = resolve(config, sets, nats=nats, run=run, extra=flagged)
    launch("judge", "parley.services.judge.server", cfg, dry, ident, metrics_port, metrics_host)


def services_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    ident: IdOpt = None,
    dry: DryRunOpt = False,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
) -> None:
    """Serve parley.svc.sim and parley.svc.judge.* from one engine until Ctrl-C / SIGTERM."""
    from parley.services.combined import check_shareable

    cfg = resolve(config, sets, nats=nats, run=run)
    problems = []
    try:  # under --dry-run too: every start check
        check_shareable(cfg)
    except ValueError as e:
        problems.append(str(e))
    launch("services", "parley.services.combined", cfg, dry, ident, metrics_port, metrics_host, problems)


def reference_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    ident: IdOpt = None,
    dry: DryRunOpt = False,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
) -> None:
    """Serve parley.svc.reference (log-probs of [policy] model's initial weights) until Ctrl-C / SIGTERM."""
    cfg = resolve(config, sets, nats=nats, run=run)
    problems = check_models({"policy.model": cfg.policy.model})  # under --dry-run too: every start check
    launch("reference", "parley.services.reference.server", cfg, dry, ident, metrics_port, metrics_host, problems)
