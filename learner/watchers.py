"""What the learner watches beside its steps: the fates of issued tasks (`Fates`: the DEAD stream and
the task deadline), the streams' backlog (`Backlog`), and the periodic eval (`Evals`: when a version
is due, whether it regressed). Built by learner.service; its loop and learner.stepper call them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine

from nats.js.errors import APIError

from parley.learner import checkpoint as ckpt
from parley.learner.feeder import Feeder
from parley.learner.groups import Grouper, Outcome
from parley.learner.intake import FOREIGN, Intake
from parley.learner.runstate import RunState
from parley.protocol import backlog, dead
from parley.protocol.bus import UNREACHABLE

log = logging.getLogger(__name__)

EARLY_KEPT = 4096  # letters kept for tasks not in flight yet (the oldest go first beyond it)


class Fates:
    """An issued task that never becomes a complete group (its Task, or one of its samples, was
    dead-lettered; it was lost some other way) would hold its admission slot for good, and
    max_staleness x groups_per_step + 1 of them stop admission. The DEAD stream tells most such
    fates at once; task_deadline_s catches the rest. Reads from and advances `state.dead_seq`."""

    def __init__(
        self,
        state: RunState,
        js,
        run_name: str,
        grouper: Grouper,
        feeder: Feeder,
        intake: Intake,
        *,
        task_deadline_s: float,
    ):
        self.state, self.js, self.run_name = state, js, run_name
        self.grouper, self.feeder, self.intake = grouper, feeder, intake
        self.task_deadline_s = task_deadline_s
        self.next_seq = state.dead_seq  # the next DEAD sequence to read
        # Letters about a task of this run that is not in flight yet, by stream sequence: a Task the
        # feeder published but had not recorded when its letter was read (the feeder records after the
        # publish; after a resume it issues again what the ledger had not recorded). Applied when the
        # task is issued; state.dead_seq stays at the oldest of them, so a resume reads them again.
        self.early: dict[int, tuple[float, object]] = {}

    async def watch_dead(self, halt: asyncio.Event, every: float = 2.0) -> None:
        """Read the run's dead letters as they come (from the ledger's dead_seq on a resume)."""
        failing = False
        while not halt.is_set():
            try:
                letters, nxt = await dead.read_since(self.js, self.run_name, self.next_seq)
            except (*UNREACHABLE, APIError) as e:
                if not failing:
                    log.warning(
                        "cannot read the DEAD stream (%s: %s): NATS away, or this user may not read it "
                        "(deploy/permissions.py); retrying, task_deadline_s=%g is the backstop meanwhile",
                        type(e).__name__,
                        e,
                        self.task_deadline_s,
                    )
                failing = True
            else:
                failing = False
                self.take(letters, nxt)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(halt.wait(), timeout=every)

    def take(self, letters, nxt: int) -> None:
        """Apply letters read from the DEAD stream (seq, letter), keep those about tasks not yet in
        flight, and move the read position to `nxt`."""
        now = time.monotonic()
        for seq, dl in letters:
            if dl is not None and self.on_dead(dl) == "early":
                self.early[seq] = (now, dl)
        self.next_seq = nxt
        self._settle(now)

    def _settle(self, now: float) -> None:
        """Apply the kept letters whose task is in flight now; forget those whose task finished, and
        those kept longer than the task deadline (never issued: the deadline would have freed it)."""
        for seq, (seen, dl) in sorted(self.early.items()):
            fate = self.on_dead(dl)
            if fate != "early" or now - seen > self.task_deadline_s or len(self.early) > EARLY_KEPT:
                del self.early[seq]
        # after applying them: a ledger never skips a letter it did not act on
        self.state.dead_seq = min(self.early, default=self.next_seq)

    def on_dead(self, dl) -> str:
        """Act on one letter: "applied" (its task's group is given up or its lost sample recorded),
        "early" (about a task of this run not in flight yet, and not finished), or "ignored"."""
        ref = dead.task_ref(self.run_name, dl)
        if ref is None or ref.task_id in self.grouper.done:
            return "ignored"  # not about a task of this run, or about one already finished
        if ref.key == "scored" and dl.reason.startswith(FOREIGN):
            # the intake refused it because its task was not issued: were it kept as "early", a
            # forged sample of a task id the feeder issues later would give that task up
            return "ignored"
        if ref.task_id not in self.feeder.state.in_flight:
            return "early"
        if ref.sample is not None and not 0 <= ref.sample < self.grouper.n:
            return "ignored"  # a sample no group has (refused for its index): no real sample of the task is lost
        what = "its Task" if ref.sample is None else f"sample {ref.sample}"
        reason = f"dead: {what} was dead-lettered by {dl.consumer} ({ref.key}): {dl.reason}"
        outcome = self.grouper.abandon(ref.task_id, "dead", reason, sample=ref.sample)
        if outcome is not None:
            self.state.since_step += self.intake.consume([outcome])
        return "applied"

    def overdue(self) -> list[Outcome]:
        if self.early:  # a task issued since its letter was read
            self._settle(time.monotonic())
        out = []
        for task, age in self.feeder.overdue(self.task_deadline_s):
            g = self.grouper.buffer.get(task)
            reason = (
                f"deadline: {len(g.samples) if g else 0}/{self.grouper.n} samples {age:.0f}s after it was "
                f"issued (task_deadline_s={self.task_deadline_s:g})"
            )
            # None while its complete group waits for a step or is being trained: that is progress.
            outcome = self.grouper.abandon(task, "deadline", reason)
            if outcome is not None:
                out.append(outcome)
        return out


class Backlog:
    """The share of each stream's max_bytes its unconsumed messages fill (protocol.backlog), for the
    heartbeat, and a warning when one nears the limit; and the TASKS consumer's counts (`tasks`), the
    signal actors scale on (KEDA in deploy/k8s/keda/actor-scaledobject.yaml, `parley up --actors auto`)."""

    def __init__(self, js, run_name: str):
        self.js, self.run_name = js, run_name
        self.shares: dict[str, float] = {}  # channel -> share of its max_bytes unconsumed
        self.tasks: dict[str, float] = {}  # waiting (no actor took it), playing (held), unplayed (both)

    async def watch(self, halt: asyncio.Event, every: float = 5.0) -> None:
        while not halt.is_set():
            await self.check()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(halt.wait(), timeout=every)

    async def check(self) -> None:
        """Warn (once per crossing) when a channel's unconsumed messages near its stream's limit:
        past it the stream drops its oldest messages unread."""
        try:
            now = await backlog.consumers(self.js, self.run_name)
        except (*UNREACHABLE, APIError) as e:
            log.debug("backlog check skipped (%s: %s)", type(e).__name__, e)
            return
        if "tasks" in now:
            t = now["tasks"]
            self.tasks = {
                "waiting": float(t.waiting),
                "playing": float(t.in_progress),
                "unplayed": float(t.waiting + t.in_progress),
            }
        for key, c in now.items():
            share, max_bytes = c.share, c.max_bytes
            was = self.shares.get(key, 0.0)
            if share >= backlog.WARN_SHARE > was:
                log.warning("%s", backlog.warning(key, share, max_bytes))
            elif was >= backlog.WARN_SHARE > share:
                log.info("stream %s: unconsumed messages back to %.0f%% of max_bytes", key, 100 * share)
            self.shares[key] = share


class Evals:
    """The periodic eval (evaluation.periodic) as the training loop sees it: which versions are due,
    the early-stop verdict, the wait for queued evals at the end. With eval_every = 0 it does nothing."""

    def __init__(self, cfg, run_dir, launch=None):
        self.periodic = None
        if cfg.learner.eval_every > 0:
            from parley.evaluation.periodic import PeriodicEval

            self.periodic = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=launch)

    @property
    def on(self) -> bool:
        return self.periodic is not None

    async def start(self) -> None:
        """Start the eval child before the first version (it opens its engine meanwhile)."""
        if self.on:
            await self.periodic.start()

    async def close(self) -> None:
        """End the eval child: a learner that stops before its loop runs (whose task would)."""
        if self.on:
            await self.periodic.close()

    def tasks(self, halt: asyncio.Event) -> dict[str, Coroutine]:
        """The background tasks to run beside training, by name."""
        return {"periodic-eval": self.periodic.run(halt)} if self.on else {}

    def due(self, step: int, last: bool) -> bool:
        return self.on and self.periodic.due(step, last=last)

    async def submit(self, step: int, write=None) -> None:
        """Queue `step`'s version (its weights are exported now, or behind training with `write`:
        PeriodicEval.submit)."""
        await self.periodic.submit(step, step, write)

    def requeue_unfinished(self, step: int) -> list[int]:
        """At the start: the versions up to `step` an earlier learner queued and did not finish, queued again."""
        return self.periodic.requeue_unfinished(step) if self.on else []

    def regression(self) -> str:
        """Why training should stop early; "" while it should not."""
        return self.periodic.regression if self.on else ""

    async def drain(self, wait_s: float, stop: asyncio.Event) -> None:
        await self.periodic.drain(wait_s, stop)

    def counters(self) -> dict[str, float]:
        return self.periodic.counters() if self.on else {}

    def finished(self) -> list[tuple[int, dict[str, float]]]:
        """(version, its means) of every eval finished so far."""
        return [(o.version, o.means) for o in self.periodic.outcomes if o.ok] if self.on else []
