"""The actor's side of `[up] gpu_share = "phased"`: the learner and the actor take one GPU in turns.
The actor's engine sleeps (vLLM's sleep mode: its KV cache and weights leave the GPU) once the
groups of the step the learner trains next are played, and wakes when the learner announces the
version that step makes. Used by actors.actor (conversations enter and leave) and by
weights.follow.WeightFollower (before and after every load).

    ACTIVE --(no conversation in flight, a step's groups played on the served version)--> SLEEPING
    SLEEPING --(a version announced: the follower is about to load it)--> WAKING: weights woken,
        the version loaded as when awake, then the KV cache --> ACTIVE
    SLEEPING --(a conversation starts anyway: a dropped group issued again)--> ACTIVE (woken whole)

The sleep is awaited before the step's last trajectory is published: the learner cannot start that
step (and take the GPU memory the KV cache held) before the engine has let it go. On a platform
without sleep mode (vLLM's CPU build: engine.can_sleep is False) the phases run the same and
nothing is freed. Every sleep, wake and wait for one is bounded by `timeout_s`; past it, or when
the engine fails a sleep or a wake, PhaseError: the engine is then neither surely awake nor surely
asleep, so every later conversation gets the same error and `watch` (a job of the actor's) stops the
actor with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from parley.errors import StateError

log = logging.getLogger(__name__)

ACTIVE, SLEEPING, WAKING = "active", "sleeping", "waking"


class PhaseError(StateError):
    """The engine did not sleep or wake (within the phase timeout): it needs a restart, not a retry."""


class PhaseSchedule:
    """When the actor's engine sleeps and wakes. `engine` has `version`, `can_sleep`,
    `async sleep(level)` and `async wake_up(tags)` (engines.engine.PolicyEngine); `quota` is the
    conversations a step trains (groups_per_step x n): once that many have ended on the version the
    learner announces (`announced`, the engine's version by default) and none is in flight, the
    learner admits no more until it announces the next one.
    `put_back` loads the served weights again (the follower's): after a level-2 sleep the weights
    are empty until a version is loaded into them. Level 2 is taken only where put_back needs nothing
    from the learner (files: config.actor.ActorConfig.sleep_level_served, config.run.check_phased)."""

    def __init__(
        self,
        engine,
        *,
        level: int,
        quota: int,
        put_back: Callable[[], Awaitable[None]],
        timeout_s: float = 600.0,
        announced: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: vLLM's sleep levels are 1 (weights to host) and 2 (discarded)")
        self.engine, self.level, self.quota, self.put_back = engine, level, max(1, quota), put_back
        self.timeout_s, self.clock = timeout_s, clock
        self.announced = announced or (lambda: engine.version)
        self.failure: PhaseError | None = None  # a sleep or wake that failed: the actor stops (watch)
        self._failed = asyncio.Event()
        self.phase = ACTIVE
        self.in_flight = 0  # conversations entered and not yet left
        self.loading = 0  # follower loads between before_load and after_load (no sleep meanwhile)
        self.ended: Counter[int] = Counter()  # version -> conversations that ended on it
        self.counters: Counter[str] = Counter()  # "sleeps", "wakes" (for a version), "wakes_for_task"
        self.asleep_s = 0.0  # seconds spent asleep or waking, over the run
        self._since = 0.0  # clock when the current sleep began
        self._lock = asyncio.Lock()  # one transition at a time
        self._active = asyncio.Event()
        self._active.set()
        if not getattr(engine, "can_sleep", False):
            log.warning(
                'gpu_share = "phased": this engine has no sleep mode (vLLM\'s CPU build): the phases run, '
                "nothing is freed"
            )

    def metrics(self) -> dict[str, float]:
        """The heartbeat's share (runtime.metrics names them): transitions, seconds asleep, asleep now."""
        asleep = self.asleep_s + (self.clock() - self._since if self.phase != ACTIVE else 0.0)
        return {
            "phase.sleeps": float(self.counters["sleeps"]),
            "phase.wakes": float(self.counters["wakes"] + self.counters["wakes_for_task"]),
            "phase.asleep_s": asleep,
            "phase.asleep": float(self.phase != ACTIVE),
        }

    # -- conversations -------------------------------------------------------------------------

    async def enter(self) -> None:
        """A conversation is about to use the engine: counted in flight first (no sleep starts after
        this), then the engine is woken if it sleeps, or waited for if it is waking."""
        self.in_flight += 1
        try:
            await self._awake()
        except BaseException:
            self.in_flight -= 1
            raise

    async def leave(self, version: int) -> None:
        """A conversation on a task admitted at `version` ended (its trajectory not yet published):
        the engine sleeps now if that was the last one the learner admits before its next version."""
        self.in_flight -= 1
        self.ended[version] += 1
        if self._should_sleep():
            await self.sleep()

    def _should_sleep(self) -> bool:
        quota_played = self.ended[self.announced()] >= self.quota
        return self.phase == ACTIVE and not self.in_flight and not self.loading and quota_played

    async def _awake(self) -> None:
        while self.phase != ACTIVE:
            if self.failure is not None:
                raise self.failure
            if self.phase == WAKING:  # the follower is loading a version: it wakes the KV cache after
                await self._bounded(self._woken(), "waiting for the engine to wake", fails=False)
                continue
            async with self._lock:
                if self.phase != SLEEPING:
                    continue
                log.info("a conversation starts while the engine sleeps (a group issued again): waking it")
                self._enter(WAKING)
                await self._bounded(self.engine.wake_up(["weights"]), "waking the engine's weights")
                if self.level == 2:  # the weights are empty: the served version is loaded again
                    await self._bounded(self.put_back(), "loading the served weights again")
                await self._bounded(self.engine.wake_up(["kv_cache"]), "waking the engine's KV cache")
                self._enter(ACTIVE)
                self.counters["wakes_for_task"] += 1

    async def _woken(self) -> None:
        """Until the engine is awake, or its wake failed (then _awake raises the failure)."""
        waits = [asyncio.ensure_future(self._active.wait()), asyncio.ensure_future(self._failed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: raise the PhaseError of a sleep or wake that failed (the actor's job: it stops)."""
        waits = [asyncio.ensure_future(self._failed.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.failure is not None:
            raise self.failure

    # -- the transitions -----------------------------------------------------------------------

    async def sleep(self) -> None:
        """ACTIVE -> SLEEPING, unless a conversation entered (or a wake began) meanwhile."""
        async with self._lock:
            if not self._should_sleep():
                return
            t0 = self.clock()
            # SLEEPING from the start: a conversation entering while vLLM frees the memory must not
            # reach the engine (vLLM aborts it, or it runs on memory being unmapped); it waits for
            # this lock in _awake, then wakes the engine whole
            self._enter(SLEEPING)
            await self._bounded(self.engine.sleep(self.level), f"putting the engine to sleep (level {self.level})")
            self.counters["sleeps"] += 1
            log.info(
                "engine asleep (level %d) after %d conversations on version %d, in %.2f s",
                self.level,
                self.ended[self.engine.version],
                self.engine.version,
                self.clock() - t0,
            )

    async def before_load(self) -> None:
        """The follower is about to load a version: a sleeping engine wakes its weights (SLEEPING ->
        WAKING) so the version is loaded into them; its KV cache waits for after_load. An awake
        engine does not start to sleep until after_load (a sleep under a load would break it)."""
        self.loading += 1
        try:
            async with self._lock:
                if self.phase != SLEEPING:
                    return
                self._enter(WAKING)
                await self._bounded(self.engine.wake_up(["weights"]), "waking the engine's weights")
        except BaseException:
            self.loading -= 1
            raise

    async def after_load(self, loaded: bool) -> None:
        """The follower's load ended (`loaded`: the engine serves the version now). WAKING -> ACTIVE:
        after a level-2 sleep a load that did not happen leaves the weights empty, so the served
        version is loaded again first; then the KV cache wakes. A load made awake that kept a sleep
        from starting (the step's last conversation ended under it) lets it start now."""
        self.loading -= 1
        async with self._lock:
            if self.phase == WAKING:
                if self.level == 2 and not loaded:
                    await self._bounded(self.put_back(), "loading the served weights again")
                await self._bounded(self.engine.wake_up(["kv_cache"]), "waking the engine's KV cache")
                self._enter(ACTIVE)
                self.counters["wakes"] += 1
                log.info("engine awake on version %d", self.engine.version)
                return
        if self._should_sleep():
            await self.sleep()

    def _enter(self, phase: str) -> None:
        if phase != ACTIVE and self.phase == ACTIVE:
            self._since = self.clock()
            self._active.clear()
        elif phase == ACTIVE and self.phase != ACTIVE:
            self.asleep_s += self.clock() - self._since
            self._active.set()
        self.phase = phase

    async def _bounded(self, aw: Awaitable, what: str, fails: bool = True):
        """Await `aw` for at most timeout_s. With `fails` (a sleep or a wake of the engine) its failure
        or timeout is the schedule's: recorded in `failure`, raised to every later conversation."""
        if self.failure is not None:
            raise self.failure
        try:
            return await asyncio.wait_for(aw, timeout=self.timeout_s)
        except TimeoutError:
            error = PhaseError(
                f"{what} took over {self.timeout_s:g} s (phase {self.phase}); is the engine stuck? "
                "(actor.phase_timeout_s bounds it)"
            )
        except Exception as e:  # noqa: BLE001 - the engine's own failure, with what it was doing
            if not fails:
                raise
            error = PhaseError(f"{what} failed (phase {self.phase}): {type(e).__name__}: {e}")
            error.__cause__ = e
        if fails:
            self.failure = error
            self._failed.set()
            log.error("%s; the actor stops", error)
        raise error
