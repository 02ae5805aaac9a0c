"""`parley up --actors auto`: actor children added and removed on the signal KEDA scales the actor
Deployment on in a cluster (deploy/k8s/keda/actor-scaledobject.yaml): the TASKS consumer's waiting
messages, tasks no actor has taken. Like KEDA's HPA, the pool wants ceil(waiting / per_actor)
actors within [low, high]; it adds one at a time and not while an added one is still starting (its
engine loads for a while and the backlog cannot fall before it plays), and removes the newest one
only after the backlog has wanted fewer for `down_after_s` (a removed actor costs a start-up to
get back). docs/operations.md, "Scaling actors". Called by deploy/up.py's main loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScalePolicy:
    low: int
    high: int
    per_actor: int  # waiting tasks one actor takes care of (KEDA's lagThreshold)
    down_after_s: float

    @classmethod
    def of(cls, cfg) -> ScalePolicy:
        """From [up] (0 tasks_per_actor = what one actor plays at once: actor.concurrency // rollout.n)."""
        up = cfg.up
        per_actor = up.tasks_per_actor or max(1, cfg.actor.concurrency // cfg.rollout.n)
        return cls(up.min_actors, up.max_actors, per_actor, up.scale_down_after_s)

    def want(self, waiting: int) -> int:
        return max(self.low, min(self.high, math.ceil(waiting / self.per_actor)))


class ActorPool:
    """The actor children of one `parley up`: `spawn(name)` starts one, `retire(name)` stops it (and
    forgets it); `step` makes one scaling decision from the waiting count and the ready children."""

    def __init__(
        self,
        policy: ScalePolicy,
        spawn: Callable[[str], None],
        retire: Callable[[str], Awaitable[None]],
        names: list[str],
    ):
        self.policy, self.spawn, self.retire = policy, spawn, retire
        self.names = list(names)  # running actors, oldest first
        self.next = len(self.names)
        self.starting: str | None = None  # added, not ready yet
        self.fewer_since: float | None = None  # since when the backlog has wanted fewer actors

    async def step(self, waiting: int, ready: set[str], now: float) -> str:
        """ "" or what was done ("added actor-2", "removed actor-2")."""
        if self.starting in ready:
            self.starting = None
        want = self.policy.want(waiting)
        have = len(self.names)
        if want > have:
            self.fewer_since = None
            if self.starting is not None:
                return ""
            name = f"actor-{self.next}"
            self.next += 1
            self.spawn(name)
            self.names.append(name)
            self.starting = name
            return self._say(f"added {name}", waiting, want)
        if want < have:
            if self.fewer_since is None:
                self.fewer_since = now
            if now - self.fewer_since < self.policy.down_after_s:
                return ""
            self.fewer_since = now  # the next removal waits as long again
            name = self.names.pop()
            if self.starting == name:
                self.starting = None
            await self.retire(name)
            return self._say(f"removed {name}", waiting, want)
        self.fewer_since = None
        return ""

    def _say(self, what: str, waiting: int, want: int) -> str:
        line = (
            f"{what}: {waiting} tasks waiting, {self.policy.per_actor} per actor -> {want} wanted "
            f"(bounds {self.policy.low}..{self.policy.high}); {len(self.names)} actors now"
        )
        log.info("%s", line)
        return line
