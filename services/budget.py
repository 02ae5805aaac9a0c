"""Per-run limits on simulator and judge calls ([rollout] sim_call_budget / sim_calls_per_s,
judge_call_budget / judge_calls_per_s): a count budget and a rate limit that make callers WAIT, never
fail. The actor wraps its user side in `BudgetedUser` and stops taking new tasks while the budget is
spent (`CallBudget.wait_open`); the scorer wraps its judge in `BudgetedJudge`.

The run's budget is split evenly over the processes that spend it (`CallBudget.share`): each actor
holds budget / [up] actors of the simulator calls, each scorer budget / [up] scorers of the judge
calls, with no counter shared over the bus. An idle actor's unspent share is therefore not lent to a
busy one. A share counts from its process's start: a restarted actor or scorer holds a fresh share, so
the run stays within the budget only while no process restarts (a counter shared on the bus would need
a KV key every actor may write, which deploy/permissions.py does not grant). A spent share is reopened
by raising it (`raise_to`); the calls waiting on it then proceed.

An operator changes a running run's limits with `parley auth budget` (the admin credential): a
BudgetUpdate on the run's control subject (protocol.topology.control_subject), which only the admin user
may publish to and the actors and scorers subscribe to (`follow_updates`); each process applies its
share of the new totals at once. A process started later (or restarted) reads the config again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import msgspec

from parley.protocol import codec, topology
from parley.protocol.messages import BudgetUpdate, ChatMessage, JudgeReply, SimReply, SimRequest

log = logging.getLogger(__name__)


class CallBudget:
    """At most `budget` calls in all (0 = no count limit) and at most `per_s` calls a second
    (0 = no rate limit; a token bucket of one second's calls, so a burst after an idle spell is
    bounded too). `acquire()` waits until a call may go; it never raises for a spent budget."""

    def __init__(self, name: str, budget: int = 0, per_s: float = 0.0, *, processes: int = 1, clock=time.monotonic):
        if budget < 0 or per_s < 0:
            raise ValueError(f"{name}: budget={budget}, per_s={per_s} must be >= 0 (0 = unlimited)")
        self.name, self.budget, self.per_s, self.clock = name, budget, per_s, clock
        self.processes = processes  # how many processes share the run's limits (`update` takes this one's share)
        self.calls = 0  # calls let through
        self.waits = 0  # calls that had to wait (budget spent or rate reached)
        self.wait_s = 0.0  # seconds callers spent waiting
        self._burst = max(1.0, per_s)
        self._tokens, self._t = self._burst, clock()
        self._changed = asyncio.Event()  # set when the budget or the rate changes (waiters look again)
        self._logged_spent = False

    @classmethod
    def of_run(cls, name: str, total: int, total_per_s: float, processes: int, **kw) -> CallBudget:
        """This process's share of a run's limits, shared by `processes` processes."""
        return cls(name, cls.share(total, processes), cls.share(total_per_s, processes), processes=processes, **kw)

    @staticmethod
    def share(total: int | float, processes: int) -> int | float:
        """This process's even share of a run's `total` over `processes` (0 stays unlimited; a share
        is at least 1 call, or the slowest positive rate)."""
        if total <= 0:
            return total
        if isinstance(total, int):
            return max(1, total // max(1, processes))
        return total / max(1, processes)

    @property
    def spent(self) -> bool:
        return self.budget > 0 and self.calls >= self.budget

    def raise_to(self, budget: int) -> None:
        """A new count budget (0 = unlimited); the calls waiting on a spent one proceed if it allows."""
        self.budget = budget
        self._logged_spent = False
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def set_rate(self, per_s: float) -> None:
        """A new rate limit (0 = unlimited); calls waiting on the old rate are woken to wait on the new one."""
        self._refill()
        self.per_s, self._burst = per_s, max(1.0, per_s)
        self._tokens = min(self._tokens, self._burst)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def update(self, total: int | None = None, total_per_s: float | None = None) -> bool:
        """New run totals (an operator's BudgetUpdate; None: unchanged): this process's share of each
        applies at once. Returns whether anything changed."""
        changed = False
        if total is not None and (budget := int(self.share(total, self.processes))) != self.budget:
            self.raise_to(budget)
            changed = True
        if total_per_s is not None and (per_s := float(self.share(total_per_s, self.processes))) != self.per_s:
            self.set_rate(per_s)
            changed = True
        return changed

    async def wait_open(self) -> None:
        """Return once the count budget is not spent (the actor's gate before it takes a task)."""
        while self.spent:
            if not self._logged_spent:
                self._logged_spent = True
                log.warning("%s: call budget of %d spent; callers wait until it is raised", self.name, self.budget)
            await self._changed.wait()

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self._burst, self._tokens + (now - self._t) * self.per_s)
        self._t = now

    async def acquire(self) -> None:
        t0 = self.clock()
        waited = False
        while True:
            if self.spent:
                waited = True
                await self.wait_open()
                continue
            if self.per_s > 0:
                self._refill()
                if self._tokens < 1.0:
                    waited = True
                    # until a token is due, or the limits change (an operator's update)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), (1.0 - self._tokens) / self.per_s)
                    continue
                self._tokens -= 1.0
            break
        self.calls += 1
        if waited:
            self.waits += 1
            self.wait_s += self.clock() - t0

    def counters(self) -> dict[str, float]:
        """For a heartbeat: `<name>.calls`, `.waits`, `.wait_s`, `.left` (-1: no count limit)."""
        left = -1.0 if self.budget <= 0 else float(max(0, self.budget - self.calls))
        return {
            f"{self.name}.calls": float(self.calls),
            f"{self.name}.waits": float(self.waits),
            f"{self.name}.wait_s": round(self.wait_s, 3),
            f"{self.name}.left": left,
        }


class BudgetedUser:
    """A user side (services.sim.client.UserSide) whose calls pass `budget` first."""

    def __init__(self, user, budget: CallBudget):
        self.user, self.budget = user, budget

    @property
    def waits(self) -> int:  # the simulator client's outage waits, shown in the actor's heartbeat
        return getattr(self.user, "waits", 0)

    async def ask(self, req: SimRequest) -> SimReply:
        await self.budget.acquire()
        return await self.user.ask(req)


class BudgetedJudge:
    """A judge (services.judge.client.Judge) whose calls pass `budget` first."""

    def __init__(self, judge, budget: CallBudget):
        self.judge, self.budget = judge, budget

    async def ask(self, op: str, messages: Sequence[ChatMessage], *, seed: int = 0) -> JudgeReply:
        await self.budget.acquire()
        return await self.judge.ask(op, messages, seed=seed)


async def follow_updates(nc, run: str, kind: str, budget: CallBudget):
    """Apply every operator's BudgetUpdate for run `run` to `budget` (its `kind`: "sim" or "judge"
    fields); returns the subscription (unsubscribe to stop). The permissions let only the admin user
    publish on the subject, so whatever arrives there is the operator's."""
    if kind not in ("sim", "judge"):
        raise ValueError(f"budget kind {kind!r}: use 'sim' or 'judge'")

    async def on_update(msg) -> None:
        try:
            update: BudgetUpdate = codec.decode("control.budget", msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("%s: a budget update on %s was not understood and is ignored: %s", budget.name, msg.subject, e)
            return
        old = (budget.budget, budget.per_s)
        if budget.update(getattr(update, f"{kind}_call_budget"), getattr(update, f"{kind}_calls_per_s")):
            log.warning(
                "%s: limits changed by the operator: %d calls -> %d, %g calls/s -> %g (this process's share, one of %d)",
                budget.name,
                *(old[0], budget.budget, old[1], budget.per_s),
                budget.processes,
            )

    return await nc.subscribe(topology.control_subject(run, "budget"), cb=on_update)
