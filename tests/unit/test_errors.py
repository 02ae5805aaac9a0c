"""One error tree: every exception class the project defines derives from parley.errors.ParleyError
(through a child that says what went wrong), each keeps the builtin base it had, and the command
line turns one that escapes into one line and its exit code."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest
import typer

from parley import errors

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "parley",
    "protocol",
    "config",
    "weights",
    "engines",
    "tasks",
    "rewards",
    "runtime",
    "services",
    "rollout",
    "evaluation",
    "environments",
    "actors",
    "scorer",
    "learner",
    "deploy",
)
BUILTIN_EXCEPTIONS = {
    n
    for n in dir(builtins)
    if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)
}
# Deliberately outside the tree, each with why.
OUTSIDE: dict[str, str] = {
    # a signal turned into an exception inside vLLM's engine start (`parley eval --follow` told to stop
    # while its engine opens): a BaseException as KeyboardInterrupt is, so that no `except Exception` in
    # vLLM's start swallows it; no command line ever shows it (the child exits 130)
    "OpenInterrupted": "evaluation.commands: SIGTERM/SIGINT out of vLLM's engine start",
}


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def exception_classes(root: Path = ROOT) -> dict[str, tuple[str, list[str]]]:
    """name -> (where, base names) for every class under the packages that is an exception: a builtin
    exception, a name ending in Error/Exception (a library's) or another such class among its bases."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    classes[node.name] = (where, [_base_name(b) for b in node.bases])
    exc = {n for n in BUILTIN_EXCEPTIONS}
    changed = True
    while changed:
        changed = False
        for name, (_, bases) in classes.items():
            if name not in exc and any(b in exc or b.endswith(("Error", "Exception")) for b in bases):
                exc.add(name)
                changed = True
    return {n: classes[n] for n in classes if n in exc}


def outside_the_tree(root: Path = ROOT) -> list[str]:
    found = exception_classes(root)

    def derives(name: str, seen=()) -> bool:
        if name == "ParleyError":
            return True
        if name not in found or name in seen:
            return False
        return any(derives(b, (*seen, name)) for b in found[name][1])

    return sorted(
        f"{where}: {n}({', '.join(bases)})"
        for n, (where, bases) in found.items()
        if not derives(n) and n not in OUTSIDE
    )


def test_every_exception_class_derives_from_parley_error():
    bad = outside_the_tree()
    assert not bad, "exception classes outside parley.errors.ParleyError's tree:\n" + "\n".join(bad)


def test_a_planted_exception_outside_the_tree_is_named(tmp_path):
    for top in PACKAGES:
        (tmp_path / top).mkdir()
    (tmp_path / "parley" / "errors.py").write_text(
        "class ParleyError(Exception): ...\nclass Refused(ParleyError): ...\n"
    )
    (tmp_path / "learner" / "a.py").write_text(
        "from parley.errors import Refused\nclass Fine(Refused): ...\nclass Lost(RuntimeError): ...\n"
        "class AlsoLost(Lost): ...\nclass FromALibrary(nats.errors.Error): ...\nclass NotAnError: ...\n"
    )
    bad = outside_the_tree(tmp_path)
    assert {b.split(": ")[1] for b in bad} == {"AlsoLost(Lost)", "FromALibrary(Error)", "Lost(RuntimeError)"}, bad


@pytest.mark.parametrize(
    "cls, builtin",
    [
        ("parley.config.run.ConfigError", ValueError),
        ("parley.engines.models.ModelNotFound", ValueError),
        ("parley.tasks.data.DataNotFound", ValueError),
        ("parley.protocol.connect.NatsUnreachable", ConnectionError),
        ("parley.protocol.topology.TopologyError", RuntimeError),
        ("parley.services.judge.client.JudgeUnavailable", RuntimeError),
        ("parley.services.reference.client.ReferenceFailed", RuntimeError),
        ("parley.learner.groups.BadTrajectory", ValueError),
        ("parley.evaluation.lineage.TraceError", LookupError),
    ],
)
def test_each_keeps_its_builtin_base(cls, builtin):
    """What an `except ValueError:` (or RuntimeError, ...) caught before, it still catches."""
    import importlib

    module, name = cls.rsplit(".", 1)
    found = getattr(importlib.import_module(module), name)
    assert issubclass(found, errors.ParleyError) and issubclass(found, builtin)


def test_the_wire_verdicts_catch_no_more_than_before():
    """Poison and Retry were plain Exceptions: they must not turn into ValueError or RuntimeError,
    which handlers catch for other reasons."""
    from parley.protocol.bus import Poison, Retry

    for cls in (Poison, Retry):
        assert issubclass(cls, errors.ProtocolError)
        assert not issubclass(cls, (ValueError, RuntimeError, LookupError, OSError))


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (errors.ConfigError("sim.concurrency=0: must be >= 1; set it to 1 or more"), 2, "sim.concurrency=0"),
        (errors.Unavailable("NATS at nats://x:4222 is not reachable\nstart it with `parley nats`"), 3, "x:4222"),
        (errors.StateError("the ledger names sample 7"), 4, "ledger"),
        (errors.Refused(), 1, "Refused"),
    ],
)
def test_the_command_line_prints_one_line_and_the_exit_code(monkeypatch, capsys, exc, code, line):
    from parley.deploy import cli

    app = typer.Typer()

    @app.command()
    def boom() -> None:
        raise exc

    @app.command()
    def other() -> None: ...

    monkeypatch.setattr(cli, "app", app)
    assert cli.run(["boom"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("parley: ") and line in err, err
    assert "Traceback" not in err
