"""The `parley` command: one sub-command per role, each defined in its own package.

Only typer and the role modules' light-weight command functions are imported here; torch, vLLM
and DeepSpeed are imported inside the commands, so `parley --help` answers at once.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="parley",
    help="Asynchronous GRPO for multi-turn collaborative assistants, over NATS JetStream.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from deploy import commands

    commands.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
