"""[env]: which environment a run trains, the one key every role resolves the same way.

Decoded by config/run.py beside the roles' sections (RunConfig.env), which checks the other
sections against the environment; each role calls `load()` at start, and the learner records
`record()` (learner/envrecord.py). docs/environments.md, "How the roles use it".
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import msgspec

from parley.environments import collabllm, registry
from parley.environments.base import Environment

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_NAME = collabllm.NAME  # the environment of a run whose [env] names none


class EnvConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[env]: the environment, by its entry-point name, and its options."""

    name: str = DEFAULT_NAME  # an entry point of group parley.environments
    options: dict[str, Any] = {}  # keyword arguments of the environment's function (e.g. hidden_goal's n_items, seed)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"env.name={self.name!r} is not an environment name; use an entry-point name such as {DEFAULT_NAME!r}"
            )

    def load(self) -> Environment:
        return registry.load(self.name, self.options)

    def scored_as(self, scorer: Any) -> EnvConfig:
        """This [env] with the environment's scorer_options taken from `scorer` (the [scorer] section,
        or anything with its keys), the one place a run sets them. An [env] option that says otherwise
        is refused: which of the two a run scored by would be a guess."""
        options = dict(self.options)
        for k in self.load().scorer_options:
            v = getattr(scorer, k)
            if options.get(k, v) != v:
                raise ValueError(
                    f"env.options.{k}={options[k]!r} differs from scorer.{k}={v!r}; {self.name}'s "
                    f"scoring is set in [scorer] ({k} = ...): remove env.options.{k}"
                )
            options[k] = v
        return EnvConfig(name=self.name, options=options)

    def record(self) -> dict[str, Any]:
        """What the run directory and every checkpoint record of the environment."""
        return {**registry.record(self.name).as_dict(), "options": dict(self.options)}


@cache
def default_environment() -> Environment:
    """The environment of a run whose [env] is not given, with its default options."""
    return EnvConfig().load()


def default_scored_as(scorer: Any) -> Environment:
    """The default environment, scored as a bare [scorer] section says (for callers that hold no
    environment, only a [scorer] section)."""
    return default_with(**{k: getattr(scorer, k) for k in default_environment().scorer_options})


def default_with(**options: Any) -> Environment:
    """The default environment built with these of its options (the others at their defaults)."""
    return _default_with(tuple(sorted(options.items())))


@cache
def _default_with(options: tuple[tuple[str, Any], ...]) -> Environment:
    return EnvConfig(options=dict(options)).load()
