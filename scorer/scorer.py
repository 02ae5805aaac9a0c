"""`parley scorer`: pulls trajectories from TRAJ, has the judge service score them, stores Scored in SCORED.
With [policy] reference = "service" it also asks the reference service for each trajectory's
reference log-probs (services/reference/client.py) and puts them into the Scored. With [scorer] audit_fraction a
share of trajectories is judged a second time (Scored.audit) and the judge's agreement, tie share and
drift across policy versions go into the heartbeat (rewards.reliability), flagged when agreement is low.

Replicas share the durable consumer "scorer", so N scorers split the work; a trajectory is acked
only after its Scored is stored. While the judge is unreachable it waits (held, kept alive); when
the judge fails on it, it is nak'ed with back-off and dead-lettered after max_deliver deliveries.
Started by deploy/cli_scorer.py (and `parley up`); the scoring itself is rollout/score.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

import msgspec

from parley.config.run import RunConfig
from parley.config.scorer import ScorerConfig
from parley.environments.base import JudgeMetric, Reward
from parley.protocol import bus, status, topology
from parley.protocol.messages import ABANDONED_STALE, Heartbeat, Scored, Trajectory
from parley.rewards.reliability import JudgeReliability, audited
from parley.rollout.score import Unscorable, _all, score_trajectory, scorer_reward
from parley.runtime.process import Stopped, unless_stopped
from parley.services.judge.client import Judge, JudgeFailed, JudgeUnavailable
from parley.services.reference.client import ReferenceClient, ReferenceFailed, ReferenceUnavailable

log = logging.getLogger(__name__)

# A second verdict's seed is the first's shifted by this: never a seed the first or its retries use.
AUDIT_SEED_SHIFT = 1_000_003


class Scorer:
    """One scorer replica: the PullWorker handler plus its counters and heartbeat."""

    def __init__(
        self,
        nc,
        run: str,
        judge: Judge | None,
        cfg: ScorerConfig,
        bus_settings: topology.BusSettings,
        ident: str,
        reward: Reward | None = None,
        reference: ReferenceClient | None = None,
        audit_judge: Judge | None = None,
    ):
        self.nc, self.js = nc, nc.jetstream()
        self.run, self.judge, self.cfg, self.bus, self.ident = run, judge, cfg, bus_settings, ident
        self.reward = (
            reward  # the environment's; None = the reward the [scorer] settings describe (rollout.score.scorer_reward)
        )
        self.reference = reference  # [policy] reference = "service": ask it for every trajectory
        # [scorer] audit_fraction: who gives the second verdicts (default: the judge itself, at another seed)
        self.audit_judge = audit_judge or judge
        judge_metrics = [m.name for m in (reward or scorer_reward(cfg)).metrics if isinstance(m, JudgeMetric)]
        self.reliability = JudgeReliability(
            judge_metrics,
            tolerance=cfg.audit_tolerance,
            min_agreement=cfg.audit_min_agreement,
            window=cfg.audit_window,
            min_samples=cfg.audit_min_samples,
            name=ident,
        )
        self.counters: Counter[str] = Counter()
        self.in_flight = 0
        self._stop = asyncio.Event()  # set by run_until's stop

    async def handle(self, traj: Trajectory, msg) -> None:
        delivered = msg.metadata.num_delivered
        self.in_flight += 1
        try:
            # Judging (and waiting for the judge) can outlast ack_wait; in_progress keeps it ours.
            async with bus.keep_alive(msg, every=max(0.5, self.bus.ack_wait_s / 3)):
                try:
                    scored = await self._unless_stopping(self._score(traj, delivered))
                except JudgeFailed as e:
                    self.counters["judge_retry"] += 1
                    raise bus.Retry(f"JudgeFailed: {e}", delay=self.cfg.retry_delay(delivered)) from None
                except ReferenceFailed as e:
                    self.counters["reference_retry"] += 1
                    raise bus.Retry(f"ReferenceFailed: {e}", delay=self.cfg.retry_delay(delivered)) from None
                except Unscorable as e:
                    self.counters["unscorable"] += 1
                    raise bus.Poison(str(e)) from None
                ack = await bus.publish(self.js, self.run, "scored", scored)
        finally:
            self.in_flight -= 1
        # Stored (or already stored by an earlier delivery: same Msg-Id) - only now is the work done.
        await msg.ack()
        self.counters["duplicate" if ack.duplicate else "scored"] += 1
        if not ack.duplicate and scored.metrics:
            version = max((t.version for t in traj.turns), default=-1)
            self.reliability.observe(traj.task_id, version, scored.metrics, scored.audit_metrics or None)
        log.info(
            "scored %s: total %.4f %s (%.1fs)",
            traj.traj_id,
            scored.total,
            {k: round(v, 4) for k, v in scored.metrics.items()},
            scored.timings.get("total", 0.0),
        )

    async def _unless_stopping(self, coro):
        """Await `coro`, but on shutdown give the message back at once (nak, no delay) instead of
        holding it through a long judge call or wait: another replica can take it now."""
        try:
            return await unless_stopped(coro, self._stop)
        except Stopped:
            raise bus.Retry("scorer stopping; handed back", delay=0.0) from None

    async def _score(self, traj: Trajectory, delivered: int):
        """score_trajectory and, with a reference client, the trajectory's reference log-probs
        (asked at the same time), each waited for here while its service is unreachable."""
        if traj.terminated == ABANDONED_STALE:
            # stopped by its actor because the learner can no longer train its group: nothing to judge
            # (the learner drops the group as stale), and a judge call or reference pass would be wasted
            self.counters["abandoned_stale"] += 1
            return Scored(
                traj_id=traj.traj_id,
                task_id=traj.task_id,
                sample=traj.sample,
                run=traj.run,
                metrics={},
                weights={},
                total=0.0,
                trajectory=traj,
                scorer=self.ident,
                created=time.time(),
            )
        # A redelivery asks the judge with other seeds (its own retries add 0, 1, 2 ...), so a
        # verdict that failed to parse is not reproduced exactly.
        seed = (traj.seed + 1000 * (delivered - 1)) % 2**31
        judged = self._waiting(
            "judge",
            traj,
            delivered,
            lambda: score_trajectory(traj, self.judge, self.cfg, reward=self.reward, scorer=self.ident, seed=seed),
        )

        async def reference() -> tuple[bytes, float]:
            t0 = time.perf_counter()
            packed = await self._waiting("reference", traj, delivered, lambda: self.reference.logprobs(traj))
            return packed, time.perf_counter() - t0

        parts = {"scored": judged}
        if self.reference is not None:
            parts["reference"] = reference()
        if self.reliability.metrics and audited(traj.traj_id, self.cfg.audit_fraction):
            parts["audit"] = self._second_verdict(traj, seed)
        done = dict(zip(parts, await _all(*parts.values())))
        scored = done["scored"]
        if "reference" in done:
            ref, ref_s = done["reference"]
            scored = msgspec.structs.replace(scored, ref_logp_f32=ref, timings={**scored.timings, "reference": ref_s})
        if (second := done.get("audit")) is not None:
            kept = {m: v for m, v in second.metrics.items() if m in self.reliability.metrics}
            scored = msgspec.structs.replace(scored, audit=second.judge, audit_metrics=kept)
        return scored

    async def _second_verdict(self, traj: Trajectory, seed: int) -> Scored | None:
        """The audit's verdict on `traj` ([scorer] audit_fraction), or None when it could not be had:
        an audit never holds up, fails or retries the trajectory's own scoring."""
        try:
            return await score_trajectory(
                traj,
                self.audit_judge,
                self.cfg,
                reward=self.reward,
                scorer=self.ident,
                seed=(seed + AUDIT_SEED_SHIFT) % 2**31,
            )
        except (JudgeUnavailable, JudgeFailed, Unscorable) as e:
            self.counters["judge_audit.failed"] += 1
            log.info("%s: no second verdict on %s: %s", self.ident, traj.traj_id, e)
            return None

    async def _waiting(self, what: str, traj: Trajectory, delivered: int, call):
        """`await call()`, asked again while its service is unreachable (JudgeUnavailable,
        ReferenceUnavailable).

        An outage is not the trajectory's fault, so it does not spend its deliveries: we hold the
        message (kept alive) and ask again with back-off, which also stops this replica fetching
        more. Only after judge_wait_s is it nak'ed (bus.Retry), to be tried again later.
        """
        waited, attempt = 0.0, 0
        while True:
            try:
                return await call()
            except (JudgeUnavailable, ReferenceUnavailable) as e:
                attempt += 1
                if waited >= self.cfg.judge_wait_s:
                    self.counters[f"{what}_retry"] += 1
                    raise bus.Retry(
                        f"{type(e).__name__} for {waited:.1f}s: {e}", delay=self.cfg.retry_delay(delivered)
                    ) from None
                delay = self.cfg.retry_delay(attempt)
                self.counters[f"{what}_wait"] += 1
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("%s: %s; %s waits (%.0fs so far)", self.ident, e, traj.traj_id, waited)
                await asyncio.sleep(delay)
                waited += delay

    def heartbeat(self) -> Heartbeat:
        counters = {k: float(v) for k, v in (self.counters + bus.COUNTERS).items()}
        counters["in_flight"] = float(self.in_flight)
        counters |= self.reliability.counters()
        budget = getattr(self.judge, "budget", None)  # services.budget.BudgetedJudge: the run's judge-call limits
        if budget is not None:
            counters |= budget.counters()
        return Heartbeat(role="scorer", id=self.ident, state="busy" if self.in_flight else "ready", counters=counters)

    async def run_until(self, stop: asyncio.Event, *, fetch_timeout: float = 2.0) -> None:
        self._stop = stop
        worker = bus.PullWorker(
            self.js,
            self.run,
            "traj",
            self.handle,
            bus=self.bus,
            name=self.ident,
            concurrency=self.cfg.concurrency,
            fetch_timeout=fetch_timeout,
        )
        beats = asyncio.create_task(status.heartbeat_loop(self.nc, self.run, self.heartbeat, stop))
        control = None
        if (budget := getattr(self.judge, "budget", None)) is not None:
            # the operator's changes to the run's judge-call limits (`parley auth budget`), this scorer's share
            from parley.services.budget import follow_updates

            control = await follow_updates(self.nc, self.run, "judge", budget)
        try:
            await worker.run_until(stop)
        finally:
            if control is not None:
                with contextlib.suppress(Exception):  # a connection already closed has no subscription left
                    await control.unsubscribe()
            await status.send(self.nc, self.run, Heartbeat(role="scorer", id=self.ident, state="stopping"))
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats


async def main(stop: asyncio.Event, cfg: RunConfig, ident: str) -> int:
    """`parley scorer`: connect, make sure the run's topology exists, score until SIGINT/SIGTERM."""
    from parley.runtime.role import role_connection
    from parley.services.judge.client import JudgeClient

    async with role_connection(cfg.nats, name=f"parley-{ident}", run=cfg.run.name, bus=cfg.bus, topology=True) as (
        nc,
        _,
    ):
        env = cfg.env.load()
        # an environment without judge metrics never asks the judge, so it gets no client (and needs no service)
        judge = (
            JudgeClient(nc, timeout=cfg.scorer.judge_timeout_s, concurrency=cfg.scorer.judge_concurrency)
            if env.needs_judge
            else None
        )
        # second verdicts: the same judge service, sampled ([scorer] audit_temperature) at another seed
        audit_judge = None
        if judge is not None and cfg.scorer.audit_fraction > 0:
            audit_judge = JudgeClient(
                nc,
                timeout=cfg.scorer.judge_timeout_s,
                concurrency=cfg.scorer.judge_concurrency,
                temperature=cfg.scorer.audit_temperature,
            )
        if judge is not None:
            # this scorer's share of the run's judge-call limits (second verdicts count too): calls past it wait
            from parley.services.budget import BudgetedJudge, CallBudget

            ro, scorers = cfg.rollout, cfg.up.scorers
            budget = CallBudget.of_run("judge_budget", ro.judge_call_budget, ro.judge_calls_per_s, scorers)
            judge = BudgetedJudge(judge, budget)
            audit_judge = BudgetedJudge(audit_judge, budget) if audit_judge is not None else None
        # The learner's setting decides (one place for the fact): it trains on what we put in ref_logp_f32.
        reference = None
        if cfg.policy.reference == "service":
            reference = ReferenceClient(
                nc, model=cfg.policy.model, timeout=cfg.scorer.reference_timeout_s, concurrency=cfg.scorer.concurrency
            )
        log.info(
            "%s: scoring run %s, environment %s (concurrency %d, weights %s, judge ops %s%s)",
            ident,
            cfg.run.name,
            env.name,
            cfg.scorer.concurrency,
            cfg.scorer.weights,
            list(env.reward.judge_ops) or "none",
            f", reference log-probs of {cfg.policy.model}" if reference else "",
        )
        if audit_judge is not None:
            log.info(
                "%s: second verdicts on %.0f%% of trajectories at temperature %g; flagged below %.2f agreement",
                ident,
                100 * cfg.scorer.audit_fraction,
                cfg.scorer.audit_temperature,
                cfg.scorer.audit_min_agreement,
            )
        await Scorer(
            nc,
            cfg.run.name,
            judge,
            cfg.scorer,
            cfg.bus,
            ident,
            reward=env.reward,
            reference=reference,
            audit_judge=audit_judge,
        ).run_until(stop)
    return 0


def run(cfg: RunConfig, ident: str) -> int:
    """`parley scorer`'s entry: score trajectories until SIGINT/SIGTERM; returns the exit code."""
    from parley.runtime.process import run_async

    return run_async(main, cfg, ident)
