"""Commands `parley up`, `parley top` and `parley report` (light imports only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from parley.deploy.common import (
    ConfigOpt,
    DryRunOpt,
    NatsOpt,
    RunOpt,
    SetOpt,
    check_inputs,
    dry_run,
    refuse,
    resolve,
    run_async_main,
    setup_logging,
    stamped,
)
from parley.deploy.flags import flag, with_flags


def register(app: typer.Typer) -> None:
    app.command(
        "up", help="Run the whole system on this machine (nats, services, actors, scorers, learner) with a live view."
    )(up_cmd)
    app.command("top", help="Live view of a running run whose roles may live on other machines.")(top_cmd)
    app.command(
        "report",
        help="Write PNG charts of reward terms, KL and eval metrics of a run directory (and its GPU timeline when `parley up` sampled one).",
    )(report_cmd)


@with_flags(
    flag("learner.steps", help="Stop after this many GRPO steps"),
    flag("up.min_actors", help="--actors auto: the fewest"),
    flag("up.max_actors", help="--actors auto: the most"),
    flag("up.scorers", help="Scorers to start"),
    flag("run.dir", "--run-dir", help="Run directory (default runs/<name>-<time>)"),
    flag(
        "env.name",
        "--env",
        help="Environment to train, by entry-point name (e.g. hidden_goal). Without --config, the environment's preset is laid over the embedded default (before --set)",
    ),
    flag(
        "run.recipe",
        help="A named preset of training settings (e.g. verl-collabllm, docs/recipe.md): laid over the embedded default, under --config FILE's own keys; --set wins",
    ),
)
def up_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    actors: Annotated[
        str | None,
        typer.Option(
            "--actors",
            help="Rollout actors to start (overrides up.actors), or "
            '"auto": between --min-actors and --max-actors on the TASKS backlog.',
        ),
    ] = None,
    run_dir=None,
    live: Annotated[
        bool | None,
        typer.Option("--live/--no-live", help="Live terminal view (default: on when stdout is a terminal)."),
    ] = None,
    env=None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Start the run in this run directory again where it stopped: its config.toml (--set and --steps on top), its NATS store, the learner's ledger and checkpoint.",
        ),
    ] = None,
    dry: DryRunOpt = False,
    flagged=(),
) -> None:
    extra: list[tuple[str, str]] = list(flagged)
    if resume is not None:
        config = resume_source(resume, config, run_dir, env)
        extra.append((f"run.dir={json.dumps(str(resume.resolve()))}", f"--resume {resume}"))
    if actors == "auto":
        extra.append(("up.autoscale=true", "--actors auto"))
    elif actors is not None:
        if not actors.isdigit():
            typer.echo(f'parley up: --actors {actors!r}: give a number or "auto"', err=True)
            raise typer.Exit(2)
        extra.append((f"up.actors={actors}", f"--actors {actors}"))
    preset = env_preset(env) if env is not None and config is None else ()
    if preset:
        typer.echo(
            f"parley up: environment {env}'s preset (--set wins; --config FILE leaves it out): " + "; ".join(preset),
            err=True,
        )
    cfg = resolve(config, [*preset, *(sets or [])], extra=extra, training=True)
    # Every check a start makes, made here for --dry-run and a real start alike, before the run
    # directory, nats-server or any model build or download (deploy/up.py starts those).
    problems, hub_dirs = check_inputs(cfg)
    if cfg.learner.steps < 1:
        problems.insert(
            0, f"learner.steps={cfg.learner.steps}: up stops after the learner's last step; give --steps >= 1"
        )
    if problems:
        refuse("up", problems)
    # the workload's fingerprint, taken before the plan settles any "auto" of the config: the run's
    # measurement is kept by it at the end (a resumed run's steps span two starts: none is kept)
    from parley.deploy.gpu_share import fingerprint

    key = fingerprint(cfg) if resume is None else ""
    share = check_gpu_share(cfg, dry=dry, hub_dirs=hub_dirs, key=key)
    plan = check_memory(cfg, dry=dry, hub_dirs=hub_dirs)
    if dry:
        dry_run(cfg, notes="\n".join(n for n in (plan, share) if n))
    if plan:  # its head line stamped: the preflight's seconds (imports, checks, GPU sharing, the plan)
        head, _, rest = plan.partition("\n")
        typer.echo(stamped(head) + ("\n" + rest if rest else ""))
    setup_logging("up", "WARNING")
    from parley.deploy.up import up_main

    show_live = cfg.up.live and sys.stdout.isatty() if live is None else live
    run_async_main(up_main, cfg, show_live, *((True,) if resume is not None else (False, key)))


def resume_source(run_dir: Path, config: Path | None, other_dir: Path | None, env: str | None) -> Path:
    """The config file `parley up --resume RUN_DIR` starts from; exit 2 with one line when the
    directory holds no run or another source of the config is named beside it."""
    from parley.deploy.up import resume_config_path

    for option, given in (("--config", config), ("--run-dir", other_dir), ("--env", env)):
        if given is not None:
            typer.echo(f"parley up: --resume {run_dir} takes its config from there; drop {option} {given}", err=True)
            raise typer.Exit(2)
    try:
        return resume_config_path(run_dir)
    except ValueError as e:
        typer.echo(f"parley up: {e}", err=True)
        raise typer.Exit(2) from None


def planned(cfg, hub_dirs: dict[str, Path]):
    """`cfg` as the memory plan reads it: a model given by Hub id as its local directory (the plan
    reads the shape from config.json; the run itself keeps the id)."""
    if not hub_dirs:
        return cfg
    import copy

    out = copy.deepcopy(cfg)
    out.policy.model = str(hub_dirs.get(out.policy.model, out.policy.model))
    for section in (out.actor, out.sim, out.judge):
        section.engine.model = str(hub_dirs.get(section.engine.model, section.engine.model))
    return out


def check_gpu_share(cfg, dry: bool, hub_dirs: dict[str, Path] | None = None, key: str = "") -> str:
    """Which GPU sharing the run gets, decided before anything starts (deploy/gpu_share.decide, the
    rule deploy/mps.start_for applies again at the start), as the line to print. "mps" and "phased"
    with nothing on a GPU are refused (exit code 2), and so is "mps" without the MPS daemon's binary,
    which under --dry-run is a note (the dry run may be on another machine than the run). "auto"
    refuses nothing; where it takes phased sharing, `cfg` says so from here on (the memory plan, the
    config every child is given). `key`: the workload's fingerprint, for earlier runs' measurements."""
    from parley.deploy.gpu_share import decide, facts_of

    plan_cfg = planned(cfg, hub_dirs or {}) if cfg.up.gpu_share == "auto" else None  # only "auto" plans here
    chosen = decide(facts_of(cfg, key=key, plan_cfg=plan_cfg))
    if chosen.refusal and not (dry and chosen.here):
        typer.echo(f"parley up: {chosen.refusal}", err=True)
        raise typer.Exit(2)
    if chosen.mode == "phased":
        cfg.up.gpu_share = "phased"
    return chosen.line


def check_memory(cfg, dry: bool, hub_dirs: dict[str, Path] | None = None) -> str:
    """The GPU memory plan (deploy/memory.py) as text, made before anything starts; "" for a config
    that puts nothing on a GPU. A run that does not fit is refused here (exit code 2), under --dry-run
    too, and so is one that cannot be made. The plan reads models given by Hub id from `hub_dirs`
    (planned: a copy of `cfg`); what it chooses for an "auto" setting goes into `cfg` itself, the config
    every child is given."""
    from parley.deploy.memory import PlanError, make_plan

    try:
        plan = make_plan(planned(cfg, hub_dirs or {}))
    except PlanError as e:
        typer.echo(f"parley up: cannot make the GPU memory plan: {e}", err=True)
        raise typer.Exit(2) from None
    if plan is None:
        return ""
    if plan.fits is False:
        typer.echo(plan.refusal(), err=True)
        raise typer.Exit(2)
    if plan.fits is None and not dry:
        typer.echo("parley up: the GPU memory plan is not checked (GPU total unknown: set up.gpu_memory_gib)", err=True)
    for key, value in plan.chosen:  # what the plan chose ("auto"), into the config every child is given
        *path, leaf = key.split(".")
        section = cfg
        for name in path:
            section = getattr(section, name)
        setattr(section, leaf, value)
    return plan.render()


def env_preset(name: str) -> tuple[str, ...]:
    """The `--set` overrides environment `name` asks `parley up --env` to lay over the embedded default
    (environments.base.Environment.preset); an unknown or unimportable environment is a one-line error.
    One that cannot be built without options (they come with --set env.options=...) has no preset here:
    the config's own load then builds it with the options given, and reports what is wrong."""
    from parley.environments import registry

    try:
        return tuple(registry.load(name).preset)
    except (LookupError, ImportError) as e:
        typer.echo(f"parley up: --env {name}: {e}", err=True)
        raise typer.Exit(2) from None
    except (ValueError, TypeError):
        return ()


def top_cmd(
    nats: NatsOpt = None, run: RunOpt = None, config: ConfigOpt = None, sets: SetOpt = None, dry: DryRunOpt = False
) -> None:
    cfg = resolve(config, sets, nats=nats, run=run)
    if dry:
        dry_run(cfg, notes=f"top: the run {cfg.run.name!r} on {cfg.nats.url}")
    setup_logging("top", "WARNING")

    async def main(stop, cfg):
        from parley.deploy.live import watch
        from parley.runtime.role import role_connection

        async with role_connection(cfg.nats, name="parley-top") as (nc, _):
            await watch(nc, cfg.run.name, stop)
        return 0

    run_async_main(main, cfg)


def report_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `parley up` or `parley learner`.")],
    out: Annotated[Path | None, typer.Option("--out", help="Where to write the PNGs (default RUN_DIR/report).")] = None,
) -> None:
    from parley.deploy.report import write_report

    try:
        files = write_report(run_dir, out or run_dir / "report")
    except FileNotFoundError as e:
        typer.echo(f"parley report: {e}", err=True)
        raise typer.Exit(2) from None
    for f in files:
        typer.echo(str(f))
