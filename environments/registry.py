"""Finding environments by name: every installed distribution's entry points in the group
`parley.environments` (parley's own in pyproject.toml, a third party's in theirs). Every role
resolves the run's one name through `load`; the run records `record(name)`.

An entry point names an Environment or a function returning one; the function's keyword
arguments are the environment's options ([env] options in the run file).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from parley.environments.base import Environment

GROUP = "parley.environments"

HOW_TO_ADD = (
    f"an environment is a package that registers an entry point in group {GROUP!r} "
    "(docs/environments.md); after adding or renaming one, reinstall that package (pip install -e .)"
)


def entry_points() -> dict[str, metadata.EntryPoint]:
    """name -> entry point, over every installed distribution. Two distributions registering the
    same name is an error: which one a run trained would depend on install order."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            raise LookupError(
                f"environment {ep.name!r} is registered twice: {_origin(found[ep.name])} and {_origin(ep)}; "
                "uninstall one or rename its entry point"
            )
        found[ep.name] = ep
    return found


def names() -> list[str]:
    return sorted(entry_points())


def _origin(ep: metadata.EntryPoint) -> str:
    dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an unnamed distribution"
    return f"{ep.value} ({dist})"


def _entry(name: str) -> metadata.EntryPoint:
    eps = entry_points()
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise LookupError(f"unknown environment {name!r}; known: {known}. {HOW_TO_ADD}")
    return eps[name]


def load(name: str, options: Mapping[str, Any] | None = None) -> Environment:
    """The environment registered as `name`, built with `options`."""
    ep = _entry(name)
    target = ep.load()
    options = dict(options or {})
    if isinstance(target, Environment):
        if options:
            raise ValueError(f"environment {name!r} ({ep.value}) takes no options; got {sorted(options)}")
        env = target
    elif callable(target):
        try:
            env = target(**options)
        except TypeError as e:
            # a wrong option name or type surfaces here; say which environment and what it got
            raise ValueError(f"environment {name!r} ({ep.value}) rejected options {options}: {e}") from None
        if not isinstance(env, Environment):
            raise TypeError(f"entry point {name!r} -> {ep.value} returned {type(env).__name__}, not an Environment")
    else:
        raise TypeError(
            f"entry point {name!r} -> {ep.value} is a {type(target).__name__}, "
            "not an Environment or a function returning one"
        )
    if env.name != name:
        raise ValueError(
            f"entry point {name!r} -> {ep.value} built an environment named {env.name!r}; "
            "the two names must be the same"
        )
    return env


@dataclass(frozen=True)
class EnvironmentRecord:
    """What a run records of its environment: the name, the distribution that provided it and
    that distribution's version (which versions the environment's data, user and reward)."""

    name: str
    distribution: str
    version: str
    entry_point: str  # module:attribute

    def as_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
        }


def record(name: str) -> EnvironmentRecord:
    ep = _entry(name)
    if ep.dist is None:  # only for an EntryPoint built by hand, never one found installed
        raise LookupError(f"environment {name!r} ({ep.value}) has no distribution to take a version from")
    return EnvironmentRecord(name=name, distribution=ep.dist.name, version=ep.dist.version, entry_point=ep.value)
