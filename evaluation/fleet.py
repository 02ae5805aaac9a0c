"""`parley eval --services fleet`: the benchmark played by the system's own roles over NATS.

Each condition gets a run of its own on the bus (`<run>-eval-<condition>`, streams created fresh and
deleted afterwards): the eval publishes the condition's tasks to that run's TASKS stream, a
`parley actor` serving the condition's model plays them against the `parley sim` service and
publishes trajectories, a `parley scorer` judges them through the `parley judge` service and
publishes Scored, and the eval takes the Scored messages (as the learner would) and turns each into
an EvalRecord. A trajectory the scorer dead-letters (the judge failed) becomes an unscored record; a
task the actor dead-letters is reported as lost. The tasks are `parley.evaluation.runner.make_tasks`' (one per
item and seed, the same ids in every condition's run), so every condition meets the same simulator
seeds, exactly as in the in-process modes.

A role that fails is started again as `parley up` starts its actors and scorers again: under the run
config's [up] restarts and restart_window_s (config.restarts.restart_policy, so a role that holds a
share of a call budget is not), once its heartbeat on the condition's run said ready since its start;
its unsettled tasks and trajectories go to the role started again after `ack_wait`. Any other failure
ends the condition with FleetError, naming why the role was not started again. A task played twice
(redelivered) still makes one record, and a task both scored and dead-lettered counts as scored,
whichever the eval reads first (a Scored that comes after every task has its record is not waited for).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from parley.errors import ParleyError
from parley.evaluation.runner import Condition
from parley.protocol import dead, status, topology
from parley.protocol.messages import EvalRecord, Heartbeat, Scored, Task, Trajectory

log = logging.getLogger(__name__)

FLEET_ROLES = ("actor", "scorer")  # the children a condition's fleet starts (and may start again)


class FleetError(ParleyError, RuntimeError):
    """A role of a condition's fleet failed; the message carries its last log lines."""


def condition_run(run: str, condition: str) -> str:
    """The bus run of one condition: `<run>-eval-<condition>`, cut to the allowed characters and length."""
    return topology.check_run(re.sub(r"[^A-Za-z0-9_-]", "-", f"{run}-eval-{condition}")[:64])


async def delete_run(js, run: str) -> None:
    """Remove a run's streams (with their consumers), weights KV and blob store; missing ones are fine."""
    from nats.js.errors import NotFoundError

    for key in topology.CHANNELS:
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(topology.stream_name(run, key))
    for call, name in (
        (js.delete_key_value, topology.kv_bucket(run)),
        (js.delete_object_store, topology.object_bucket(run)),
    ):
        with contextlib.suppress(NotFoundError):
            await call(name)


def record_of(
    cond: Condition, task: Task, traj: Trajectory, scored: Scored | None, *, sim_model: str, version: int
) -> EvalRecord:
    """The EvalRecord of one fleet conversation (unscored when `scored` is None)."""
    return EvalRecord(
        eval_id=f"{cond.name}/{task.item_id}/{task.seed}",
        condition=cond.name,
        item_id=task.item_id,
        model=cond.model,
        system_prompt=cond.system_prompt,
        sim_prompt=traj.sim_prompt,
        sim_model=sim_model,
        judge_model=scored.judge_model if scored else "",
        seed=task.seed,
        messages=list(traj.messages),
        reference=task.reference,
        assistant_tokens=traj.assistant_tokens,
        metrics=dict(scored.metrics) if scored else {},
        document=scored.document if scored else "",
        judge=list(scored.judge) if scored else [],
        version=version,
        created=time.time(),
    )


@dataclass
class FleetSettings:
    config_path: Path  # the resolved run config the roles start with
    logs_dir: Path  # the roles' logs: <logs_dir>/logs/<role>.log
    sim_model: str = ""  # recorded in the records (the service's model per the config)
    policy_version: int = -1
    progress_s: float = 30.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the roles


def scorer_args(config_args: list[str], ident: str) -> list[str]:
    """`parley` arguments of a condition's scorer. An eval trains nothing, so its scorer asks no
    reference service ([policy] reference = "service" in the run config) for log-probs nobody
    reads; the eval's NATS user may not ask it either."""
    return ["scorer", *config_args, "--set", 'policy.reference="local"', "--id", f"eval-scorer-{ident}"]


async def play_condition_fleet(
    nc,
    js,
    cfg,
    cond: Condition,
    tasks: Sequence[Task],
    fs: FleetSettings,
    stop: asyncio.Event,
    on_record: Callable[[EvalRecord], Awaitable[None]] | None = None,
) -> tuple[list[EvalRecord], list[str]]:
    """Play `tasks` with `cond` through an actor and a scorer on the condition's own run.
    Returns (records in task order, ids of tasks lost to a dead-lettered task). `on_record` gets each
    record once, as the results hold it: a scored one when it comes, an unscored one at the condition's
    end (also an interrupted one's), since until then a Scored of its task replaces it."""
    from parley.config.restarts import restart_policy
    from parley.protocol.bus import PullWorker, publish
    from parley.runtime.supervisor import Supervisor

    run = condition_run(cfg.run.name, cond.name)
    await delete_run(js, run)  # a fresh run: nothing left over from an earlier eval of this condition
    await topology.ensure_topology(js, run, cfg.bus, stores_versions=False)  # its actor loads from disk
    by_id = {t.task_id: msgspec.structs.replace(t, run=run, system_prompt=cond.system_prompt) for t in tasks}
    records: dict[str, EvalRecord] = {}
    unscored: set[str] = set()  # tasks whose record is a dead-lettered trajectory's, until a Scored replaces it
    lost: dict[str, str] = {}
    progressed = asyncio.Event()

    async def keep(task: Task, traj: Trajectory, scored: Scored | None) -> None:
        if task.task_id in records and (scored is None or task.task_id not in unscored):
            return  # a redelivery, or the task played again after its actor was started again
        rec = record_of(cond, task, traj, scored, sim_model=fs.sim_model, version=fs.policy_version)
        records[task.task_id] = rec
        lost.pop(task.task_id, None)  # dead-lettered by an actor after its trajectory went out: not lost
        progressed.set()
        if scored is None:  # passed on at the condition's end, unless a Scored of the task comes first
            unscored.add(task.task_id)
            return
        unscored.discard(task.task_id)
        if on_record is not None:
            await on_record(rec)

    async def on_scored(scored: Scored, msg) -> None:
        task = by_id.get(scored.task_id)
        if task is not None:
            await keep(task, scored.trajectory, scored)
        await msg.ack()

    sup = Supervisor(fs.logs_dir, restart_policy(cfg, FLEET_ROLES))
    c = ["--config", str(fs.config_path), "--set", f"run.name={json.dumps(run)}"]
    ident = re.sub(r"[^A-Za-z0-9_-]", "-", cond.name)
    # The roles' heartbeats on the condition's run, subscribed to before they start: a role that fails
    # after it said ready is started again (Supervisor.check); child name -> the role's --id.
    beats: dict[str, Heartbeat] = {}
    ids = {f"actor-{ident}": f"eval-actor-{ident}", f"scorer-{ident}": f"eval-scorer-{ident}"}

    def ready() -> dict[str, float]:
        said = status.ready_since(list(beats.values()))
        return {name: said[i] for name, i in ids.items() if i in said}

    def say(line: str) -> None:
        log.warning("condition %s: %s", cond.name, line)

    halt = asyncio.Event()
    beat_sub = consumer = None
    try:
        beat_sub = await status.keep_latest(nc, run, beats)
        await nc.flush()
        roles = [
            sup.start(
                f"actor-{ident}",
                sup.parley_argv(
                    "actor", *c, "--set", f"actor.engine.model={json.dumps(cond.model)}", "--id", f"eval-actor-{ident}"
                ),
                env=fs.env,
            ),
            sup.start(f"scorer-{ident}", sup.parley_argv(*scorer_args(c, ident)), env=fs.env),
        ]
        log.info(
            "condition %s: run %s, actor pid %d, scorer pid %d (logs in %s)",
            cond.name,
            run,
            roles[0].proc.pid,
            roles[1].proc.pid,
            sup.run_dir / "logs",
        )
        worker = PullWorker(
            js, run, "scored", on_scored, bus=cfg.bus, name=f"eval-{ident}", concurrency=16, fetch_timeout=1.0
        )
        consumer = asyncio.create_task(worker.run_until(halt), name="scored")
        for t in by_id.values():
            await publish(js, run, "tasks", t)
        dead_seq, last_note = 1, time.monotonic()
        while len(records.keys() | lost.keys()) < len(by_id):
            if stop.is_set():
                break
            failed = sup.check(say, ready())
            if failed is not None:
                raise FleetError(
                    f"{failed.name} of condition {cond.name} exited {failed.returncode} "
                    f"(not started again: {failed.why_not}); its last log lines:\n{failed.tail(20)}"
                )
            if consumer.done():
                consumer.result()
                raise FleetError("the Scored consumer stopped")
            dead_seq = await _read_dead(js, run, dead_seq, by_id, keep, records, lost)
            if time.monotonic() - last_note >= fs.progress_s:
                log.info(
                    "condition %s: %d/%d conversations scored or set aside",
                    cond.name,
                    len(records.keys() | lost.keys()),
                    len(by_id),
                )
                last_note = time.monotonic()
            progressed.clear()
            # a role waiting for its start again is started once its backoff has passed, not up to 2 s later
            due = [ch.restart_due for ch in sup.children if ch.restart_due is not None]
            wait_s = min([2.0, *(max(0.05, t - time.monotonic()) for t in due)])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(progressed.wait(), timeout=wait_s)
    finally:
        halt.set()
        if consumer is not None:
            await asyncio.gather(consumer, return_exceptions=True)
        if beat_sub is not None:
            with contextlib.suppress(Exception):
                await beat_sub.unsubscribe()
        await asyncio.to_thread(sup.stop_all)
        with contextlib.suppress(Exception):
            await delete_run(js, run)
        if on_record is not None:  # no Scored replaces these now; also when interrupted (the eval keeps them)
            for task_id in [t for t in records if t in unscored]:
                await on_record(records[task_id])
    for task_id, reason in lost.items():
        log.error("condition %s: task %s lost: %s", cond.name, task_id, reason)
    return [records[t] for t in by_id if t in records], sorted(lost)


async def _read_dead(
    js, run: str, seq: int, by_id: dict[str, Task], keep, records: dict[str, EvalRecord], lost: dict[str, str]
) -> int:
    """Dead letters since `seq`: a trajectory becomes an unscored record, a task not yet recorded is
    lost. Returns the next seq."""
    letters, seq = await dead.read_since(js, run, seq)
    for _, dl in letters:
        ref = dead.task_ref(run, dl) if dl is not None else None
        if ref is None or ref.task_id not in by_id or ref.message is None:
            continue
        if ref.key == "traj":
            log.warning("%s not scored (%s); kept unscored", ref.message.traj_id, dl.reason)
            await keep(by_id[ref.task_id], ref.message, None)
        elif ref.key == "tasks" and ref.task_id not in records:  # a task already scored is not lost
            lost[ref.task_id] = f"dead-lettered by {dl.consumer}: {dl.reason}"
    return seq
