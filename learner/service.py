"""The learner process on rank 0: feeder, SCORED consumer and grouping, GRPO steps on the
trainer, weight publication, the ledger/checkpoint protocol that makes resume exact, step logs
and heartbeats. deploy.cli_learner builds it and calls `run()`; the loop in `run()` only routes.

Acknowledgement rule (docs/learner.md): a Scored message is acked only after a ledger write
that records it (buffered, trained at a checkpointed step, or finished otherwise), so a kill
at any moment loses no sample and trains none twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections import Counter
from pathlib import Path

from nats.js.errors import APIError

from learner import checkpoint as ckpt
from learner import envrecord
from learner.feeder import Feeder, FeederState, Issued
from learner.publication import Publication, Publisher
from learner.groups import (
    BadTrajectory,
    Group,
    Grouper,
    Outcome,
    Taken,
    behaviour_logprobs,
    check_hostile_values,
    check_trajectory,
)
from learner.steplog import StepLog
from config.run import RunConfig
from protocol import arrays, backlog, codec, dead, status, topology
from protocol.bus import COUNTERS, UNREACHABLE, Poison, PullWorker, dead_letter, retry_unreachable
from protocol.messages import Heartbeat
from protocol.weights import ServedVersions, publish_gpu_version, publish_version

log = logging.getLogger("parley.learner")


class LearnerStateError(RuntimeError):
    """The run directory's learner state does not fit the command (fresh start over an old run)."""


class Learner:
    def __init__(self, cfg: RunConfig, js, nc, driver, *, model_dir, resume: bool, steps: int, eval_launch=None):
        self.cfg, self.lc, self.js, self.nc, self.driver = cfg, cfg.learner, js, nc, driver
        self.run_name, self.run_dir, self.steps = cfg.run.name, cfg.run_dir, steps
        self.model_dir = model_dir
        # token ids beyond the vocabulary and conversations beyond the positions are refused at intake
        self.vocab_size, self.max_positions = policy_limits(model_dir)
        self.served = ServedVersions(nc, self.run_name)  # what actors serve is never pruned
        self.grouper = Grouper(cfg.rollout.n, max_staleness=self.lc.max_staleness, stale_policy=self.lc.stale_policy,
                               timeout_s=self.lc.group_timeout_s)
        self.step = 0  # optimizer steps done = the policy version the trainer holds
        self.ckpt_step, self.tag = 0, ""  # what the last ledger write can vouch for
        self.uncommitted: list[tuple[Group, Issued | None]] = []  # trained after the last checkpoint (group, its issue)
        self.pending: list = []  # received messages not yet covered by a ledger write
        self.last_flush = time.monotonic()
        self.wait_since = time.monotonic()
        self.since_step: list[Outcome] = []  # groups dropped/skipped since the last step
        self.reasons: dict[str, str] = {}  # task_id -> why it was not trained (kept in the ledger)
        self.dead_seq = 1  # next DEAD stream sequence to read
        self.backlog: dict[str, float] = {}  # channel -> share of its max_bytes unconsumed (protocol.backlog)
        self.counters: Counter[str] = Counter()
        self.steplog = StepLog(self.run_dir)
        self.ledger = ckpt.Ledger(self.run_dir)  # state.msgpack + the sample log: each write costs what changed
        self.ledger_bytes = 0  # bytes the last ledger write wrote
        self.publisher = Publisher()  # uploads and announces versions beside training, one at a time
        self._data = asyncio.Event()
        self.id = f"{socket.gethostname()}-{os.getpid()}"
        self.state_name = "starting"
        self.live: dict[str, float] = {}  # last step's reward terms and staleness, for the live view

        from rewards.diagnostics import SignalMonitor

        self.monitor = SignalMonitor()
        self.env = cfg.env.load()
        self.env_record = cfg.env.record()  # which environment (distribution, version, options) trains
        feeder_state = self._restore() if resume else self._fresh()
        train, _ = self.env.tasks.train_eval(cfg.data)
        self.feeder = Feeder(js, self.run_name, train, cfg.rollout, max_staleness=self.lc.max_staleness,
                             groups_per_step=self.lc.groups_per_step, seed=self.lc.seed, state=feeder_state,
                             build=self.env.tasks.task, steps=steps)
        self.evals = None
        if self.lc.eval_every > 0:
            from evaluation.periodic import PeriodicEval

            self.evals = PeriodicEval(cfg, self.run_dir, export=ckpt.export_version, launch=eval_launch)

    # -- start ----------------------------------------------------------------------------------

    def _fresh(self) -> FeederState:
        if ckpt.has_state(self.run_dir):
            raise LearnerStateError(
                f"{ckpt.learner_dir(self.run_dir)} holds a learner state; pass --resume to "
                "continue it, or use another run name / run.dir for a fresh run"
            )
        ckpt.record_base_model(self.run_dir, self.model_dir)
        envrecord.write(self.run_dir, self.env_record)
        return FeederState()

    def _restore(self) -> FeederState:
        state = self.ledger.open()  # the buffered samples come back from the sample log
        if state is None:
            log.warning("--resume: no learner state in %s; starting fresh", ckpt.learner_dir(self.run_dir))
            return self._fresh()
        changed = envrecord.differs(self.run_dir, self.env_record)
        if changed:
            raise LearnerStateError(f"--resume: {changed}")
        if state.tag:
            self.driver("load_checkpoint", ckpt.ckpt_dir(self.run_dir), state.tag)
        self.step = self.ckpt_step = state.step
        self.tag = state.tag
        self.grouper.done = dict(state.done)
        self.reasons = dict(state.reasons)
        self.dead_seq = state.dead_seq
        self.grouper.counters.update(state.counters)
        for g in state.groups:
            self.grouper.restore(Group(g.task_id, g.first_seen, {s.sample: s for s in g.samples}, g.completed))
        self.steplog.truncate(state.step)
        ckpt.truncate_archive(self.run_dir, state.step)
        log.info(
            "resumed at step %d (checkpoint %s): %d buffered groups, %d finished tasks, feeder at task %d",
            state.step, state.tag or "initial weights", len(state.groups), len(state.done), state.next_index,
        )
        # The deadline counts only while a learner runs: the time it was down is added to each issue
        # time, so the samples actors produced meanwhile (waiting in SCORED) are read before any of
        # their tasks is given up. A ledger from before issue records were kept counts from now.
        now = time.time()
        down = max(0.0, now - state.saved)
        issued = {i.task_id: Issued(at=i.at + down, version=i.version) for i in state.issued}
        in_flight = {t: issued.get(t) or Issued(at=now, version=state.step) for t in state.in_flight}
        return FeederState(next_index=state.next_index, in_flight=in_flight, consumed=state.consumed)

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        await self.served.start()
        await self.publish(self.step)  # actors learn the baseline (version 0) or the restored version
        await self.publisher.drain()
        worker = PullWorker(self.js, self.run_name, "scored", self.on_scored, bus=self.cfg.bus, name=f"learner-{self.id}",
                            concurrency=32, fetch_timeout=1.0)
        halt = asyncio.Event()
        no_more_tasks = asyncio.Event()  # training is over (the evals may still run), or halt
        background = [
            asyncio.create_task(self.feeder.run(no_more_tasks), name="feeder"),
            asyncio.create_task(worker.run_until(halt), name="scored-consumer"),
            asyncio.create_task(self.keep_alive(halt), name="keep-alive"),
            asyncio.create_task(self.watch_dead(halt), name="dead-letters"),
            asyncio.create_task(self.watch_backlog(halt), name="backlog"),
            asyncio.create_task(status.heartbeat_loop(self.nc, self.run_name, self.heartbeat, halt), name="heartbeat"),
        ]
        if self.evals is not None:
            background.append(asyncio.create_task(self.evals.run(halt), name="periodic-eval"))
            if self.evals.due(self.step, last=self.steps > 0 and self.step >= self.steps):
                await self.evals.submit(self.step, self.step)
        self.state_name = "ready"
        try:
            while not stop.is_set() and (self.steps == 0 or self.step < self.steps):
                for t in background:
                    if t.done():
                        t.result()  # re-raise a crashed background task here
                        raise RuntimeError(f"background task {t.get_name()} stopped")
                self.publisher.check()  # a failed publication stops the learner here
                if self.evals is not None and self.evals.regression:
                    log.warning("early stop at step %d: %s", self.step, self.evals.regression)
                    break
                self.since_step += self.consume(self.grouper.expire() + self.overdue())
                if await self.try_step():
                    continue
                if self.pending and time.monotonic() - self.last_flush >= self.lc.ledger_flush_s:
                    await self.flush()
                self._data.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._data.wait(), timeout=0.5)
            # Also after SIGTERM: the upload under way finishes and the newest version is announced.
            self.state_name = "publishing"
            await self.publisher.drain()
            if self.evals is not None and not stop.is_set():
                no_more_tasks.set()
                self.feeder.wake()
                self.state_name = "evaluating"
                await self.evals.drain(self.lc.eval_wait_s, stop)
        finally:
            self.state_name = "stopping"
            await self.publisher.abandon()  # only after a crash is anything left: it is never announced
            halt.set()
            no_more_tasks.set()
            self.feeder.wake()
            await asyncio.gather(*background, return_exceptions=True)
            await self.flush()
            self.ledger.close()
            self.steplog.close()
        log.info("stopped after step %d", self.step)
        return 0

    # -- intake ---------------------------------------------------------------------------------

    async def on_scored(self, scored, msg) -> None:
        """PullWorker handler: buffer the sample; its ack waits for the next ledger write."""
        try:
            check_trajectory(scored.trajectory)
            check_hostile_values(scored, self.vocab_size, self.max_positions, reference=self.cfg.policy.reference == "service")
            result = self.grouper.add(scored)
        except BadTrajectory as e:
            raise Poison(str(e)) from None
        self.counters[f"scored.{result}"] += 1
        self.pending.append(msg)
        if result == "complete":
            self._data.set()

    async def keep_alive(self, halt: asyncio.Event) -> None:
        """Held messages must not be redelivered while a step runs: tell the server we work on them."""
        every = max(self.cfg.bus.ack_wait_s / 3.0, 0.2)
        while not halt.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(halt.wait(), timeout=every)
            for m in list(self.pending):
                with contextlib.suppress(Exception):
                    await m.in_progress()

    def consume(self, outcomes: list[Outcome]) -> list[Outcome]:
        for o in outcomes:
            self.feeder.mark_consumed(o.task_id, trained=False)
            self.reasons[o.task_id] = o.reason
            self.counters[f"groups.{o.kind}"] += 1
        return outcomes

    # -- the fate of issued tasks -----------------------------------------------------------------
    # An issued task that never becomes a complete group (its Task, or one of its samples, was
    # dead-lettered; it was lost some other way) would hold its admission slot for good, and
    # max_staleness x groups_per_step + 1 of them stop admission. The DEAD stream tells most such
    # fates at once; task_deadline_s catches the rest.

    async def watch_dead(self, halt: asyncio.Event, every: float = 2.0) -> None:
        """Read the run's dead letters as they come (from the ledger's dead_seq on a resume)."""
        failing = False
        while not halt.is_set():
            try:
                letters, nxt = await dead.read_since(self.js, self.run_name, self.dead_seq)
            except (*UNREACHABLE, APIError) as e:
                if not failing:
                    log.warning("cannot read the DEAD stream (%s: %s): NATS away, or this user may not read it "
                                "(deploy/auth.py); retrying, task_deadline_s=%g is the backstop meanwhile",
                                type(e).__name__, e, self.lc.task_deadline_s)
                failing = True
            else:
                failing = False
                for _, dl in letters:
                    if dl is not None:
                        self.on_dead(dl)
                self.dead_seq = nxt  # after applying them: a ledger never skips a letter it did not see
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(halt.wait(), timeout=every)

    async def watch_backlog(self, halt: asyncio.Event, every: float = 30.0) -> None:
        while not halt.is_set():
            await self.check_backlog()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(halt.wait(), timeout=every)

    async def check_backlog(self) -> None:
        """Warn (once per crossing) when a channel's unconsumed messages near its stream's limit:
        past it the stream drops its oldest messages unread."""
        try:
            now = await backlog.shares(self.js, self.run_name)
        except (*UNREACHABLE, APIError) as e:
            log.debug("backlog check skipped (%s: %s)", type(e).__name__, e)
            return
        for key, (share, max_bytes) in now.items():
            was = self.backlog.get(key, 0.0)
            if share >= backlog.WARN_SHARE > was:
                log.warning("%s", backlog.warning(key, share, max_bytes))
            elif was >= backlog.WARN_SHARE > share:
                log.info("stream %s: unconsumed messages back to %.0f%% of max_bytes", key, 100 * share)
            self.backlog[key] = share

    def on_dead(self, dl) -> None:
        ref = dead.task_ref(self.run_name, dl)
        if ref is None or ref.task_id not in self.feeder.state.in_flight:
            return  # not about a task we issued and still wait for
        if ref.sample is not None and not 0 <= ref.sample < self.grouper.n:
            return  # a sample no group has (refused for its index): no real sample of the task is lost
        what = "its Task" if ref.sample is None else f"sample {ref.sample}"
        reason = f"dead: {what} was dead-lettered by {dl.consumer} ({ref.key}): {dl.reason}"
        outcome = self.grouper.abandon(ref.task_id, "dead", reason, sample=ref.sample)
        if outcome is not None:
            self.since_step += self.consume([outcome])

    def overdue(self) -> list[Outcome]:
        out = []
        for task, age in self.feeder.overdue(self.lc.task_deadline_s):
            g = self.grouper.buffer.get(task)
            reason = (f"deadline: {len(g.samples) if g else 0}/{self.grouper.n} samples {age:.0f}s after it was "
                      f"issued (task_deadline_s={self.lc.task_deadline_s:g})")
            # None while its complete group waits for a step or is being trained: that is progress.
            outcome = self.grouper.abandon(task, "deadline", reason)
            if outcome is not None:
                out.append(outcome)
        return out

    # -- the step -------------------------------------------------------------------------------

    async def try_step(self) -> bool:
        taken, outcomes = self.grouper.take(self.lc.groups_per_step, self.step)
        self.since_step += self.consume(outcomes)
        if not taken:
            return False
        wait_s = time.monotonic() - self.wait_since
        self.state_name = "busy"
        samples = self.samples(taken)
        try:
            stats = await asyncio.to_thread(self.driver, "train_step", samples)
        except BaseException:
            self.grouper.untake(taken)  # not trained: the ledger must keep them buffered
            raise
        if stats.get("skipped"):
            await self.refuse_step(taken, stats)
            return True
        admitted_at = self.step  # the version the groups were trained against
        self.step += 1
        admission_lag: Counter[str] = Counter()
        for t in taken:
            issued = self.feeder.mark_consumed(t.group.task_id)
            self.uncommitted.append((t.group, issued))
            if issued is not None:
                admission_lag[str(admitted_at - issued.version)] += 1
        # The feeder's version moves in publish(), once the actors have been told of the new weights.
        stats["wait_s"] = wait_s
        stats["admission_lag_hist"] = dict(admission_lag)

        last = self.steps and self.step >= self.steps
        eval_due = self.evals is not None and self.evals.due(self.step, last=bool(last))
        if self.step % self.lc.publish_every == 0 or last:
            t0 = time.perf_counter()
            await self.publish(self.step, write_now=eval_due)
            stats["publish_s"] = time.perf_counter() - t0  # on the step's path: the CPU copy (and the file, for an eval)
        if self.step % self.lc.checkpoint_every == 0 or last:
            t0 = time.perf_counter()
            tag = ckpt.step_tag(self.step)
            await asyncio.to_thread(self.driver, "save_checkpoint", ckpt.ckpt_dir(self.run_dir), tag)
            envrecord.write(ckpt.ckpt_dir(self.run_dir) / tag, self.env_record)
            self.ckpt_step, self.tag = self.step, tag
            self.uncommitted.clear()
            stats["checkpoint_s"] = time.perf_counter() - t0
        # after the checkpoint: an unpublished version is exported from it
        if eval_due:
            t0 = time.perf_counter()
            await self.evals.submit(self.step, self.step)
            stats["eval_export_s"] = time.perf_counter() - t0
        # The step's lines go out before the ledger that vouches for them: a resume drops lines
        # beyond the ledger's step, never misses one.
        metrics = self.metrics(taken, stats)
        self.steplog.write(self.step, metrics, self.trained_entry(taken))
        self.live = live_counters(metrics)
        dropped = [s for o in self.since_step if o.group is not None for s in o.group.ordered()]
        self.since_step = []
        await self.flush()
        # After the ledger: an archived step is one the ledger vouches for (a resume removes later ones).
        trained = [s for t in taken for s in t.group.ordered()]
        await asyncio.to_thread(ckpt.write_archive, self.run_dir, self.step, trained, dropped)
        if self.tag == ckpt.step_tag(self.step):
            ckpt.prune_checkpoints(self.run_dir, self.lc.keep_checkpoints, self.tag)
        log.info(
            "step %d: loss %.4f, %d groups, %d tokens, %.1fs train, %.1fs waiting for data",
            self.step, stats.get("loss", float("nan")), len(taken), int(stats["tokens"]), stats["train_s"], wait_s,
        )
        self.wait_since = time.monotonic()
        self.state_name = "ready"
        return True

    async def refuse_step(self, taken: list[Taken], stats: dict) -> None:
        """The trainer did not apply a step (its loss or gradient norm was not finite): the weights are
        as before, its groups are final (kind "nonfinite", in the ledger with the next write) and each
        of their samples goes to DEAD with the reason, for an operator to look at."""
        reason = (f"not trained: the step over these groups had loss {stats.get('loss', float('nan')):.4g} and "
                  f"grad norm {stats.get('grad_norm', float('nan')):.4g}; not finite, so it was skipped")
        self.since_step += self.consume(self.grouper.reject(taken, reason))
        self.counters["steps.skipped"] += 1
        subject = topology.subject(self.run_name, "scored")
        for t in taken:
            for s in t.group.ordered():
                await retry_unreachable(
                    lambda s=s: dead_letter(self.js, self.run_name, subject=subject, reason=f"{s.traj_id}: {reason}",
                                            consumer=f"learner-{self.id}", payload=codec.encode(s),
                                            max_bytes=self.cfg.bus.max_msg_bytes),
                    what=f"dead-lettering {s.traj_id}",
                )
        self.state_name = "ready"
        self.wait_since = time.monotonic()

    def samples(self, taken: list[Taken]):
        import torch

        from learner.packing import Sample
        from learner.grpo import group_advantages

        rewards = torch.tensor([t.group.rewards() for t in taken], dtype=torch.float64)  # (G, n)
        adv = group_advantages(rewards, scale=self.lc.scale_advantages)  # (G, n)
        out = []
        for gi, t in enumerate(taken):
            for si, s in enumerate(t.group.ordered()):
                traj = s.trajectory
                out.append(Sample(s.traj_id, arrays.token_ids(traj), arrays.loss_mask(traj), behaviour_logprobs(traj),
                                  float(adv[gi, si]),
                                  ref=arrays.ref_logprobs(s) if self.cfg.policy.reference == "service" else None,
                                  temperature=traj.temperature))
        return out

    async def publish(self, version: int, write_now: bool = False) -> None:
        """Take `version`'s weights now, before the next step can change them, and hand their upload and
        announcement to the publisher (learner.publication): the next step does not wait for them.
        objstore / shared_dir: a CPU copy on rank 0 (Trainer.weights_snapshot; ZeRO-3 gathers first),
        written to weights_dir in the background, or at once with `write_now` (an eval exports it
        next). cuda_ipc / nccl: packed into one of rank 0's GPU buffers (no file); only the
        announcement is left for the background."""
        if self.lc.transport in ("cuda_ipc", "nccl"):
            source = await asyncio.to_thread(self.driver, "pack_weights", version)
            self.publisher.submit(Publication(version, lambda: self.announce_gpu(version, source)))
            return
        snap = await asyncio.to_thread(self.driver, "weights_snapshot")
        wdir = ckpt.weights_dir(self.run_dir, version)
        if write_now:
            await asyncio.to_thread(snap.write, wdir)
        self.publisher.submit(Publication(version, lambda: self.upload(version, snap, wdir),
                                          discard=lambda: shutil.rmtree(wdir, ignore_errors=True)))

    async def upload(self, version: int, snap, wdir: Path) -> None:
        """In the background: write the file (unless written), upload it (its sha256 is computed once,
        by the transport as it reads the file), announce it, prune, open admission on it."""
        await asyncio.to_thread(snap.write, wdir)  # a no-op when written for an eval
        wv = await retry_unreachable(
            lambda: publish_version(self.js, self.run_name, version, version, wdir, self.lc.transport,
                                    shared_dir=self.lc.shared_dir or None, keep=self.lc.keep_versions,
                                    protect=self.served.versions()),
            what=f"publishing weights version {version}",
        )
        await asyncio.to_thread(ckpt.prune_weights, self.run_dir, self.lc.keep_versions)
        self.feeder.set_version(version)  # announced: tasks admitted from now on are sampled with it
        log.info("published weights version %d (%.1f MB, %s)", version, wv.bytes / 1e6, wv.transport)

    async def announce_gpu(self, version: int, source) -> None:
        """cuda_ipc / nccl: announce where actors get the packed buffer. Actors copy it on their own
        time; nothing here waits for them."""
        wv = await retry_unreachable(
            lambda: publish_gpu_version(self.js, self.run_name, version, version, source),
            what=f"announcing weights version {version}",
        )
        self.feeder.set_version(version)  # announced: tasks admitted from now on are sampled with it
        log.info("published weights version %d (%.1f MB, %s)", version, wv.bytes / 1e6, wv.transport)

    # -- the ledger -----------------------------------------------------------------------------

    def snapshot(self) -> ckpt.LearnerState:
        """The ledger as of the last checkpoint: groups trained after it count as still buffered."""
        done = dict(self.grouper.done)
        groups = list(self.grouper.buffer.values())
        in_flight = dict(self.feeder.state.in_flight)
        consumed = self.feeder.state.consumed
        for g, issued in self.uncommitted:
            done.pop(g.task_id, None)
            groups.append(g)
            if issued is not None:
                in_flight[g.task_id] = issued
                consumed -= 1
        return ckpt.LearnerState(
            step=self.ckpt_step, tag=self.tag, next_index=self.feeder.state.next_index, in_flight=sorted(in_flight),
            consumed=consumed, done=done, counters=dict(self.grouper.counters),
            groups=[ckpt.GroupState(task_id=g.task_id, first_seen=g.first_seen, completed=g.completed, samples=g.ordered())
                    for g in groups],
            issued=[ckpt.IssuedTask(task_id=t, at=i.at, version=i.version) for t, i in sorted(in_flight.items())],
            dead_seq=self.dead_seq, reasons=dict(self.reasons),
        )

    async def flush(self) -> None:
        """Write the ledger, then ack every message it now accounts for."""
        msgs, self.pending = self.pending, []
        state = self.snapshot()  # taken together with the swap above: nothing slips between them
        before = self.ledger.bytes_written
        await asyncio.to_thread(self.ledger.write, state)
        self.ledger_bytes = self.ledger.bytes_written - before
        self.last_flush = time.monotonic()
        for m in msgs:
            with contextlib.suppress(Exception):  # a lost ack means a redelivery, which is ignored as late/duplicate
                await m.ack()

    # -- reporting ------------------------------------------------------------------------------

    def metrics(self, taken: list[Taken], stats: dict) -> dict:
        from rewards.diagnostics import diagnose_groups

        groups = [t.group.ordered() for t in taken]
        diag = diagnose_groups(groups, self.cfg.scorer.clamps)
        no_signal = self.monitor.update(diag)
        totals = [s.total for g in groups for s in g]
        hist = Counter(str(t.staleness) for t in taken)
        mean = sum(totals) / len(totals)
        return {
            "version": self.step,
            **stats,
            "reward_mean": mean,
            "reward_std": (sum((x - mean) ** 2 for x in totals) / len(totals)) ** 0.5,
            "reward_terms": {k: {"mean": v.mean, "within_group_std": v.within_group_std, "corr_with_total": v.corr_with_total}
                             for k, v in diag.items()},
            "no_signal_terms": no_signal,
            "staleness_hist": dict(hist),
            "groups_corrected": sum(t.correct for t in taken),
            "groups": dict(self.grouper.counters),
            "buffered_groups": len(self.grouper.buffer),
            "feeder": {"in_flight": len(self.feeder.state.in_flight), "consumed": self.feeder.state.consumed,
                       "next_index": self.feeder.state.next_index, "paused": int(self.feeder.paused)},
        }

    def trained_entry(self, taken: list[Taken]) -> dict:
        return {
            "version": self.step,
            "traj_ids": [s.traj_id for t in taken for s in t.group.ordered()],
            "tasks": [t.group.task_id for t in taken],
            "corrected": [t.group.task_id for t in taken if t.correct],
            "not_trained": {o.task_id: o.reason for o in self.since_step},
        }

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            role="learner", id=self.id, state=self.state_name, version=self.step,
            counters={
                "step": float(self.step), "buffered_groups": float(len(self.grouper.buffer)),
                "pending_acks": float(len(self.pending)), "in_flight": float(len(self.feeder.state.in_flight)),
                "ledger.bytes_written": float(self.ledger.bytes_written), "ledger.last_write_bytes": float(self.ledger_bytes),
                "ledger.compactions": float(self.ledger.compactions),
                "weights.publishing": float(self.publisher.running is not None),
                "weights.waiting": float(self.publisher.waiting is not None),
                **{f"weights.{k}": float(v) for k, v in self.publisher.counters.items()},
                **{k: float(v) for k, v in self.grouper.counters.items()},
                **{k: float(v) for k, v in self.counters.items()},
                **{k: float(v) for k, v in COUNTERS.items()},
                **self.live,
                **{f"backlog.{k}": v for k, v in self.backlog.items()},
                **(self.evals.counters() if self.evals is not None else {}),
            },
        )


def live_counters(metrics: dict) -> dict[str, float]:
    """What the live view shows of a step: each reward term's mean and within-group std, staleness."""
    out = {"reward.total": float(metrics.get("reward_mean", 0.0))}
    for term, st in (metrics.get("reward_terms") or {}).items():
        out[f"reward.{term}"] = float(st["mean"])
        out[f"reward.{term}.group_std"] = float(st["within_group_std"])
    for term in metrics.get("no_signal_terms") or []:
        out[f"reward.{term}.NO_SIGNAL"] = 1.0
    hist = metrics.get("staleness_hist") or {}
    if hist:
        n = sum(hist.values())
        out["staleness.mean"] = sum(int(k) * v for k, v in hist.items()) / n
        out["staleness.max"] = float(max(int(k) for k in hist))
    return out


def policy_limits(model_dir) -> tuple[int, int | None]:
    """(rows of the policy's embedding, its positions or None) from config.json: vocab_size, the
    token ids it can take, and max_position_embeddings, the longest sequence it can be trained on."""
    path = Path(model_dir) / "config.json"
    conf = json.loads(path.read_text())
    conf = conf if "vocab_size" in conf else conf.get("text_config", {})  # multimodal configs nest the text model
    size, positions = conf.get("vocab_size"), conf.get("max_position_embeddings")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{path} has no vocab_size; the learner needs it to refuse token ids outside the vocabulary")
    return size, positions if isinstance(positions, int) and positions > 0 else None


async def main(stop: asyncio.Event, cfg: RunConfig, resume: bool) -> int:
    """`parley learner` on rank 0 (and the only rank on CPU); 0 after cfg.learner.steps steps."""
    from engines.models import ensure_model
    from learner.ranks import Driver
    from learner.trainer import Trainer
    from protocol.connect import connect

    nc = await connect(cfg.nats.url, name="parley-learner", first_timeout=cfg.nats.connect_timeout_s,
                       creds=cfg.nats.creds or None, ca_file=cfg.nats.ca_file or None)
    js = nc.jetstream()
    driver = None
    try:
        await topology.ensure_topology(js, cfg.run.name, cfg.bus)
        model_dir = await asyncio.to_thread(ensure_model, cfg.policy.model)
        trainer = await asyncio.to_thread(Trainer, cfg.learner, model_dir, reference=cfg.policy.reference)
        driver = Driver(trainer)
        try:
            learner = Learner(cfg, js, nc, driver, model_dir=model_dir, resume=resume, steps=cfg.learner.steps)
        except (LearnerStateError, ckpt.LedgerError) as e:
            log.error("%s", e)
            return 2
        return await learner.run(stop)
    finally:
        if driver is not None:
            driver("stop")
        with contextlib.suppress(Exception):
            await nc.drain()


def follower(cfg: RunConfig) -> None:
    """Ranks > 0 under the deepspeed launcher / torchrun: build the same trainer, replay rank 0's calls."""
    from engines.models import ensure_model
    from learner.trainer import Trainer
    from learner.ranks import follow

    follow(Trainer(cfg.learner, ensure_model(cfg.policy.model), reference=cfg.policy.reference))


def check_leakage(cfg: RunConfig) -> str | None:
    """Refuse, before any work, to train on reference targets the eval split also scores against:
    the reason as one line, or None when the split is clean (or the overlap is allowed and recorded)."""
    from evaluation.leakage import LeakageError, guard_environment

    try:
        env = cfg.env.load()
        train, held = env.tasks.train_eval(cfg.data)
        guard_environment(env.tasks, train, held, cfg.data.allow_overlap, cfg.run_dir)
    except (LeakageError, FileNotFoundError, ValueError) as e:
        return str(e)
    return None


def run(cfg: RunConfig, resume: bool, rank: int = 0) -> int:
    """`parley learner`'s entry on every rank: the leakage guard, then rank 0 serves the run and the
    other ranks follow its training calls. Returns the exit code."""
    problem = check_leakage(cfg)
    if problem:
        print(f"parley learner: {problem}", file=sys.stderr)
        return 2
    if rank:
        follower(cfg)
        return 0
    from runtime.process import run_async

    return run_async(main, cfg, resume)
