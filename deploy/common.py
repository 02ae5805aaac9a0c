"""Shared plumbing of every role command: options, config resolution, logging, the asyncio entry.

Role commands (in their own packages) call `resolve()` and `run_main()`; nothing heavy is
imported here so that `parley --help` stays fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Run config TOML (default: the embedded default).")]
SetOpt = Annotated[
    Optional[list[str]], typer.Option("--set", "-s", help="Override a config value: section.key=value (repeatable).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the resolved configuration and exit.")]
NatsOpt = Annotated[Optional[str], typer.Option("--nats", help="NATS URL; overrides the config's nats.url.", envvar="PARLEY_NATS_URL")]
RunOpt = Annotated[Optional[str], typer.Option("--run", help="Run name; overrides the config's run.name.", envvar="PARLEY_RUN")]


def resolve(config: Path | None, sets: list[str] | None, *, nats: str | None = None, run: str | None = None, extra: list[str] | None = None):
    """Load and validate the run config with CLI overrides; exits with a one-line error on bad input."""
    from deploy.config import ConfigError, load_config

    overrides = list(sets or [])
    if nats:
        overrides.append(f'nats.url="{nats}"')
    if run:
        overrides.append(f'run.name="{run}"')
    overrides += extra or []
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        typer.echo(f"parley: bad configuration: {e}", err=True)
        raise typer.Exit(2) from None


def dry_run(cfg) -> None:
    from deploy.config import dump_config

    typer.echo(dump_config(cfg))
    raise typer.Exit(0)


def setup_logging(role: str, level: str | None = None) -> None:
    level = level or os.environ.get("PARLEY_LOG", "INFO")
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("nats", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_main(main, *args) -> None:
    """Run `main(stop, *args)` on uvloop; SIGINT/SIGTERM set `stop` so the role drains and exits."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep Windows-like envs working
        runner = asyncio.run

    async def wrapper():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop, *args)

    from protocol.connect import NatsUnreachable

    try:
        code = runner(wrapper())
    except NatsUnreachable as e:
        typer.echo(f"parley: {e}", err=True)
        raise typer.Exit(3) from None
    if code:
        raise typer.Exit(int(code))
