"""Commands owned by deploy/: `parley nats` and `parley selfcheck`; and the registry of all roles
(and of `parley auth`, deploy/cli_auth.py; `parley trace`, deploy/cli_trace.py)."""

from __future__ import annotations

import shutil
import time
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
    app.command("nats", help="Run the real nats-server with JetStream (prints its URL).")(nats_cmd)
    app.command("selfcheck", help="Round-trip every message type through a NATS server and report.")(selfcheck_cmd)
    for module in (
        "parley.deploy.cli_actor",
        "parley.deploy.cli_services",
        "parley.deploy.cli_scorer",
        "parley.deploy.cli_eval",
        "parley.deploy.cli_learner",
        "parley.deploy.up_cli",
        "parley.deploy.cli_auth",
        "parley.deploy.cli_trace",
    ):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.register(app)


def nats_cmd(
    store_dir: Annotated[
        Path, typer.Option("--store-dir", help="JetStream store directory (kept across restarts).")
    ] = Path("runs/nats"),
    port: Annotated[int, typer.Option("--port", help="Client port; 0 picks a free one.")] = 4222,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
) -> None:
    """Start nats-server, print `nats://host:port` on stdout, stop it on Ctrl-C / SIGTERM."""
    import signal
    import threading

    from parley.deploy.natsserver import NatsServer

    # Handlers first: a SIGTERM right after the URL is printed must still stop the server cleanly.
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    server = NatsServer(store_dir, host=host, port=port)
    try:
        url = server.start()
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        typer.echo(f"parley nats: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(url, nl=True)
    typer.echo(f"nats-server pid {server.proc.pid}, store {server.store_dir}, log {server.log_file}", err=True)
    while not done.is_set() and server.proc.poll() is None:
        done.wait(0.5)
    code = server.proc.poll()
    server.stop()
    if code is not None:
        typer.echo(f"parley nats: nats-server exited with {code}; see {server.log_file}", err=True)
        raise typer.Exit(1)


def selfcheck_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    embedded: Annotated[
        bool, typer.Option("--embedded/--external", help="Start a throw-away nats-server for the check.")
    ] = True,
    dry: DryRunOpt = False,
) -> None:
    """Create the run's topology, publish one of every message type, read each back, compare."""
    setup_logging("selfcheck")
    cfg = resolve(config, sets, nats=nats, run=run or "selfcheck")
    if dry:
        dry_run(
            cfg, notes="selfcheck: " + ("a throw-away nats-server" if embedded else f"the server at {cfg.nats.url}")
        )
    server = store = None
    if embedded:
        from parley.deploy.natsserver import NatsServer
        from parley.runtime.scratch import scratch_dir

        store = scratch_dir("selfcheck")
        server = NatsServer(str(store), port=0)
        cfg.nats.url = server.start()
        typer.echo(f"started nats-server at {cfg.nats.url}")
    try:
        run_async_main(_selfcheck, cfg)
    finally:
        if server:
            server.stop()
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)


async def _selfcheck(stop, cfg) -> int:
    from parley.protocol import codec, examples, topology
    from parley.protocol.bus import publish
    from parley.runtime.role import role_connection

    failures = 0
    async with role_connection(cfg.nats, name="parley-selfcheck") as (nc, js):
        t0 = time.perf_counter()
        await topology.ensure_topology(js, cfg.run.name, cfg.bus, stores_versions=False)  # publishes no weights
        for key, msg in examples.channel_examples(cfg.run.name).items():
            ack = await publish(js, cfg.run.name, key, msg)
            back = await js.get_msg(topology.stream_name(cfg.run.name, key), ack.seq)
            ok = codec.decode(key, back.data) == msg
            failures += not ok
            typer.echo(f"  {key:<7} {type(msg).__name__:<13} {len(back.data):>6} B  {'ok' if ok else 'MISMATCH'}")
        info = nc._server_info
    typer.echo(
        f"selfcheck: {5 - failures}/5 message types round-tripped; server {info.get('version')} "
        f"max_payload {info.get('max_payload', 0) // 1024**2} MiB; {time.perf_counter() - t0:.2f}s"
    )
    return 1 if failures else 0
