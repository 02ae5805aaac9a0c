"""evaluation.fleet.play_condition_fleet's records with a real nats-server: a trajectory the scorer
dead-lettered (an unscored record) and a Scored of the same task (another copy of it, scored) make one
record, the scored one, whichever the eval reads first; `on_record` gets each record once, as it is in
the results. Before, a dead letter read first won: the task's Scored was dropped and `on_record` had
been given the unscored record. The roles are test doubles (fleet_role_double.py) that only send
heartbeats; the test publishes the work they would have done."""

from __future__ import annotations

import asyncio
import time

import pytest

from parley.protocol import codec, topology
from parley.protocol.bus import publish
from parley.protocol.messages import DeadLetter, EvalRecord, Task
from tests import factories
from tests.integration.test_fleet_restart import COND, fleet_of_doubles, setup, text, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def scored(run: str, task: Task, traj_id: str):
    return factories.scored(factories.trajectory(run, task.task_id, traj_id=traj_id), {"bleu": 0.5})


def judge_failed(run: str, task: Task) -> DeadLetter:
    """The scorer's dead letter of task's trajectory (the judge failed)."""
    traj = factories.trajectory(run, task.task_id, traj_id=f"{task.task_id}-0")
    return DeadLetter(
        subject=topology.subject(run, "traj"),
        reason="JudgeFailed: no verdict",
        consumer="scorer",
        payload=codec.encode(traj),
    )


async def start(tmp_path, nats_server, nc, js, monkeypatch, seen: list[EvalRecord]):
    from parley.evaluation.fleet import condition_run, play_condition_fleet

    cfg, tasks, fs = setup(tmp_path, nats_server.url)
    run = condition_run(cfg.run.name, COND.name)
    fleet_of_doubles(monkeypatch, nats_server.url, run)

    async def on_record(rec: EvalRecord) -> None:
        seen.append(rec)

    play = asyncio.create_task(play_condition_fleet(nc, js, cfg, COND, tasks, fs, asyncio.Event(), on_record))
    logs = fs.logs_dir / "logs"
    await until(lambda: play.done() or all("running" in text(logs / f"{r}-base.log") for r in ("actor", "scorer")))
    assert not play.done(), play.exception()
    return run, tasks, play


async def acked(js, run: str, seq: int, seconds: float = 10.0) -> None:
    """Until the eval's Scored consumer has acked the stream's messages up to `seq`."""
    deadline = time.monotonic() + seconds
    stream = topology.stream_name(run, "scored")
    while (await js.consumer_info(stream, topology.CHANNELS["scored"].durable)).ack_floor.stream_seq < seq:
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_task_scored_after_its_trajectory_was_dead_lettered_counts_as_scored(
    tmp_path, nats_server, nc, js, monkeypatch
):
    seen: list[EvalRecord] = []
    run, tasks, play = await start(tmp_path, nats_server, nc, js, monkeypatch, seen)
    # Task 0: the scorer dead-letters one copy's trajectory, and the eval reads that first; then another
    # copy of the task (redelivered, played again) is scored.
    await publish(js, run, "dead", judge_failed(run, tasks[0]))
    await asyncio.sleep(2.5)  # a pass of the condition's loop, which reads the dead letters
    assert not play.done(), play.result()
    await publish(js, run, "scored", scored(run, tasks[0], "t0-again"))
    await acked(js, run, 1)
    for task in tasks[1:]:
        await publish(js, run, "scored", scored(run, task, f"{task.task_id}-0"))
    records, lost = await asyncio.wait_for(play, 30)
    assert lost == []
    assert [(r.item_id, r.metrics) for r in records] == [(f"item{i}", {"bleu": 0.5}) for i in range(3)]
    # on_record: each conversation once, the scored record (before: t0's unscored one, and only that)
    assert sorted((r.item_id, r.metrics["bleu"] if r.metrics else None) for r in seen) == [
        (f"item{i}", 0.5) for i in range(3)
    ]


async def test_an_interrupted_condition_still_passes_on_its_unscored_records(
    tmp_path, nats_server, nc, js, monkeypatch
):
    """An unscored record goes to `on_record` once no Scored can replace it: at the condition's end,
    also when the condition is cancelled (Ctrl-C: the eval writes what `on_record` got)."""
    seen: list[EvalRecord] = []
    run, tasks, play = await start(tmp_path, nats_server, nc, js, monkeypatch, seen)
    await publish(js, run, "dead", judge_failed(run, tasks[0]))
    await publish(js, run, "scored", scored(run, tasks[1], "t1-0"))
    await asyncio.sleep(2.5)  # a pass of the condition's loop, which reads the dead letters
    assert not play.done(), play.result()
    play.cancel()
    await asyncio.gather(play, return_exceptions=True)
    assert sorted((r.item_id, r.metrics) for r in seen) == [("item0", {}), ("item1", {"bleu": 0.5})]
