"""Options generated from the typed config (deploy/flags.py): each option that sets a config key
shows the field's own default, choices and bounds (read here from the type, independently of the
generator), a bad value given as the option fails with the config's one-line error, exactly as
`--set key=value` does, and every command that reads the config takes --dry-run (the README's
claim)."""

from __future__ import annotations

import json
import tomllib
import typing

import click
import msgspec
import pytest
import typer.main

from parley.config.run import RunConfig
from parley.deploy.cli import app, run
from parley.deploy.flags import Flag, flag, with_flags


def commands(group: typer.Typer, path: tuple[str, ...] = ()):
    """(command path, its function) of every command, sub-groups included."""
    for info in group.registered_commands:
        yield (*path, info.name), info.callback
    for sub in group.registered_groups:
        yield from commands(sub.typer_instance, (*path, sub.name))


def generated() -> list[tuple[tuple[str, ...], Flag]]:
    out = [(path, f) for path, fn in commands(app) for f in getattr(fn, "flags", ())]
    from parley.deploy.common import NATS, RUN

    return out + [(("actor",), NATS), (("actor",), RUN)]


FLAGS = generated()


def field_of(key: str):
    """(its default, its Literal choices, its Meta bounds) of config key `key`, from the annotations."""
    *path, leaf = key.split(".")
    section = RunConfig()
    for part in path:
        section = getattr(section, part)
    hint = typing.get_type_hints(type(section), include_extras=True)[leaf]
    metas = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
    base = typing.get_args(hint)[0] if metas else hint
    choices = set(typing.get_args(base)) if typing.get_origin(base) is typing.Literal else set()
    bounds = {b: getattr(m, b) for m in metas for b in ("ge", "gt", "le", "lt") if getattr(m, b) is not None}
    return getattr(section, leaf), choices, bounds


def click_option(path: tuple[str, ...], name: str):
    cmd = typer.main.get_command(app)
    ctx = click.Context(cmd)
    for part in path:
        cmd = cmd.get_command(ctx, part)
    return next(p for p in cmd.params if name in p.opts)


def test_there_are_generated_flags_on_the_role_commands():
    keys = {(p[0], f.key) for p, f in FLAGS}
    for expected in (
        ("actor", "actor.concurrency"),
        ("sim", "sim.backend"),
        ("sim", "sim.prompt"),
        ("judge", "judge.concurrency"),
        ("scorer", "scorer.concurrency"),
        ("learner", "learner.steps"),
        ("up", "up.max_actors"),
        ("eval", "actor.sampling.temperature"),
    ):
        assert expected in keys


@pytest.mark.parametrize("path,f", FLAGS, ids=[f"{' '.join(p)} {f.name}" for p, f in FLAGS])
def test_a_flag_shows_what_the_config_type_holds(path, f):
    default, choices, bounds = field_of(f.key)
    assert f.default == default
    assert set(f.choices) == choices
    assert f.bounds == bounds
    option = click_option(path, f.name)
    assert option.default is None  # not given: the config's value (file, --set) stands
    assert f"[{f.key}:" in option.help
    for b, v in bounds.items():
        assert f"{v}" in option.help
    for c in choices:
        assert str(c) in option.help
    if default not in ("", None):
        assert f"default {default}" in option.help


def bad_value(f: Flag):
    if f.choices:
        return "nope"
    b, v = next(iter(f.bounds.items()))
    step = 1 if f.type is int else 0.5
    return {"ge": v - step, "gt": v, "le": v + step, "lt": v}[b]


CHECKED = [(p, f) for p, f in FLAGS if f.choices or f.bounds]


@pytest.mark.parametrize("path,f", CHECKED, ids=[f"{' '.join(p)} {f.name}" for p, f in CHECKED])
def test_a_bad_value_fails_with_the_configs_one_line_error(path, f, capsys):
    bad = bad_value(f)
    assert run([*path, f.name, str(bad)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"parley: bad configuration: {f.name} {bad}:"), err[0]
    # the same words as the config gives `--set key=value`, only the source differs
    assert run([*path, "--set", f"{f.key}={json.dumps(bad)}"]) == 2
    via_set = capsys.readouterr().err.strip()
    given = f"{f.key}={json.dumps(bad)}"
    assert via_set.startswith(f"parley: bad configuration: --set {given}: "), via_set
    assert err[0].split(f"{f.name} {bad}: ", 1)[1] == via_set.split(f"--set {given}: ", 1)[1]


def test_a_given_flag_lands_in_the_config(capsys):
    assert run(["scorer", "--concurrency", "3", "--dry-run"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["scorer"]["concurrency"] == 3


def test_a_field_without_a_scalar_type_has_no_flag():
    with pytest.raises(TypeError, match="--set scorer.weights"):
        flag("scorer.weights")


def test_a_flag_clashing_with_a_parameter_is_refused():
    def cmd(concurrency: int = 1, flagged=()): ...

    with pytest.raises(TypeError, match="concurrency"):
        with_flags(flag("actor.concurrency"))(cmd)


def test_evals_help_gives_the_benchmarks_own_defaults():
    """parley eval's settings are the benchmark's (evaluation.runner.EvalSettings), not config keys:
    the defaults its help names are EvalSettings' (the command passes only what was given)."""
    from parley.evaluation.runner import EvalSettings

    for name, field in (
        ("--seeds", "seeds"),
        ("--assistant-max-tokens", "assistant_max_tokens"),
        ("--max-new-turns", "max_new_turns"),
        ("--concurrency", "concurrency"),
    ):
        assert f"(default {getattr(EvalSettings, field)})" in click_option(("eval",), name).help, name
    assert "(default off)" in click_option(("eval",), "--thinking").help and not EvalSettings.enable_thinking


def every_command():
    cmd = typer.main.get_command(app)
    ctx = click.Context(cmd)

    def walk(c, path):
        if hasattr(c, "list_commands"):  # a group (typer vendors its own click)
            for name in c.list_commands(ctx):
                yield from walk(c.get_command(ctx, name), (*path, name))
        else:
            yield path, c

    return list(walk(cmd, ()))


def test_every_command_that_reads_the_config_takes_dry_run():
    """README: `--set section.key=value` overrides a key and `--dry-run` checks everything and
    prints the resolved configuration."""
    missing = []
    for path, cmd in every_command():
        opts = {o for p in cmd.params for o in p.opts}
        if "--set" in opts and "--dry-run" not in opts:
            missing.append(" ".join(path))
    assert not missing, f"take --set but not --dry-run: {missing}"
