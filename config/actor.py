"""Typed configuration of the rollout side: the policy/service engines, `parley actor` and `parley sim`.

Sections [actor] and [sim] of the run file decode into these Structs (unknown keys rejected);
the engine and backend Structs they hold live in engines/config.py, the sampling in protocol.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

from parley.engines.config import EngineConfig, ServiceBackend
from parley.protocol.messages import Sampling
from parley.weights.config import from_gpu_buffer

SimPrompt = Literal["lazy_full", "lazy_summary", "cooperative"]
SIM_PROMPTS = get_args(SimPrompt)


class SimConfig(ServiceBackend, kw_only=True, forbid_unknown_fields=True):
    """[sim]: the user-simulator service."""

    prompt: SimPrompt = "lazy_full"  # default prompt variant when a request names none


class ActorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[actor]: a rollout actor."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    concurrency: Annotated[int, Meta(ge=1)] = 8  # conversations in flight
    # the behaviour policy; training needs temperature > 0 and top_p = 1 (config.run.check_training)
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    sim_timeout_s: Annotated[float, Meta(gt=0)] = 180.0  # one simulator request
    # While the simulator is unreachable a conversation waits for it (the task held, its deliveries
    # not spent: a simulator restart can take minutes); after this long the task is dead-lettered.
    sim_wait_s: Annotated[float, Meta(ge=0, description="0 gives a task up at the first outage")] = 900.0
    weights_poll_s: Annotated[float, Meta(gt=0)] = 5.0  # poll the weights key as well as watching it
    # Stop a training conversation (at its next turn boundary, or cutting its running generation or
    # simulator call) once the learner can no longer train its group ([learner] stale_policy "drop" and
    # a turn of its task lagging the announced version by more than max_staleness): published as far
    # as played (terminated "stale"), never judged or trained. Off: every conversation is played to its end.
    abandon_stale: bool = True
    # [up] gpu_share = "phased": how deep the engine sleeps while the learner steps (vLLM's sleep levels).
    # 1 moves its weights to host memory and discards the KV cache; 2 discards both, and the next version
    # is loaded into empty weights (every version replaces all of them: whole weights, or serve = "merged").
    # 0 = by what is served and how it travels: 1 where LoRA adapters are served on the base or versions
    # come in the learner's GPU buffer (cuda_ipc, nccl), else 2 (sleep_level_served).
    sleep_level: Literal[0, 1, 2] = 0
    # phased: the longest an engine's sleep, wake or a conversation's wait for the engine to wake may take
    phase_timeout_s: Annotated[float, Meta(gt=0)] = 600.0

    def sleep_level_served(self, weights) -> int:
        """The sleep level phased sharing uses: sleep_level, 0 resolved by what the engine serves and
        how the run's versions travel (`weights`, its [weights]). Level 2 only where the served version
        can be loaded again without the learner (a group issued again while asleep wakes the engine on
        it; so does a wake whose new version fails to load): from files, not from the learner's GPU
        buffer, which the next version overwrites (weights.config.from_gpu_buffer)."""
        if self.sleep_level:
            return self.sleep_level
        return 1 if self.engine.max_lora_rank > 0 or from_gpu_buffer(weights) else 2
