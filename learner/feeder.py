"""The task feeder: publishes one Task per GRPO group from the training split, in a fixed order,
while the staleness gate is open. Run by learner.service beside the grouping consumer; the
service tells it which issued tasks are finished (trained, or given up with a reason) and which
version the learner has announced to the actors.

Task ids are f"{run}-g{index:06d}". A feeder records a task after the store acknowledged it, so the
ledger may lag the TASKS stream (a learner killed before its first ledger write has recorded none):
before issuing, a resumed feeder adopts the tasks the stream holds past its recorded index
(`adopt_published`) instead of publishing them again, which Msg-Id would deduplicate only within the
duplicate window. A fresh start (no --resume) adopts nothing: the run's streams are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field

from parley.environments.base import TaskBuilder
from parley.protocol import codec, topology
from parley.protocol.bus import Repeated, publish, retry_unreachable
from parley.protocol.messages import Task
from parley.tasks.data import task_from_item

log = logging.getLogger(__name__)


def admission_limit(version: int, max_staleness: int, groups_per_step: int) -> int:
    """The most groups that may have been issued (in flight + consumed) while the learner is at
    `version`: (version + max_staleness + 1) x groups_per_step.

    Groups are trained in issue order, groups_per_step per step, so the group issued last under
    this bound is trained by step version + max_staleness + 1, i.e. by a learner at most
    max_staleness versions ahead of the policy that was current when it was issued.
    """
    return (version + max_staleness + 1) * groups_per_step


def may_admit(
    in_flight: int, consumed: int, version: int, max_staleness: int, groups_per_step: int, oversample: int = 0
) -> bool:
    """The staleness gate: one more group may be issued if the count stays within the limit (plus
    `oversample` groups beyond it, [learner] oversample_groups), i.e. in_flight + consumed <= limit
    + oversample holds after admitting it."""
    return in_flight + consumed + 1 <= admission_limit(version, max_staleness, groups_per_step) + oversample


def task_id(run: str, index: int) -> str:
    return f"{run}-g{index:06d}"


def item_order(n_items: int, index: int, seed: int) -> int:
    """Which training item the index-th task uses: every epoch is a fresh seeded permutation."""
    epoch, pos = divmod(index, n_items)
    perm = list(range(n_items))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return perm[pos]


@dataclass(frozen=True)
class Issued:
    """When a task was issued and at which announced version (its Task.admitted_version)."""

    # time.monotonic() at issue: the deadline is not moved by a wall clock that jumps; the ledger keeps
    # it as wall-clock time, so a resumed learner keeps counting the task's deadline (learner.intake)
    at: float
    version: int


@dataclass
class FeederState:
    """What the checkpoint keeps of the feeder."""

    next_index: int = 0
    in_flight: dict[str, Issued] = field(default_factory=dict)  # issued tasks whose group is not yet finished
    consumed: int = 0  # issued groups trained (a dropped or skipped group gives its slot back)


class Feeder:
    """Publishes tasks while `may_admit` holds; `mark_consumed` and `set_version` reopen the gate.

    `version` is the version the actors have been told to serve (set after publication succeeded),
    not the trainer's step: a task admitted "at v" is then sampled with v or newer, so the gate's
    staleness bound holds for the policy that actually generates it.
    """

    def __init__(
        self,
        js,
        run: str,
        items: list,
        rollout,
        *,
        max_staleness: int,
        groups_per_step: int,
        seed: int = 0,
        state: FeederState | None = None,
        build: TaskBuilder = task_from_item,
        steps: int = 0,
        oversample: int = 0,
    ):
        if not items:
            raise ValueError("the training split is empty; check [data] path and eval_fraction")
        self.js, self.run_name, self.items, self.rollout = js, run, items, rollout
        self.build = build  # the run environment's task builder (env.tasks.task); CollabLLM's by default
        self.max_staleness, self.groups_per_step, self.seed = max_staleness, groups_per_step, seed
        # groups beyond the gate's limit ([learner] oversample_groups): they replace skipped groups at
        # once; one that comes back when none was skipped is trained too late and dropped as stale
        self.oversample = oversample
        # A run of `steps` steps trains steps x groups_per_step groups: never more in flight + consumed
        # than that (a dropped group gives its slot back), so no rollouts are played that no step will
        # train, competing with the last steps and the final eval for the cores. 0 = no last step.
        self.total_groups = steps * groups_per_step
        self.state = state or FeederState()
        self.version = 0
        self.paused = False
        # the task being published: in flight for the intake already (learner.intake.Intake.foreign),
        # since its samples could in principle come back before the store's acknowledgement does
        self.publishing = ""
        self._wake = asyncio.Event()

    def task(self, index: int) -> Task:
        item = self.items[item_order(len(self.items), index, self.seed)]
        return self.build(
            item,
            run=self.run_name,
            task_id=task_id(self.run_name, index),
            n=self.rollout.n,
            rollout=self.rollout,
            seed=self.seed * 1_000_003 + index,
            version=self.version,
        )

    async def adopt_published(self) -> int:
        """Take the tasks of this run that the TASKS stream holds at or past `next_index` (published by
        an earlier learner whose ledger never recorded them) as in flight, their deadlines counted
        from now, and move `next_index` past them. Reads the stream from its end back to the first
        task below `next_index` (tasks are stored in index order). The number adopted."""
        from nats.js.errors import NotFoundError

        s = self.state
        pattern = re.compile(re.escape(self.run_name) + r"-g(\d+)")
        name = topology.stream_name(self.run_name, "tasks")
        info = (await self.js.stream_info(name)).state
        found: dict[int, Task] = {}
        seq = info.last_seq
        while seq >= max(info.first_seq, 1):
            try:
                raw = await self.js.get_msg(name, seq)
            except NotFoundError:  # aged out or deleted meanwhile
                seq -= 1
                continue
            seq -= 1
            try:
                task = codec.decode("tasks", raw.data)
            except Exception:  # noqa: BLE001 - a damaged message is the actors' to dead-letter
                continue
            m = pattern.fullmatch(task.task_id)
            if m is None or task.run != self.run_name:
                continue
            index = int(m.group(1))
            if index < s.next_index:
                break
            found[index] = task
        now = time.monotonic()
        for index, task in sorted(found.items()):
            if task.task_id not in s.in_flight:
                s.in_flight[task.task_id] = Issued(at=now, version=task.admitted_version)
        if found:
            s.next_index = max(found) + 1
            log.info(
                "adopted %d tasks the TASKS stream held past the recorded index (%s..%s); issuing from %d",
                len(found),
                task_id(self.run_name, min(found)),
                task_id(self.run_name, max(found)),
                s.next_index,
            )
        return len(found)

    def issued(self, task: str) -> bool:
        """Whether `task` was issued by this feeder and is not finished (or is being published now)."""
        return task in self.state.in_flight or task == self.publishing

    def all_issued(self) -> bool:
        """Every group the run's last step needs is in flight or trained."""
        return bool(self.total_groups) and len(self.state.in_flight) + self.state.consumed >= self.total_groups

    def is_open(self) -> bool:
        s = self.state
        return not self.all_issued() and may_admit(
            len(s.in_flight), s.consumed, self.version, self.max_staleness, self.groups_per_step, self.oversample
        )

    def mark_consumed(self, task: str, trained: bool = True) -> Issued | None:
        """A group left the learner: its issue record, or None if we did not issue it.

        Only trained groups count as consumed: the version moves with them. A dropped (stale,
        timed out, dead-lettered, past its deadline) or skipped (zero advantage) group just leaves
        the in-flight set, so its slot is refilled; counting it would shrink the admission window for good and, after
        max_staleness x groups_per_step + 1 losses, stop admission altogether.
        """
        issued = self.state.in_flight.pop(task, None)
        if issued is None:
            return None
        if trained:
            self.state.consumed += 1
        self._wake.set()
        return issued

    def overdue(self, deadline_s: float, now: float | None = None) -> list[tuple[str, float]]:
        """Issued tasks older than `deadline_s` (by time.monotonic()), oldest first, with their age in seconds."""
        now = time.monotonic() if now is None else now
        late = [(t, now - i.at) for t, i in self.state.in_flight.items() if now - i.at > deadline_s]
        return sorted(late, key=lambda x: -x[1])

    def set_version(self, version: int) -> None:
        """The actors have been told to serve `version` (publication succeeded): admit on it."""
        self.version = version
        self._wake.set()

    def wake(self) -> None:
        """Re-check the gate (and the stop event) now."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        s = self.state
        while not stop.is_set():
            if self.is_open():
                if self.paused:
                    log.info(
                        "admission resumed: version %d, %d in flight, %d consumed",
                        self.version,
                        len(s.in_flight),
                        s.consumed,
                    )
                    self.paused = False
                task = self.task(s.next_index)
                self.publishing = task.task_id
                sends = 0

                async def send(task=task):
                    nonlocal sends
                    sends += 1  # a repeat after a call that failed may be that call's own message
                    return await publish(self.js, self.run_name, "tasks", task, sent_before=sends > 1, fresh=True)

                # As every role's publishes (docs/reliability.md): retried for as long as NATS is away,
                # not given up after publish's own attempts (about 100 s), which ended the learner.
                try:
                    await retry_unreachable(send, what=f"publishing task {task.task_id}", give_up_s=math.inf)
                except Repeated as e:
                    # Its id was stored before (an earlier learner of this run, or messages of the stream
                    # aged out or purged while the dedupe window remembers them): that message is not
                    # this one and may never be delivered, so counted in flight it would hold a slot until
                    # task_deadline_s. The next index is issued instead; a Scored of the old message is
                    # foreign to this learner (learner.intake).
                    log.warning("task %s not issued: %s; issuing the next index instead", task.task_id, e)
                    self.publishing = ""
                    s.next_index += 1
                    continue
                # Only after the store acknowledged it: a checkpoint never claims an unpublished task.
                s.in_flight[task.task_id] = Issued(at=time.monotonic(), version=task.admitted_version)
                self.publishing = ""
                s.next_index += 1
                continue
            if not self.paused and self.all_issued():
                log.info(
                    "admission paused: %d in flight + %d consumed = the %d groups the run's last step needs",
                    len(s.in_flight),
                    s.consumed,
                    self.total_groups,
                )
                self.paused = True
            elif not self.paused:
                limit = admission_limit(self.version, self.max_staleness, self.groups_per_step) + self.oversample
                log.info(
                    "admission paused: %d in flight + %d consumed = limit %d at version %d "
                    "(max_staleness %d, groups_per_step %d, oversample_groups %d)",
                    len(s.in_flight),
                    s.consumed,
                    limit,
                    self.version,
                    self.max_staleness,
                    self.groups_per_step,
                    self.oversample,
                )
                self.paused = True
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=5.0)
