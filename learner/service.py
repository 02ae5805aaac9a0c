"""The learner process on rank 0. `Learner` builds its parts and routes between them: the intake
(learner.intake: SCORED handler, ledger, acks), the stepper (learner.stepper: the GRPO step and its
logs), weight publication (weights.publish) and the watchers (learner.watchers: dead letters and
deadlines, backlog, periodic eval); its loop polls the background tasks and re-raises their errors,
and it builds the heartbeat. parley.deploy.cli_learner calls `run()`.

Acknowledgement rule (docs/learner.md): a Scored message is acked only after a ledger write that
records it (learner.intake), so a kill at any moment loses no sample and trains none twice; the
ledger's resume is learner.resume.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time

import msgspec

from parley.config.run import RunConfig
from parley.learner import checkpoint as ckpt
from parley.learner import resume as start
from parley.learner.feeder import Feeder, task_id
from parley.learner.groups import Finished, Grouper
from parley.learner.intake import Intake, memory_bound, policy_limits
from parley.learner.resume import LearnerStateError
from parley.learner.runstate import RunState
from parley.learner.steplog import StepLog
from parley.learner.stepper import Stepper
from parley.learner.watchers import Backlog, Evals, Fates
from parley.protocol import status
from parley.protocol.bus import COUNTERS, PullWorker
from parley.protocol.messages import Heartbeat
from parley.weights import lora, registry
from parley.weights.common import VersionConflict, WeightStoreTooSmall, checkpoint_elements, forget_writes
from parley.weights.publish import Publisher, Weights

log = logging.getLogger(__name__)


class Learner:
    """Rank 0's learner: builds the parts over one `RunState` (a resume fills it from the ledger
    first), runs their background tasks and the loop, and answers the heartbeat."""

    def __init__(
        self,
        cfg: RunConfig,
        js,
        nc,
        driver,
        *,
        model_dir,
        resume: bool,
        steps: int,
        eval_launch=None,
        evals: Evals | None = None,
    ):
        started = time.monotonic()
        self.cfg, self.lc, self.js, self.nc, self.driver = cfg, cfg.learner, js, nc, driver
        self.run_name, self.run_dir = cfg.run.name, cfg.run_dir
        self.id = f"{socket.gethostname()}-{os.getpid()}"
        limits = policy_limits(model_dir)
        self.grouper = Grouper(
            cfg.rollout.n,
            max_staleness=self.lc.max_staleness,
            stale_policy=self.lc.stale_policy,
            timeout_s=self.lc.group_timeout_s,
            order=self.lc.group_order,
        )
        self.grouper.done = Finished(task_id(self.run_name, 0).removesuffix("000000"))  # the watermark's tasks
        self.state = RunState(steps=steps)
        from parley.runtime.tracking import open_tracker

        tracker = open_tracker(
            cfg.log, run_dir=self.run_dir, run_name=self.run_name, job_type="learner", config=msgspec.to_builtins(cfg)
        )
        steplog = StepLog(self.run_dir, tracker=tracker)
        ledger = ckpt.Ledger(self.run_dir)  # state.msgpack + the sample log: each write costs what changed
        self.publisher = Publisher()  # uploads and announces versions beside training, one at a time
        self.env = env = cfg.env.load()  # the environment this run trains
        env_record = cfg.env.record()  # which environment (distribution, version, options) trains
        self.resumed = resume  # also when the ledger was never written (learner.resume.restore starts fresh then)
        self.lease_job: asyncio.Task | None = None  # main()'s renewal of the run's lease, polled with the others
        if resume:
            feeder_state = start.restore(
                self.run_dir,
                model_dir,
                env_record,
                ledger=ledger,
                driver=driver,
                state=self.state,
                grouper=self.grouper,
                steplog=steplog,
            )
        else:
            feeder_state = start.fresh(self.run_dir, model_dir, env_record)
        train, _ = env.tasks.train_eval(cfg.data)
        self.feeder = Feeder(
            js,
            self.run_name,
            train,
            cfg.rollout,
            max_staleness=self.lc.max_staleness,
            groups_per_step=self.lc.groups_per_step,
            seed=self.lc.seed,
            state=feeder_state,
            build=env.tasks.task,
            steps=steps,
            oversample=self.lc.oversample_groups,
        )
        # main() builds them before the model, to start the eval child early (early_evals)
        self.evals = evals if evals is not None else Evals(cfg, self.run_dir, launch=eval_launch)
        self.intake = Intake(
            self.state,
            self.grouper,
            self.feeder,
            ledger,
            limits=limits,
            reference_service=cfg.policy.reference == "service",
            ack_wait_s=cfg.bus.ack_wait_s,
            flush_s=self.lc.ledger_flush_s,
            started=started,
            accept_foreign=self.lc.accept_foreign_scored,
            memory_bound=memory_bound(cfg),
        )
        self.weights = weights_publication(
            self.lc,
            cfg.weights,
            js,
            nc,
            self.run_name,
            self.run_dir,
            driver,
            self.publisher,
            self.feeder,
            adapter_base=lora.base_identity(model_dir) if self.lc.lora.adapter_versions else "",
        )
        self.fates = Fates(
            self.state,
            js,
            self.run_name,
            self.grouper,
            self.feeder,
            self.intake,
            task_deadline_s=self.lc.task_deadline_s,
        )
        self.backlog = Backlog(js, self.run_name)
        self.stepper = Stepper(
            self.state,
            cfg,
            js,
            driver,
            grouper=self.grouper,
            feeder=self.feeder,
            intake=self.intake,
            weights=self.weights,
            evals=self.evals,
            steplog=steplog,
            env_record=env_record,
            consumer=f"learner-{self.id}",
            started=started,
        )

    async def run(self, stop: asyncio.Event) -> int:
        st = self.state
        await self.weights.served.start()
        # the weights keys' fence (weights.common): the first announcement reads the key, every later
        # one writes on this learner's own last revision, so a write by another learner stops this one
        forget_writes(self.js, self.run_name)
        await self.weights.publish(st.step)  # actors learn the baseline (version 0) or the restored version
        await self.publisher.drain()
        if self.resumed:  # tasks the learner before this one published and its ledger never recorded
            await self.feeder.adopt_published()
        worker = PullWorker(
            self.js,
            self.run_name,
            "scored",
            self.intake.on_scored,
            bus=self.cfg.bus,
            name=f"learner-{self.id}",
            concurrency=32,
            fetch_timeout=1.0,
        )
        halt = asyncio.Event()
        no_more_tasks = asyncio.Event()  # training is over (the evals may still run), or halt
        jobs = {
            "feeder": self.feeder.run(no_more_tasks),
            "scored-consumer": worker.run_until(halt),
            "keep-alive": self.intake.keep_alive(halt),
            "dead-letters": self.fates.watch_dead(halt),
            "backlog": self.backlog.watch(halt),
            "heartbeat": status.heartbeat_loop(self.nc, self.run_name, self.heartbeat, halt),
            **self.evals.tasks(halt),
        }
        background = [asyncio.create_task(job, name=name) for name, job in jobs.items()]
        # a lost lease stops the learner here, as a crashed task does
        watched = background + ([self.lease_job] if self.lease_job is not None else [])
        if self.resumed:  # what an earlier learner's eval left unfinished comes first (oldest first)
            self.evals.requeue_unfinished(st.step)
        if self.evals.due(st.step, last=st.last()):
            await self.evals.submit(st.step)
        st.phase = "ready"
        try:
            if not st.last():  # the feeder and consumers already run: actors get tasks meanwhile
                log.info(
                    "warm-up before the first step: %.1f s (a zero-weighted forward and backward)",
                    await asyncio.to_thread(self.driver.warm_up),
                )
            while not stop.is_set() and not st.last():
                for t in watched:
                    if t.done():
                        t.result()  # re-raise a crashed background task here
                        raise RuntimeError(f"background task {t.get_name()} stopped")
                self.publisher.check()  # a failed publication stops the learner here
                if self.evals.regression():
                    log.warning("early stop at step %d: %s", st.step, self.evals.regression())
                    break
                if worker.caught_up.is_set():  # not before the backlog in SCORED is read: it may complete them
                    st.since_step += self.intake.consume(self.grouper.expire() + self.fates.overdue())
                if await self.stepper.try_step():
                    continue
                held_in = await self.weights.retry_held()  # a version skipped at its step for held buffers
                if self.intake.flush_due():
                    await self.intake.flush()
                await self.intake.wait_for_data(0.5 if held_in is None else min(0.5, max(held_in, 0.01)))
            # Also after SIGTERM: the upload under way finishes and the newest version is announced
            # (one skipped at its step for held GPU buffers too, once a buffer frees).
            st.phase = "publishing"
            await self.weights.flush_held(getattr(self.cfg.weights, "hold_s", 0.0) + 1.0)
            await self.publisher.drain()
            if self.evals.on and not stop.is_set():
                no_more_tasks.set()
                self.feeder.wake()
                st.phase = "evaluating"
                await self.evals.drain(self.lc.eval_wait_s, stop)
        finally:
            st.phase = "stopping"
            await self.publisher.abandon()  # only after a crash is anything left: it is never announced
            halt.set()
            no_more_tasks.set()
            self.feeder.wake()
            await asyncio.gather(*background, return_exceptions=True)
            # fenced: no write once another may hold the run (a lost lease; a stale one: Intake.fence)
            if (self.lease_job is None or not self.lease_job.done()) and not await self.intake.flush():
                log.error(
                    "the learner lease is stale at stop: the ledger was not written (its messages are redelivered)"
                )
            self.intake.ledger.close()
            self.stepper.steplog.close(self.evals.finished())
        log.info("stopped after step %d", st.step)
        return 0

    def heartbeat(self) -> Heartbeat:
        st, ledger = self.state, self.intake.ledger
        return Heartbeat(
            role="learner",
            id=self.id,
            state=st.phase,
            version=st.step,
            counters={
                "step": float(st.step),
                "buffered_groups": float(len(self.grouper.buffer)),
                "pending_acks": float(len(self.intake.pending)),
                "in_flight": float(len(self.feeder.state.in_flight)),
                "ledger.bytes_written": float(ledger.bytes_written),
                "ledger.last_write_bytes": float(self.intake.ledger_bytes),
                "ledger.compactions": float(ledger.compactions),
                "weights.publishing": float(self.publisher.running is not None),
                "weights.waiting": float(self.publisher.waiting is not None),
                **{f"weights.{k}": float(v) for k, v in self.publisher.counters.items()},
                **{k: float(v) for k, v in self.grouper.counters.items()},
                **{k: float(v) for k, v in st.counters.items()},
                **{k: float(v) for k, v in COUNTERS.items()},
                **self.stepper.live,
                **{f"backlog.{k}": v for k, v in self.backlog.shares.items()},
                **{f"tasks.{k}": v for k, v in self.backlog.tasks.items()},
                **self.evals.counters(),
            },
        )


def weights_publication(
    lc, settings, js, nc, run_name: str, run_dir, driver, publisher: Publisher, feeder, adapter_base: str = ""
) -> Weights:
    """The weight path's learner side for this run (weights.publish.Weights): versions taken from the
    trainer through `driver`, written under the run's learner directory (learner.checkpoint.weights_dir),
    the newest keep_versions kept."""
    return Weights(
        settings,
        js,
        nc,
        run_name,
        driver,
        publisher,
        feeder,
        versions_dir=ckpt.versions_dir(run_dir),
        keep=lc.keep_versions,
        adapter_base=adapter_base,
        adapter_rank=lc.lora.rank if adapter_base else 0,
    )


async def weights_at_start(js, cfg: RunConfig, model_dir) -> None:
    """The weight transport's start (weights.common.Transport.at_start) with the size of one version
    of whole weights in the learner's dtype (an adapter's is not checked: it is a small share; a merged
    one is whole weights)."""
    from parley.learner.trainer import resolve_dtype

    nbytes = 0
    if not cfg.learner.lora.adapter_versions:
        elements = await asyncio.to_thread(checkpoint_elements, model_dir)
        nbytes = elements * resolve_dtype(cfg.learner.dtype).itemsize
    await registry.of(cfg.weights).at_start(js, cfg.run.name, nbytes)


async def early_evals(cfg: RunConfig, resume: bool) -> Evals | None:
    """The periodic eval with its child started, for a fresh run that has one: the child opens its policy
    engine while the model is built, not after the first step (docs/benchmark.md, "Periodic eval and
    early stop"). None for a resumed run (its child starts at its first due version, as it always did:
    its versions may all be evaluated) and where the Learner is going to refuse the run directory (a
    learner state there: nothing of that run is touched)."""
    if resume or cfg.learner.eval_every <= 0 or ckpt.has_state(cfg.run_dir):
        return None
    evals = await asyncio.to_thread(Evals, cfg, cfg.run_dir)
    await evals.start()
    return evals


async def main(stop: asyncio.Event, cfg: RunConfig, resume: bool, reset_streams: bool = False) -> int:
    """`parley learner` on rank 0 (and the only rank on CPU); 0 after cfg.learner.steps steps; 2 when
    another learner holds the run (learner.lease) or a fresh start meets an older run's streams."""
    from parley.engines.models import ensure_model
    from parley.learner.lease import Lease, LeaseError, LeaseLost, check_fresh_streams, holder_name
    from parley.runtime import killpoints
    from parley.runtime.role import connect_nats, role_connection

    try:  # PARLEY_KILL_AT, read once: the crash-consistency tests' named kill points (runtime.killpoints)
        killpoints.arm()
    except killpoints.KillPointError as e:
        log.error("%s", e)
        return 2
    if killpoints.armed("upload"):
        from parley.weights import objstore

        objstore.chunks_stored = lambda name: killpoints.reached("upload")
    driver = None
    async with role_connection(cfg.nats, name="parley-learner", run=cfg.run.name, bus=cfg.bus, topology=True) as (
        nc,
        js,
    ):
        # renewed on a thread and connection of its own: the loop is held longer than the TTL by loading
        lease = Lease(
            js, cfg.run.name, holder_name(), connect=lambda: connect_nats(cfg.nats, name="parley-learner-lease")
        )
        try:  # before anything is loaded or written: a second learner leaves the run as it is
            await lease.acquire()
            if not resume:
                await check_fresh_streams(js, cfg.run.name, reset_streams)
        except LeaseError as e:
            await lease.release()
            log.error("%s", e)
            return 2
        released = asyncio.Event()
        keeping = asyncio.create_task(lease.keep(released), name="lease")  # renewed from now on, loading included
        evals = None  # ended below on every way out; Learner.run's eval task ends it when it ran
        try:
            model_dir = await asyncio.to_thread(ensure_model, cfg.policy.model)
            evals = await early_evals(cfg, resume)
            # torch and the trainer only now: the eval child imports vLLM and opens its engine meanwhile
            # (on an H100 the learner's imports had held its start 7.7 s behind the actor's)
            from parley.learner.ranks import Driver
            from parley.learner.trainer import Trainer

            try:  # before the model is built: an earlier learner's half-done upload frees its room
                await weights_at_start(js, cfg, model_dir)
            except WeightStoreTooSmall as e:
                log.error("%s", e)
                return 2
            trainer = await asyncio.to_thread(
                Trainer, cfg.learner, model_dir, reference=cfg.policy.reference, weights=cfg.weights
            )
            driver = Driver(trainer)
            # adapter versions name their base: every base shard hashed once, off the loop (the lease renews)
            if cfg.learner.lora.adapter_versions:
                await asyncio.to_thread(lora.base_identity, model_dir)
            try:  # off the loop: the ledger's resume, the train split and the tracker take long on a big run,
                # and the loop meanwhile answers the server's pings, watches the lease and hears a SIGTERM
                learner = await asyncio.to_thread(
                    Learner,
                    cfg,
                    js,
                    nc,
                    driver,
                    model_dir=model_dir,
                    resume=resume,
                    steps=cfg.learner.steps,
                    evals=evals,
                )
            except (LearnerStateError, ckpt.LedgerError) as e:
                log.error("%s", e)
                return 2
            learner.lease_job = keeping
            learner.intake.fence = lease.holds
            try:
                return await learner.run(stop)
            except (LeaseLost, VersionConflict) as e:  # another learner holds the run now: one line, no traceback
                log.error("%s", e)
                return 2
        finally:
            if evals is not None:  # a child started early must not outlive a learner that failed to start
                await evals.close()
            if driver is not None:
                driver.stop()
            released.set()
            await asyncio.gather(keeping, return_exceptions=True)
            await lease.release()


def follower(cfg: RunConfig) -> None:
    """Ranks > 0 under the deepspeed launcher / torchrun: build the same trainer, replay rank 0's calls."""
    from parley.engines.models import ensure_model
    from parley.learner.ranks import follow
    from parley.learner.trainer import Trainer

    follow(Trainer(cfg.learner, ensure_model(cfg.policy.model), reference=cfg.policy.reference, weights=cfg.weights))


def check_leakage(cfg: RunConfig) -> str | None:
    """Refuse, before any work, to train on reference targets the eval split also scores against:
    the reason as one line, or None when the split is clean (or the overlap is allowed and recorded)."""
    from parley.evaluation.leakage import LeakageError, guard_environment

    try:
        env = cfg.env.load()
        train, held = env.tasks.train_eval(cfg.data)
        guard_environment(env.tasks, train, held, cfg.data.allow_overlap, cfg.run_dir)
    except (LeakageError, FileNotFoundError, ValueError) as e:
        return str(e)
    return None


def run(cfg: RunConfig, resume: bool, rank: int = 0, reset_streams: bool = False) -> int:
    """`parley learner`'s entry on every rank: the leakage guard, then rank 0 serves the run and the
    other ranks follow its training calls. Returns the exit code; a rank of several (under a launcher)
    ends its process with it instead (learner.ranks.leave_process says why)."""
    problem = check_leakage(cfg)
    if problem:
        print(f"parley learner: {problem}", file=sys.stderr)
        return 2
    if rank:
        follower(cfg)
        code = 0
    else:
        from parley.runtime.process import run_async

        code = run_async(main, cfg, resume, reset_streams)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from parley.learner.ranks import leave_process

        leave_process(code)
    return code
