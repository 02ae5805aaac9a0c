"""`parley auth`: per-run NATS credentials, the run's topology made as the admin user, the
permissions of every role and the Kubernetes Secret (docs/operations.md). The work is in
deploy/credentials.py and deploy/permissions.py; this module only parses and reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from parley.deploy.common import (
    ConfigOpt,
    DryRunOpt,
    NatsOpt,
    RunOpt,
    SetOpt,
    dry_run,
    resolve,
    run_async_main,
    setup_logging,
)


def register(app: typer.Typer) -> None:
    auth = typer.Typer(
        help="NATS access control of a run: credentials, the topology (as admin), permissions, the k8s Secret.",
        no_args_is_help=True,
    )
    auth.command(
        "credentials", help="Write auth.conf (the server's users) and <role>.env (each role's user) for a run."
    )(credentials_cmd)
    auth.command(
        "topology",
        help="Create the run's streams, consumers and buckets as the admin user, so that the "
        "roles (which may only verify them) can start in any order.",
    )(topology_cmd)
    auth.command("permissions", help="Print what every role may publish and subscribe to, as JSON.")(permissions_cmd)
    auth.command(
        "budget",
        help="Change a running run's simulator and judge call limits (run totals, as [rollout]'s) as the "
        "admin user: every actor and scorer takes its share at once; calls waiting on a spent budget go on.",
    )(budget_cmd)
    auth.command(
        "k8s-secret", help="Print a Kubernetes Secret of a credentials directory (see deploy/k8s/secret.yaml)."
    )(k8s_secret_cmd)
    app.add_typer(auth, name="auth")


def credentials_cmd(
    run: Annotated[str, typer.Argument(help='Run name the users are for; "*" makes users valid for every run.')],
    out_dir: Annotated[Path, typer.Argument(help="Where to write auth.conf and <role>.env (mode 0600).")],
    config: ConfigOpt = None,
    sets: SetOpt = None,
    dry: DryRunOpt = False,
) -> None:
    """A fresh user and password per role; the services' reply window covers the config's request timeouts."""
    from parley.deploy.credentials import generate_credentials
    from parley.deploy.permissions import response_window_s

    cfg = resolve(config, sets)
    if dry:
        dry_run(cfg, notes=f"auth credentials: users of run {run!r} into {out_dir}")
    creds = generate_credentials(run, out_dir, response_window=response_window_s(cfg))
    typer.echo(f"wrote {out_dir / 'auth.conf'} and {', '.join(f'{r}.env' for r in creds)}")


def topology_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    wait: Annotated[
        float, typer.Option("--wait", help="Seconds to keep retrying while NATS / JetStream starts.")
    ] = 120.0,
    dry: DryRunOpt = False,
) -> None:
    """Connect with the config's [nats] (the admin's PARLEY_NATS_USER / PASSWORD from admin.env) and
    create or check the run's topology; exit 3 if NATS is not ready within --wait seconds."""
    cfg = resolve(config, sets, nats=nats, run=run)
    if dry:
        dry_run(cfg, notes=f"auth topology: run {cfg.run.name!r} on {cfg.nats.url}")
    setup_logging("auth", "WARNING")
    run_async_main(_topology, cfg, wait)


async def _topology(stop, cfg, wait: float) -> int:
    import asyncio
    import contextlib

    from nats.js.errors import APIError

    from parley.deploy.common import topology_bus
    from parley.protocol.connect import NatsUnreachable
    from parley.protocol.topology import TopologyError
    from parley.runtime.role import role_connection

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        try:
            async with role_connection(
                cfg.nats, name="parley-topology", run=cfg.run.name, bus=topology_bus(cfg), topology=True
            ):
                break
        except (NatsUnreachable, TopologyError, APIError) as e:
            # A cluster that is still electing its JetStream leader answers 503 for a few seconds.
            if loop.time() > deadline or stop.is_set():
                typer.echo(f"parley auth topology: {e}", err=True)
                return 3
            typer.echo(f"parley auth topology: not yet ({e}); retrying", err=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=2.0)
    typer.echo(f"topology of run {cfg.run.name!r} is in place on {cfg.nats.url}")
    return 0


def budget_cmd(
    sim_calls: Annotated[
        int | None, typer.Option("--sim-calls", min=0, help="Simulator calls per run (0 = unlimited).")
    ] = None,
    judge_calls: Annotated[
        int | None, typer.Option("--judge-calls", min=0, help="Judge calls per run (0 = unlimited).")
    ] = None,
    sim_rate: Annotated[
        float | None, typer.Option("--sim-rate", min=0.0, help="Simulator calls per second (0 = unlimited).")
    ] = None,
    judge_rate: Annotated[
        float | None, typer.Option("--judge-rate", min=0.0, help="Judge calls per second (0 = unlimited).")
    ] = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
) -> None:
    """Publish a BudgetUpdate on the run's control subject with the config's [nats] (the admin's
    PARLEY_NATS_USER / PASSWORD from admin.env: no other user may publish there). The processes running
    now apply it; one started later reads [rollout] again, so set the config too. Exit 3 if NATS is unreachable."""
    from parley.protocol.messages import BudgetUpdate

    update = BudgetUpdate(
        sim_call_budget=sim_calls, judge_call_budget=judge_calls, sim_calls_per_s=sim_rate, judge_calls_per_s=judge_rate
    )
    if all(v is None for v in (sim_calls, judge_calls, sim_rate, judge_rate)):
        typer.echo(
            "parley auth budget: nothing to change; give --sim-calls, --judge-calls, --sim-rate or --judge-rate",
            err=True,
        )
        raise typer.Exit(2)
    cfg = resolve(config, sets, nats=nats, run=run)
    if dry:
        dry_run(cfg, notes=f"auth budget: {update_text(update)} on run {cfg.run.name!r} at {cfg.nats.url}")
    setup_logging("auth", "WARNING")
    run_async_main(publish_budget, cfg, update)


def update_text(update) -> str:
    """The update's given fields, as the operator typed them."""
    import msgspec

    given = msgspec.structs.asdict(update).items()
    return ", ".join(f"{k} {v}" for k, v in given if v is not None and k != "created")  # created: set at send


async def publish_budget(stop, cfg, update) -> int:
    import time

    import msgspec

    from parley.protocol import codec, topology
    from parley.protocol.connect import NatsUnreachable, barrier
    from parley.runtime.role import connect_nats

    try:
        nc = await connect_nats(cfg.nats, name="parley-budget")
    except NatsUnreachable as e:
        typer.echo(f"parley auth budget: {e}", err=True)
        return 3
    try:
        update.created = time.time()
        subject = topology.control_subject(cfg.run.name, "budget")
        await nc.publish(subject, codec.encode(update))
        # a round trip: the server has the message, or has refused it (nats.py keeps the refusal as
        # last_error; the publish itself does not fail)
        await barrier(nc)
        refused = nc.last_error is not None and "permissions violation" in str(nc.last_error).lower()
    finally:
        await nc.drain()
    if refused:
        typer.echo(
            f"parley auth budget: NATS refused the update on {subject} (permissions violation): only the admin user "
            "may publish it; run with the admin's PARLEY_NATS_USER / PARLEY_NATS_PASSWORD (admin.env)",
            err=True,
        )
        return 4
    changed = {k: v for k, v in msgspec.structs.asdict(update).items() if v is not None and k != "created"}
    typer.echo(f"run {cfg.run.name!r}: sent {changed} on {subject}")
    return 0


def permissions_cmd(
    run: Annotated[str, typer.Argument(help='Run name; "*" gives the permissions of users valid for every run.')],
) -> None:
    from parley.deploy.permissions import role_permissions

    typer.echo(json.dumps(role_permissions(run), indent=2))


def k8s_secret_cmd(
    auth_dir: Annotated[Path, typer.Argument(help="A directory written by `parley auth credentials`.")],
    name: Annotated[
        str | None, typer.Option("--name", help="The Secret's name (default: the one deploy/k8s/*.yaml read).")
    ] = None,
) -> None:
    from parley.deploy.credentials import K8S_SECRET, k8s_secret

    typer.echo(k8s_secret(auth_dir, name or K8S_SECRET), nl=False)
