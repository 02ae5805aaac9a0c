"""Shared plumbing of every role command: options, config resolution, logging, the asyncio entry.

The role commands (deploy/cli_*.py) call `resolve()`, then a role's plain entry function through
`run_main()`; nothing heavy is imported here so that `parley --help` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from parley.deploy.flags import flag
from parley.runtime.process import setup_logging  # noqa: F401  (re-exported for the commands)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="Run config TOML (default: the embedded default).")
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override a config value: section.key=value (repeatable).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the resolved configuration and exit.")]
# --nats and --run: generated from [nats] url and [run] name (deploy/flags.py); resolve() takes them
NATS = flag("nats.url", "--nats", help="NATS URL", envvar="PARLEY_NATS_URL")
RUN = flag("run.name", "--run", help="Run name", envvar="PARLEY_RUN")
NatsOpt = NATS.annotation()
RunOpt = RUN.annotation()
_IMPORTED = time.monotonic()  # process_age's origin where /proc is not there
# Off unless asked: an endpoint nobody scrapes is an open port for nothing, and one fixed default port
# collides as soon as two roles share a host; `parley up` asks each child for one (deploy/up.py).
METRICS_PORT_ENV = "PARLEY_METRICS_PORT"  # the deploy files set it (9400) beside a port named "metrics"
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        min=0,
        max=65535,
        envvar=METRICS_PORT_ENV,
        help="Serve Prometheus metrics (the heartbeat's numbers) on this port; 0 = a free one, printed at start. Off when not given.",
    ),
]
MetricsHostOpt = Annotated[
    str, typer.Option("--metrics-host", envvar="PARLEY_METRICS_HOST", help="Address the metrics endpoint listens on.")
]


def resolve(
    config: Path | None,
    sets: list[str] | None,
    *,
    nats: str | None = None,
    run: str | None = None,
    extra: list[str | tuple[str, str]] | None = None,
    training: bool = False,
):
    """Load and validate the run config with CLI overrides; exits with a one-line error on bad input
    that names where the bad value came from (the file, `--set k=v`, an option or its environment
    variable). extra: more overrides, each "section.key=value" or (that, the option that gave it).
    training: also the checks of a run that trains (config.run.check_training)."""
    import os

    from parley.config.run import ConfigError, check_training, load_config

    overrides: list[str | tuple[str, str]] = list(sets or [])
    for value, option in ((nats, NATS), (run, RUN)):
        if value:
            text, source = option.override(value)
            overrides.append((text, option.envvar if os.environ.get(option.envvar) == value else source))
    overrides += extra or []
    try:
        cfg = load_config(config, overrides)
        if training:
            check_training(cfg)
        return cfg
    except ConfigError as e:
        typer.echo(f"parley: bad configuration: {e}", err=True)
        raise typer.Exit(2) from None


def topology_bus(cfg):
    """The [bus] the set-up command makes the run's topology with: blobs_max_bytes = 0 derived from
    the policy's size x the versions kept (deploy.memory.blobs_max_bytes), so that the weights
    object store is bounded and holds what the run keeps."""
    import msgspec

    from parley.deploy.memory import blobs_max_bytes

    if cfg.bus.blobs_max_bytes:
        return cfg.bus
    derived = blobs_max_bytes(cfg)
    return msgspec.structs.replace(cfg.bus, blobs_max_bytes=derived) if derived else cfg.bus


def model_fields(cfg) -> dict[str, str]:
    """The model fields a run's processes load (field -> value): the policy (also the KL's reference
    model), the actors' engine, and the simulator's and judge's when the environment uses them and
    they run a local engine."""
    env = cfg.env.load()
    fields = {"policy.model": cfg.policy.model, "actor.engine.model": cfg.actor.engine.model}
    for section, needed in (("sim", env.needs_simulator), ("judge", env.needs_judge)):
        backend = getattr(cfg, section)
        if needed and backend.backend == "vllm":
            fields[f"{section}.engine.model"] = backend.engine.model
    return fields


def check_inputs(cfg, fields: dict[str, str] | None = None) -> tuple[list[str], dict[str, Path]]:
    """The start checks of what a run reads, made before anything is created or started (and under
    --dry-run): every model field names something that resolves and whose config.json loads
    (engines.models.check_model: the local Hugging Face cache first, a Hub id's config.json
    downloaded where a network is), and the data files exist or the data ids resolve (check_data). fields: the model fields to check
    (default: all the run loads, model_fields). Returns one line per problem, and the
    directories of the models given by Hub id (for the memory plan, which reads their config.json)."""
    hub_dirs: dict[str, Path] = {}
    problems = check_models(model_fields(cfg) if fields is None else fields, hub_dirs)
    problems += check_data(cfg.data)
    return problems, hub_dirs


def check_data(data) -> list[str]:
    """One line per [data] value that names nothing readable: a file that does not exist or has another
    suffix, or a Hub dataset id whose split's Parquet files are neither in the local HF cache nor
    downloadable (tasks.data.dataset_files; fetched into the cache where a network is)."""
    from parley.tasks.data import DataNotFound, dataset_files, hub_dataset

    problems = []
    for key, value in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if value and value != "bundled" and hub_dataset(value):
            try:
                dataset_files(value)
            except DataNotFound as e:
                problems.append(f"{key}: {e}")
        elif value and value != "bundled" and not Path(value).expanduser().is_file():
            problems.append(
                f'{key}={value!r}: no such file; give a CollabLLM .parquet or .jsonl file, a Hub dataset id (ORG/NAME) or "bundled"'
            )
        elif value and value != "bundled" and Path(value).suffix not in (".parquet", ".jsonl", ".json"):
            problems.append(f"{key}={value!r}: has suffix {Path(value).suffix!r}; use a .parquet or .jsonl file")
    return problems


def check_models(
    fields: dict[str, str], hub_dirs: dict[str, Path] | None = None, read_config: bool = True
) -> list[str]:
    """One line per model field (name -> value) that does not resolve (engines.models.check_model);
    the directories of those given by Hub id go into `hub_dirs`."""
    from parley.engines.models import ModelNotFound, check_model, hub_id

    problems = []
    for field, value in fields.items():
        try:
            path = check_model(value, read_config=read_config)
        except ModelNotFound as e:
            problems.append(f"{field}: {e}")
            continue
        if path is not None and hub_id(value) and hub_dirs is not None:
            hub_dirs[value] = path
    return problems


def refuse(who: str, problems: list[str]) -> None:
    """Print each problem on its own line and exit 2 (nothing has been started)."""
    for p in problems:
        typer.echo(f"parley {who}: {p}", err=True)
    raise typer.Exit(2)


def dry_run(cfg, notes: str = "") -> None:
    """Print the resolved configuration, then `notes` as TOML comments (the output stays a config file)."""
    from parley.config.run import dump_config

    typer.echo(dump_config(cfg) + "".join(f"\n# {line}" for line in notes.splitlines()))
    raise typer.Exit(0)


def start_metrics(port: int | None, host: str, who: str) -> None:
    """Serve the process's metrics (runtime.metrics) when `port` is given; prints where."""
    if port is None:
        return
    from parley.runtime.metrics import serve

    try:
        bound = serve(port, host)
    except OSError as e:
        typer.echo(
            f"parley {who}: cannot serve metrics on {host}:{port}: {e}; pick another --metrics-port (0 = any free one)",
            err=True,
        )
        raise typer.Exit(2) from None
    typer.echo(f"parley {who}: metrics on http://{host}:{bound}/metrics (and /healthz, /readyz)", err=True)


def run_main(entry, *args) -> None:
    """Call a role's plain entry function (config in, exit code out); a non-zero code exits with it."""
    code = entry(*args)
    if code:
        raise typer.Exit(int(code))


IdOpt = Annotated[
    str | None,
    typer.Option(
        "--id", help="Replica id in heartbeats and logs (default: <role>-<host>-<pid>-<4 random hex digits>)."
    ),
]


def default_id(role: str) -> str:
    """A replica's id when --id is not given: unique across the hosts of a run. The host and pid alone
    are not: containers that share the node's host name (host networking) each run their command as a
    low pid, often 1, so two replicas on one node had one id in heartbeats and in the samples they
    recorded. A few random digits set them apart."""
    import os
    import secrets
    import socket

    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def launch(
    role: str,
    module: str,
    cfg,
    dry: bool,
    ident: str | None,
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    problems: list[str] | None = None,
) -> None:
    """The end of a role command: refuse the start `problems` (under --dry-run too), print the
    config under --dry-run, else log as `ident` (default_id(role) when None), serve metrics and call `module.run(cfg, ident)`
    (imported only now, so that `parley --help` stays light)."""
    import importlib

    if problems:
        refuse(role, problems)
    if dry:
        dry_run(cfg)
    ident = ident or default_id(role)
    setup_logging(ident)
    start_metrics(metrics_port, metrics_host, role)
    run_main(importlib.import_module(module).run, cfg, ident)


def run_async_main(main, *args) -> None:
    """A command of deploy/'s own that is an async `main(stop, *args)`: run it like a role's entry."""
    from parley.runtime.process import run_async

    run_main(run_async, main, *args)


def process_age() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start tick against the boot-time clock
    it counts on), so a launcher's clock and ours agree on the start: the interpreter's start and our
    imports count too. Elsewhere, or where the two disagree, seconds since this module was imported."""
    try:
        import os

        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        age = -1.0
    since_import = time.monotonic() - _IMPORTED
    return age if age >= since_import else since_import


def stamped(line: str) -> str:
    """`line` with the seconds since the command started, as `parley up` prints each start-up line (where
    a launch's seconds go before its first step: preflight, nats-server, MPS, models, each child)."""
    return f"{line} [+{process_age():.1f} s]"
