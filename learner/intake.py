"""The learner's intake and its ledger: the SCORED handler (checks, grouping), the keep-alive of held
messages, the bookkeeping of groups that leave untrained (`consume`), and the ledger write that
acks. Owns the messages not yet acked and the `Ledger`; built by learner.service, whose loop and
parts (learner.stepper, learner.watchers) call it.

Acknowledgement rule (docs/learner.md): a Scored message is acked only after a ledger write that
records it (buffered, trained at a checkpointed step, or finished otherwise), so a kill at any
moment loses no sample and trains none twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from parley.learner import checkpoint as ckpt
from parley.learner.feeder import Feeder
from parley.learner.groups import BadTrajectory, Grouper, Outcome, check_hostile_values, check_trajectory
from parley.learner.runstate import RunState
from parley.protocol import arrays
from parley.protocol.bus import Poison
from parley.protocol.messages import ABANDONED_STALE
from parley.runtime import killpoints

log = logging.getLogger(__name__)

# How the reason of a dead letter for a Scored of a task this learner did not issue begins: such a
# letter says nothing of an issued task's fate (learner.watchers.Fates ignores it).
FOREIGN = "not in flight"


class Intake:
    def __init__(
        self,
        state: RunState,
        grouper: Grouper,
        feeder: Feeder,
        ledger: ckpt.Ledger,
        *,
        limits: tuple[int, int | None],
        reference_service: bool,
        ack_wait_s: float,
        flush_s: float,
        started: float,
        accept_foreign: bool = False,
        memory_bound: tuple[int, str] | None = None,
    ):
        self.state, self.grouper, self.feeder, self.ledger = state, grouper, feeder, ledger
        # (the longest sequence the learner's memory plan holds, where that figure comes from): learner.intake.memory_bound
        self.memory_bound = memory_bound
        self.accept_foreign = accept_foreign  # [learner] accept_foreign_scored
        # token ids beyond the vocabulary and conversations beyond the positions are refused here
        self.vocab_size, self.max_positions = limits
        self.reference_service = reference_service  # Scored messages carry the reference's log-probs
        self.ack_wait_s, self.flush_s = ack_wait_s, flush_s
        self.pending: list = []  # received messages not yet covered by a ledger write
        self.unarchived: list[Outcome] = []  # groups finished untrained since the last ledger write
        self.run_dir = ledger.run_dir
        self.last_flush = started
        self.ledger_bytes = 0  # bytes the last ledger write wrote
        # the ledger's fence: learner.lease.Lease.holds of the run's lease (learner.service sets it); None: unfenced
        self.fence: Callable[[], bool] | None = None
        self.fenced = False  # the last flush found the lease stale and wrote nothing
        self._data = asyncio.Event()

    async def on_scored(self, scored, msg) -> None:
        """PullWorker handler: buffer the sample; its ack waits for the next ledger write. A sample of
        a task this learner did not issue is dead-lettered (`foreign`) unless accept_foreign."""
        why = self.foreign(scored.task_id)
        if why:
            if not self.accept_foreign:
                self.state.counters["scored.foreign"] += 1
                raise Poison(why)
            self.state.counters["scored.foreign_accepted"] += 1
        try:
            if scored.trajectory.terminated != ABANDONED_STALE:
                # what training needs; a sample its actor abandoned (no turn, maybe, and no reward or
                # reference log-probs) only drops its group as stale, never reaching the GPU
                check_trajectory(scored.trajectory)
                check_hostile_values(scored, self.vocab_size, self.max_positions, reference=self.reference_service)
                check_fits_memory(scored, self.memory_bound)
            result = self.grouper.add(scored)
        except BadTrajectory as e:
            raise Poison(str(e)) from None
        self.state.counters[f"scored.{result}"] += 1
        self.pending.append(msg)
        killpoints.reached("held")
        if result == "complete" or (result == "added" and self.grouper.doomed(scored.task_id, self.state.step)):
            self._data.set()  # a step may be taken, or a doomed group dropped (its slot freed) at once

    def foreign(self, task_id: str) -> str:
        """Why a Scored of `task_id` is not this learner's to train, or "" when it is: its task is in
        flight (issued by the feeder, restored by a resume, or adopted from the TASKS stream before
        the SCORED consumer starts: a buffered group's task is in flight until it leaves), or finished
        (then the grouper ignores it as late: a straggler or a redelivery, never trained, and not
        worth a dead letter). Anything else was never issued by this learner: a role that can write
        into SCORED would otherwise choose what is trained."""
        if self.feeder.issued(task_id) or task_id in self.grouper.done:
            return ""
        return (
            f"{FOREIGN}: task {task_id!r} was not issued by this learner of run {self.feeder.run_name!r} "
            "(not in flight, not finished), so its samples are not trained; set [learner] "
            "accept_foreign_scored = true only to train samples made elsewhere"
        )

    async def wait_for_data(self, timeout: float) -> None:
        """Until a group completes (on_scored) or `timeout` seconds pass."""
        self._data.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._data.wait(), timeout=timeout)

    async def keep_alive(self, halt: asyncio.Event) -> None:
        """Held messages must not be redelivered while a step runs: tell the server we work on them."""
        every = max(self.ack_wait_s / 3.0, 0.2)
        while not halt.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(halt.wait(), timeout=every)
            for m in list(self.pending):
                with contextlib.suppress(Exception):
                    await m.in_progress()

    def consume(self, outcomes: list[Outcome]) -> list[Outcome]:
        """Groups that leave untrained: their tasks free their admission slots, their reasons are kept."""
        for o in outcomes:
            if o.group is not None:
                self.unarchived.append(o)
            self.feeder.mark_consumed(o.task_id, trained=False)
            self.state.reasons[o.task_id] = o.reason
            self.state.counters[f"groups.{o.kind}"] += 1
        return outcomes

    # -- the ledger -----------------------------------------------------------------------------

    def snapshot(self) -> ckpt.LearnerState:
        """The ledger as of the last checkpoint: groups trained after it count as still buffered.
        Finished tasks below the watermark are not listed (learner.groups.Finished).
        The timers run on time.monotonic(), which means nothing to another process or after a
        reboot: the ledger holds them as wall-clock times against one reading of the wall clock
        (`saved`), so a resume takes back their ages (learner.resume), whatever the wall clock did
        meanwhile, and the time the learner was down does not count."""
        wall, mono = time.time(), time.monotonic()

        def stamp(t: float) -> float:  # a monotonic time as the wall-clock time of the same moment
            return wall - (mono - t)

        hold = {g.task_id for g, _ in self.state.uncommitted} | {g.task_id for g in self.state.in_step}
        self.grouper.done.advance(hold)
        done = dict(self.grouper.done)
        groups = list(self.grouper.buffer.values())
        in_flight = dict(self.feeder.state.in_flight)
        consumed = self.feeder.state.consumed
        for g, issued in self.state.uncommitted:
            done.pop(g.task_id, None)
            groups.append(g)
            if issued is not None:
                in_flight[g.task_id] = issued
                consumed -= 1
        for g in self.state.in_step:  # taken for the step under way: buffered until it is trained
            done.pop(g.task_id, None)
            groups.append(g)
        buffered = {g.task_id for g in groups}
        return ckpt.LearnerState(
            step=self.state.ckpt_step,
            tag=self.state.tag,
            next_index=self.feeder.state.next_index,
            in_flight=sorted(in_flight),
            consumed=consumed,
            done=done,
            counters=dict(self.grouper.counters),
            groups=[
                ckpt.GroupState(
                    task_id=g.task_id,
                    first_seen=stamp(g.first_seen),
                    completed=stamp(g.completed) if g.completed else 0.0,
                    samples=g.ordered(),
                )
                for g in groups
            ],
            issued=[
                ckpt.IssuedTask(task_id=t, at=stamp(i.at), version=i.version) for t, i in sorted(in_flight.items())
            ],
            dead_seq=self.state.dead_seq,
            done_below=self.grouper.done.below,
            done_prefix=self.grouper.done.prefix,
            attempts={t: n for t, n in self.state.attempts.items() if t in buffered},
            step_error=self.state.step_error,
            archive_seq=self.state.archive_seq,
            saved=wall,
        )

    def flush_due(self) -> bool:
        """Messages wait for a ledger write and the last one is `ledger_flush_s` old."""
        return bool(self.pending) and time.monotonic() - self.last_flush >= self.flush_s

    async def flush(self) -> bool:
        """Write the ledger, then ack every message it now accounts for; False, writing nothing, when the
        run's lease is not known to be held (`fence`): another learner may hold the run and write its
        books, so nothing is recorded or acked. The messages stay pending: a renewal that comes (a NATS
        outage) lets the next flush write them; a lost lease stops the learner (learner.service)."""
        if self.fence is not None and not self.fence():
            if not self.fenced:
                log.warning(
                    "the run's learner lease was not renewed within its TTL: the ledger is not written "
                    "(%d messages wait) until a renewal, or the learner stops",
                    len(self.pending),
                )
            self.fenced = True
            return False
        self.fenced = False
        msgs, self.pending = self.pending, []
        dropped, self.unarchived = self.unarchived, []
        reasons, self.state.reasons = self.state.reasons, {}
        # kinds before the snapshot's watermark forgets them
        reasons = [(t, self.grouper.done.get(t, ""), r) for t, r in reasons.items()]
        state = self.snapshot()  # taken together with the swaps above: nothing slips between them
        if dropped:  # their samples are archived before the ledger records them finished
            samples = [s for o in dropped for s in o.group.ordered()]
            await asyncio.to_thread(ckpt.write_dropped, self.run_dir, self.state.archive_seq, samples)
            self.state.archive_seq += 1
            state.archive_seq = self.state.archive_seq
        before = self.ledger.bytes_written
        await asyncio.to_thread(self.ledger.write, state, reasons)
        self.ledger_bytes = self.ledger.bytes_written - before
        self.last_flush = time.monotonic()
        killpoints.reached("acks")
        for m in msgs:
            with contextlib.suppress(Exception):  # a lost ack means a redelivery, which is ignored as late/duplicate
                await m.ack()
        return True


def memory_bound(cfg) -> tuple[int, str]:
    """The longest sequence the learner's memory plan holds, and where that figure comes from. The plan
    (deploy.memory.micro_batch_tokens) sizes a micro-batch's activations for the larger of [learner]
    micro_batch_tokens and [actor.engine] max_model_len: learner.packing.pack_by_tokens gives a
    sequence longer than the budget a micro-batch of its own, so without this bound only the policy's
    positions would limit a micro-batch, and one long sample could run the learner out of memory at
    every attempt of its step."""
    budget, model_len = cfg.learner.micro_batch_tokens, cfg.actor.engine.max_model_len
    return max(budget, model_len), (
        f"the larger of [learner] micro_batch_tokens={budget} and [actor.engine] max_model_len={model_len}"
    )


def check_fits_memory(scored, bound: tuple[int, str] | None) -> None:
    """BadTrajectory (a dead letter, at the intake) for a conversation longer than `bound` (memory_bound)."""
    if bound is None:
        return
    limit, source = bound
    n = arrays.token_ids(scored.trajectory).size
    if n > limit:
        raise BadTrajectory(
            f"{scored.traj_id}: {n} tokens, more than the {limit} one micro-batch of the learner's memory plan "
            f"holds ({source}); raise learner.micro_batch_tokens to at least {n} where the memory plan "
            "(parley up --dry-run) still fits, or make the conversations shorter"
        )


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
