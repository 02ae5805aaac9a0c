"""`parley actor`: pulls Tasks from the run's TASKS stream (shared durable consumer "actor"), plays
each task's n samples against the user (the simulator service, or the run environment's programmatic
user in-process), publishes one Trajectory per sample and acks the task once all of them are stored.
Follows the learner's weight versions meanwhile.

Several actors on one run split the tasks. A task whose actor dies is redelivered after ack_wait
and replayed from the start; Msg-Ids (traj:<task>/<sample>) keep its trajectories stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections import Counter

from parley.actors.phases import PhaseSchedule
from parley.config.run import RunConfig
from parley.environments.base import Environment, LocalUser, ProgrammaticUser
from parley.protocol import bus, status
from parley.protocol.messages import ABANDONED_STALE, Heartbeat, Task
from parley.rollout.conversation import PolicySettings, StaleWatch, check_task, check_task_limits, run_conversation
from parley.runtime.scratch import scratch_dir
from parley.services.budget import BudgetedUser, CallBudget, follow_updates
from parley.services.sim.client import SimClient
from parley.weights.follow import WeightFollower, WeightsBroken

# How long a task admitted at a version the engine does not serve yet waits for that version to load.
ADMITTED_VERSION_WAIT_S = 120.0

log = logging.getLogger(__name__)


def user_client(env: Environment, nc, actor_cfg) -> SimClient | LocalUser:
    """Who plays the user: the environment's programmatic user in this process (no service, no
    request), else the simulator service over NATS. Both answer `await ask(SimRequest)`."""
    if isinstance(env.user, ProgrammaticUser):
        return LocalUser(env.user)
    return SimClient(nc, timeout_s=actor_cfg.sim_timeout_s, wait_s=actor_cfg.sim_wait_s)


class Actor:
    """The task handler around one policy engine. Conversations in flight, over all tasks, are
    bounded by `concurrency` (one semaphore shared by every sample)."""

    def __init__(
        self,
        nc,
        js,
        cfg: RunConfig,
        engine,
        tokenizer,
        *,
        ident: str,
        concurrency: int | None = None,
        weights_dir: str | os.PathLike,
    ):
        self.nc, self.js, self.cfg = nc, js, cfg
        self.run = cfg.run.name
        self.engine, self.tokenizer = engine, tokenizer
        self.ident = ident
        self.concurrency = concurrency or cfg.actor.concurrency
        self._slots = asyncio.Semaphore(self.concurrency)
        # this actor's share of the run's simulator-call limits: calls past it wait (services.budget)
        ro, actors = cfg.rollout, cfg.up.first_actors()
        self.sim_budget = CallBudget.of_run("sim_budget", ro.sim_call_budget, ro.sim_calls_per_s, actors)
        self.sim = BudgetedUser(user_client(cfg.env.load(), nc, cfg.actor), self.sim_budget)
        self.follower = WeightFollower(
            js,
            self.run,
            engine,
            dest_root=weights_dir,
            poll_s=cfg.actor.weights_poll_s,
            base_dir=engine.settings.model,
            settings=cfg.weights,
        )
        self.policy = PolicySettings(
            max_model_len=cfg.actor.engine.max_model_len,
            sampling=cfg.actor.sampling,
            template_kwargs=dict(cfg.actor.engine.template_kwargs),
            model=cfg.actor.engine.model,
            actor=ident,
        )
        # [up] gpu_share = "phased": the engine sleeps while the learner steps (actors.phases)
        self.phases: PhaseSchedule | None = None
        if cfg.up.gpu_share == "phased":
            self.phases = PhaseSchedule(
                engine,
                level=cfg.actor.sleep_level_served(cfg.weights),
                quota=cfg.learner.groups_per_step * cfg.rollout.n,
                put_back=lambda: self.follower.put_back(),
                timeout_s=cfg.actor.phase_timeout_s,
                announced=lambda: self.follower.announced,
            )
            self.follower.phases = self.phases
        self.counters: Counter[str] = Counter()
        self.in_flight = 0  # conversations being played now
        self.state = "starting"

    def heartbeat(self) -> Heartbeat:
        counters = {k: float(v) for k, v in (self.counters + bus.COUNTERS).items()}
        f = self.follower
        counters.update(
            in_flight=float(self.in_flight),
            refused_versions=float(len(f.refused)),
            sim_waits=float(getattr(self.sim, "waits", 0)),
        )  # a LocalUser never waits
        counters.update(self.sim_budget.counters())
        counters.update(
            {
                "weights.announced": float(f.announced),
                "weights.lag": float(f.announced - self.engine.version),
                "weights.loads": float(len(f.loaded)),
                "weights.load_s": f.load_s,
            }
        )
        counts = getattr(self.engine, "counts", None)  # a test's scripted engine has no scheduler
        if counts is not None:
            # requests vLLM preempted (KV cache short of the conversations in flight): each recomputes its
            # prefix; prompt tokens, those from the prefix cache and the ones older weights computed
            counters.update(counts.counters())
        phases = getattr(self, "phases", None)
        if phases is not None:  # sleeps, wakes and seconds asleep ([up] gpu_share = "phased")
            counters.update(phases.metrics())
        state = "busy" if self.state == "ready" and self.in_flight else self.state
        return Heartbeat(role="actor", id=self.ident, state=state, version=self.engine.version, counters=counters)

    async def handle(self, task: Task, msg) -> None:
        """PullWorker handler: all n samples played and stored, then the task is acked."""
        if task.run != self.run:
            raise bus.Poison(f"task {task.task_id} belongs to run {task.run!r}, not {self.run!r}")
        check_task(task)
        check_task_limits(task, self.policy.max_model_len)
        t0 = time.perf_counter()
        # in_progress well before ack_wait runs out, so a long task is not handed to another actor
        async with bus.keep_alive(msg, every=max(0.5, self.cfg.bus.ack_wait_s / 3)):
            if task.admitted_version > self.engine.version:
                # Admitted on a version announced moments ago: sampling it with the one served now
                # would make the group a version staler than the gate allowed for (and, at the edge of
                # max_staleness, dropped after being played). Loading takes seconds; waiting is cheaper.
                if not await self.follower.reach(task.admitted_version, ADMITTED_VERSION_WAIT_S):
                    log.warning(
                        "task %s admitted at version %d; still serving %d after %.0fs, playing it anyway",
                        task.task_id,
                        task.admitted_version,
                        self.engine.version,
                        ADMITTED_VERSION_WAIT_S,
                    )
            # a spent simulator budget: no new task is started (the worker's slots fill, so none is fetched)
            await self.sim_budget.wait_open()
            watch = self.stale_watch(task)
            try:
                async with asyncio.TaskGroup() as tg:
                    samples = [tg.create_task(self._sample(task, i, watch)) for i in range(task.n)]
            except ExceptionGroup as eg:
                raise _first_of(eg) from None
        await msg.ack()
        self.counters["tasks"] += 1
        log.info(
            "task %s: %d samples stored in %.2fs (%d assistant tokens generated so far); %s",
            task.task_id,
            task.n,
            time.perf_counter() - t0,
            self.counters["assistant_tokens"],
            sample_split([s.result() for s in samples]),
        )

    def stale_watch(self, task: Task) -> StaleWatch | None:
        """The watch its samples share, so they stop once the learner can no longer train their group
        (rollout.conversation.StaleWatch): for training tasks under stale_policy "drop", unless
        [actor] abandon_stale is off."""
        lc = self.cfg.learner
        if not self.cfg.actor.abandon_stale or lc.stale_policy != "drop" or task.split != "train":
            return None
        return StaleWatch(lambda: self.follower.announced, lc.max_staleness, changed=self.follower.announcement)

    async def _sample(self, task: Task, sample: int, watch: StaleWatch | None = None) -> dict[str, float]:
        """Play and publish one sample; returns its trajectory's timings."""
        async with self._slots:
            if self.phases is not None:  # an engine asleep wakes before the conversation starts
                await self.phases.enter()
            self.in_flight += 1
            try:
                traj = await run_conversation(
                    self.engine,
                    self.sim,
                    task,
                    sample,
                    lambda: self.engine.version,
                    tokenizer=self.tokenizer,
                    policy=self.policy,
                    watch=watch,
                )
            finally:
                self.in_flight -= 1
                if self.phases is not None:
                    # the step's last conversation puts the engine to sleep before its trajectory is
                    # published: the learner cannot start that step while the KV cache is still held
                    await self.phases.leave(task.admitted_version)
        self.counters["abandoned_stale"] += traj.terminated == ABANDONED_STALE
        ack = await bus.publish(self.js, self.run, "traj", traj)
        self.counters["trajectories"] += 1
        self.counters["duplicates"] += bool(getattr(ack, "duplicate", False))
        self.counters["sim_fallbacks"] += len(traj.sim_fallbacks)
        self.counters["assistant_tokens"] += traj.assistant_tokens
        return traj.timings

    async def run_until(self, stop: asyncio.Event, *, worker_concurrency: int | None = None) -> None:
        """Serve the announced weight version, then take tasks until `stop`; background failures
        stop the actor and are re-raised here."""
        await self._first_check()
        n = max(1, self.cfg.rollout.n)
        worker = bus.PullWorker(
            self.js,
            self.run,
            "tasks",
            self.handle,
            bus=self.cfg.bus,
            name=self.ident,
            # enough tasks to keep every conversation slot busy, plus one waiting in line
            concurrency=worker_concurrency or max(1, self.concurrency // n) + 1,
        )
        # the operator's changes to the run's limits (`parley auth budget`), applied to this actor's share
        control = await follow_updates(self.nc, self.run, "sim", self.sim_budget)
        self.state = "ready"
        jobs = [
            asyncio.create_task(worker.run_until(stop), name="tasks"),
            asyncio.create_task(self.follower.run_until(stop), name="weights"),
            asyncio.create_task(status.heartbeat_loop(self.nc, self.run, self.heartbeat, stop), name="heartbeat"),
        ]
        if self.phases is not None:  # an engine that failed a sleep or a wake stops the actor
            jobs.append(asyncio.create_task(self.phases.watch(stop), name="phases"))
        watch = getattr(self.engine, "watch", None)  # a test's scripted engine has none
        if watch is not None:  # an engine that died or stalls stops the actor: its tasks go to another
            jobs.append(asyncio.create_task(watch(stop), name="engine"))
        try:
            done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
            stop.set()  # whichever ended first (normally: stop was set), the rest follow
            await asyncio.gather(*jobs, return_exceptions=True)
            for j in jobs:
                if not j.cancelled() and j.exception() is not None:
                    raise j.exception()
        finally:
            for j in jobs:
                j.cancel()
            with contextlib.suppress(Exception):  # a connection already closed has no subscription left
                await control.unsubscribe()
            self.state = "stopping"
            await status.send(self.nc, self.run, self.heartbeat())

    async def _first_check(self, attempts: int = 30) -> None:
        """Load the announced version before taking tasks. Loading the engine blocks the loop for
        a minute, so this first read may meet a reconnect (nats-server restarted meanwhile): retry."""
        for attempt in range(1, attempts + 1):
            try:
                await self.follower.check()
                return
            except WeightsBroken:
                raise
            except Exception as e:  # noqa: BLE001 - timeouts / no responders while the server comes back
                if attempt == attempts:
                    raise
                log.warning(
                    "reading the weights key failed (%s: %s); retry %d/%d", type(e).__name__, e, attempt, attempts - 1
                )
                await asyncio.sleep(2.0)


def sample_split(timings: list[dict[str, float]]) -> str:
    """Where a task's samples spent their play, as the mean over them: waiting on the policy engine
    (generate), on the simulator (simulator), and the rest of the conversation loop (chat template,
    tokenizing, the stale watch)."""
    if not timings:
        return "no samples"
    n = len(timings)
    gen = sum(t.get("generate", 0.0) for t in timings) / n
    sim = sum(t.get("sim", 0.0) for t in timings) / n
    total = sum(t.get("total", 0.0) for t in timings) / n
    return (
        f"a sample's mean: play {total:.3f}s, generate {gen:.3f}s, simulator {sim:.3f}s, rest {total - gen - sim:.3f}s"
    )


def _first_of(eg: BaseExceptionGroup) -> BaseException:
    """The sample failure PullWorker should act on: poison first (dead-letter), then a retry with
    its delay, else the first error (nak with back-off)."""
    flat = []

    def walk(g):
        for e in g.exceptions:
            walk(e) if isinstance(e, BaseExceptionGroup) else flat.append(e)

    walk(eg)
    for kind in (bus.Poison, bus.Retry):
        for e in flat:
            if isinstance(e, kind):
                return e
    return flat[0]


async def main(stop: asyncio.Event, cfg: RunConfig, ident: str, concurrency: int | None = None) -> int:
    """`parley actor`: connect, set up the run's topology, load the policy, serve tasks."""
    from parley.engines.backend import open_engine
    from parley.runtime.role import role_connection

    # timestamped: with the launch time it tells the process's imports from its connection and engine start
    log.info("%s: started; connecting, then loading the policy %s", ident, cfg.actor.engine.model)
    hello = [Heartbeat(role="actor", id=ident, state="starting")]
    t_connect = time.perf_counter()
    async with role_connection(
        cfg.nats, name=f"parley-{ident}", run=cfg.run.name, bus=cfg.bus, topology=True, hello=hello
    ) as (nc, js):
        t0 = time.perf_counter()
        log.info("%s: connected in %.1fs", ident, t0 - t_connect)
        # the behaviour log-probs are of the distribution sampled at actor.sampling.temperature (the learner's too)
        engine, tokenizer, path = open_engine(  # blocks while vLLM loads
            cfg.actor.engine,
            sampled_logprobs=True,
            sleep_mode=cfg.up.gpu_share == "phased",
            requests=concurrency or cfg.actor.concurrency,  # one request a conversation in flight
        )
        log.info("%s: policy %s (%s) loaded in %.0fs", ident, cfg.actor.engine.model, path, time.perf_counter() - t0)
        # removed below; one a killed actor left is removed by the next actor on this host (runtime.scratch)
        weights_dir = scratch_dir("weights", ident)
        try:
            actor = Actor(nc, js, cfg, engine, tokenizer, ident=ident, concurrency=concurrency, weights_dir=weights_dir)
            await actor.run_until(stop)
        finally:
            await asyncio.to_thread(engine.shutdown)
            shutil.rmtree(weights_dir, ignore_errors=True)
    return 0


def run(cfg: RunConfig, ident: str) -> int:
    """`parley actor`'s entry: play tasks until SIGINT/SIGTERM; returns the exit code."""
    from parley.runtime.process import run_async

    return run_async(main, cfg, ident)
