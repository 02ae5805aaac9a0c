"""`parley trace TRAJ_ID`: option parsing only; the lineage is built by evaluation/lineage.py from
the run directory (the learner's archive, trained.jsonl and ledger, found here with
learner.checkpoint), so it works after the run ended and its NATS server is gone. Registered by
deploy/commands.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from parley.deploy.common import ConfigOpt, DryRunOpt, RunOpt, SetOpt, dry_run, resolve


def register(app: typer.Typer) -> None:
    app.command(
        "trace",
        help="Print a sample's lineage: prompt, simulator and judge calls, policy versions, score, and the step "
        "that trained it (or why it was dropped).",
    )(trace_cmd)


def trace_cmd(
    traj_id: Annotated[str, typer.Argument(help="The trajectory id, '<task_id>/<sample>' (as in the logs).")],
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="The learner's run directory (default: the configuration's run directory)."),
    ] = None,
    width: Annotated[
        int, typer.Option("--width", help="Characters shown of each message and answer; 0 shows them whole.")
    ] = 300,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
) -> None:
    """Reads the run directory only; nothing is asked of NATS."""
    from parley.evaluation.lineage import LedgerView, TraceError, find, render
    from parley.learner.checkpoint import LedgerError, archive_dir, read_state
    from parley.learner.steplog import TRAINED_FILE

    cfg = resolve(config, sets, run=run) if dry or run_dir is None else None
    run_dir = run_dir or cfg.run_dir
    if dry:
        dry_run(cfg, notes=f"trace: {traj_id} in {run_dir}")
    if not run_dir.is_dir():
        typer.echo(f"parley trace: run directory {run_dir} does not exist; pass the learner's with --run-dir", err=True)
        raise typer.Exit(2)
    try:
        state = read_state(run_dir)
    except LedgerError as e:
        typer.echo(f"parley trace: {e}", err=True)
        raise typer.Exit(1) from None
    ledger = None
    if state is not None:
        buffered = [s for g in state.groups for s in g.samples]
        ledger = LedgerView(step=state.step, done=dict(state.done), reasons=dict(state.reasons), buffered=buffered)
    try:
        lineage = find(traj_id, archive_dir(run_dir), run_dir / TRAINED_FILE, ledger)
    except TraceError as e:
        typer.echo(f"parley trace: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(render(lineage, width=width))
