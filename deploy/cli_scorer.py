"""`parley scorer`: option parsing only; the role lives in scorer/scorer.py and is imported when the
command runs, so `parley --help` stays light."""

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
    launch,
    resolve,
)
from parley.deploy.flags import flag, with_flags


def register(app: typer.Typer) -> None:
    app.command("scorer", help="Score trajectories (TRAJ) with the judge and publish rewards (SCORED).")(scorer_cmd)


@with_flags(flag("scorer.concurrency"))
def scorer_cmd(
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
    """Pull trajectories of the run, score them through the judge service, publish Scored."""
    cfg = resolve(config, sets, nats=nats, run=run, extra=flagged)
    launch("scorer", "parley.scorer.scorer", cfg, dry, ident, metrics_port, metrics_host)
