"""Typed configuration of the rollout side: the policy/service engines, `parley actor` and `parley sim`.

Sections [actor] and [sim] of the run file decode into these Structs (unknown keys rejected);
the engine and backend Structs they hold live in engines/config.py.
"""

from __future__ import annotations

import msgspec

from engines.config import EngineConfig, ServiceBackend

SIM_PROMPTS = ("lazy_full", "lazy_summary", "cooperative")


class SimConfig(ServiceBackend, kw_only=True, forbid_unknown_fields=True):
    """[sim]: the user-simulator service."""

    prompt: str = "lazy_full"  # default prompt variant when a request names none

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt not in SIM_PROMPTS:
            raise ValueError(f"prompt={self.prompt!r} not allowed; use one of {SIM_PROMPTS}")


class ActorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[actor]: a rollout actor."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    concurrency: int = 8  # conversations in flight
    temperature: float = 1.0  # behaviour policy; training needs > 0 and top_p = 1 (config.run.check_training)
    top_p: float = 1.0
    sim_timeout_s: float = 180.0  # one simulator request
    # While the simulator is unreachable a conversation waits for it (the task held, its deliveries
    # not spent: a simulator restart can take minutes); after this long the task is dead-lettered.
    sim_wait_s: float = 900.0
    weights_poll_s: float = 5.0  # poll the weights key as well as watching it

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.sim_wait_s < 0:
            raise ValueError(f"sim_wait_s={self.sim_wait_s} must be >= 0 (0 gives a task up at the first outage)")
