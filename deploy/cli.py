"""The `parley` command: one sub-command per role, each defined in its own package.

Only typer and the role modules' light-weight command functions are imported here; torch, vLLM
and DeepSpeed are imported inside the commands, so `parley --help` answers at once.
"""

from __future__ import annotations

import logging

import typer

from parley.errors import ParleyError

log = logging.getLogger(__name__)

app = typer.Typer(
    name="parley",
    help="Asynchronous GRPO for multi-turn collaborative assistants, over NATS JetStream.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts are plain text: they name config sections as "[policy]", which Rich markup would eat
    # (the mode is handed down to every sub-command and sub-group).
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _register() -> None:
    from parley.deploy import commands

    commands.register(app)


_register()


def run(argv: list[str] | None = None) -> int:
    """One command line (sys.argv's without argv) in this process; its exit code. `parley.command` calls it."""
    import sys

    try:
        from typer._click import exceptions as cx  # typer vendors click since 0.2x
    except ImportError:  # pragma: no cover - older typer on the real click
        from click import exceptions as cx

    try:
        code = app(args=argv, prog_name="parley", standalone_mode=False)
    except cx.NoArgsIsHelpError as e:
        return e.exit_code  # the help is printed already
    except cx.ClickException as e:
        # A bad option value is one line naming the option (a usage box is hard to grep in a role's log).
        ctx = getattr(e, "ctx", None)
        print(f"{ctx.command_path if ctx else 'parley'}: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except typer.Abort:
        print("parley: aborted", file=sys.stderr)
        return 1
    except ParleyError as e:
        # Raised on purpose, its message names the value and the fix: one line, the traceback only
        # in the debug log.
        log.debug("%s escaped the command", type(e).__name__, exc_info=True)
        print(f"parley: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code if isinstance(code, int) else 0


def one_line(e: BaseException) -> str:
    """An error's message on one line (a grep of a role's log finds all of it); its class name when
    it has no message."""
    return " / ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def main() -> None:
    raise SystemExit(run())


if __name__ == "__main__":
    main()
