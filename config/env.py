"""[env]: which environment a run trains, the one key every role resolves the same way.

Decoded by config/run.py beside the roles' sections (RunConfig.env), which checks the other
sections against the environment; each role calls `load()` at start, and the learner records
`record()` (learner/envrecord.py). docs/environments.md, "How the roles use it".
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from environments import collabllm, registry
from environments.base import Environment

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class EnvConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[env]: the environment, by its entry-point name, and its options."""

    name: str = collabllm.NAME  # an entry point of group parley.environments
    options: dict[str, Any] = {}  # keyword arguments of the environment's function (e.g. hidden_goal's n_items, seed)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"env.name={self.name!r} is not an environment name; use an entry-point name such "
                             f"as {collabllm.NAME!r}")

    def load(self) -> Environment:
        return registry.load(self.name, self.options)

    def record(self) -> dict[str, Any]:
        """What the run directory and every checkpoint record of the environment."""
        return {**registry.record(self.name).as_dict(), "options": dict(self.options)}
