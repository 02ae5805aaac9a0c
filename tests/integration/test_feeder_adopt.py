"""A feeder adopts the tasks the TASKS stream holds past its recorded index instead of publishing them
again (issue 28, item 8): a learner killed before its first ledger write, or between a publish and the
ledger write that records it, resumes from what the stream holds. Real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from parley.config.learner import RolloutConfig
from parley.learner.feeder import Feeder, FeederState, Issued, task_id
from parley.protocol import codec, topology
from parley.tasks.data import load_items

pytestmark = pytest.mark.integration

RUN = "adopt"
BUS = topology.BusSettings(max_bytes=16 * 1024**2)


def feeder(js, state=None) -> Feeder:
    return Feeder(
        js, RUN, load_items()[:5], RolloutConfig(n=2), max_staleness=1, groups_per_step=2, seed=3, state=state
    )


async def issue_until(f: Feeder, count: int) -> None:
    stop = asyncio.Event()
    run = asyncio.create_task(f.run(stop))
    for _ in range(200):
        if f.state.next_index >= count:
            break
        await asyncio.sleep(0.05)
    stop.set()
    f.wake()
    await asyncio.wait_for(run, 10)


async def stored_ids(js) -> list[str]:
    name = topology.stream_name(RUN, "tasks")
    info = (await js.stream_info(name)).state
    return [
        codec.decode("tasks", (await js.get_msg(name, s)).data).task_id
        for s in range(info.first_seq, info.last_seq + 1)
    ]


async def test_a_feeder_without_a_ledger_adopts_the_published_tasks_and_issues_after_them(js):
    await topology.ensure_topology(js, RUN, BUS)
    first = feeder(js)
    await issue_until(first, 4)  # the gate: (0 + 1 + 1) x 2 = 4 tasks at version 0
    assert first.state.next_index == 4
    # The learner dies before any ledger write: its successor starts from an empty state.
    second = feeder(js, FeederState())
    assert await second.adopt_published() == 4
    assert set(second.state.in_flight) == {task_id(RUN, i) for i in range(4)}
    assert second.state.next_index == 4 and not second.is_open()  # the slots are taken by the adopted tasks
    second.mark_consumed(task_id(RUN, 0))
    second.mark_consumed(task_id(RUN, 1))
    second.set_version(1)
    await issue_until(second, 6)
    # Without adoption the second feeder publishes g000000 again (deduplicated by Msg-Id only within
    # the duplicate window, played a second time after it) and never issues g000004.
    assert await stored_ids(js) == [task_id(RUN, i) for i in range(6)]


async def test_a_resumed_feeder_adopts_only_the_tail_its_ledger_did_not_record(js):
    await topology.ensure_topology(js, RUN, BUS)
    await issue_until(feeder(js), 4)
    recorded = FeederState(next_index=2, in_flight={task_id(RUN, 0): Issued(1.0, 0), task_id(RUN, 1): Issued(1.0, 0)})
    second = feeder(js, recorded)
    assert await second.adopt_published() == 2
    assert second.state.next_index == 4
    assert second.state.in_flight[task_id(RUN, 0)] == Issued(1.0, 0)  # the recorded issue times stay
    assert set(second.state.in_flight) == {task_id(RUN, i) for i in range(4)}
    # Nothing past the recorded index: nothing adopted, nothing moved.
    third = feeder(js, FeederState(next_index=4))
    assert await third.adopt_published() == 0 and third.state.next_index == 4 and not third.state.in_flight


async def test_a_learner_killed_before_its_first_ledger_write_resumes_its_published_tasks(
    js, nats_server, tiny_model, tmp_path
):
    """The real `parley learner`: it publishes its first tasks, is SIGKILLed before any ledger write
    (no sample arrived), and `--resume` adopts those tasks instead of issuing them again."""
    import os
    import signal

    from parley.learner.checkpoint import read_state
    from tests.integration.test_learner_resume import BUS as RESUME_BUS
    from tests.integration.test_learner_resume import start_learner, wait_for

    run = "adopt-learner"
    await topology.ensure_topology(js, run, RESUME_BUS)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    proc = start_learner(nats_server.url, run, run_dir, tiny_model, log)

    async def published() -> int:
        return (await js.stream_info(topology.stream_name(run, "tasks"))).state.messages

    count = 0
    for _ in range(600):
        count = await published()
        if count > 0 or proc.poll() is not None:
            break
        await asyncio.sleep(0.2)
    assert count > 0, log.read_text()[-3000:]
    await asyncio.sleep(1.0)  # every task the gate lets out
    count = await published()
    assert read_state(run_dir) is None, "the learner wrote its ledger: this is not the case under test"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    proc = start_learner(nats_server.url, run, run_dir, tiny_model, log, resume=True)
    try:
        await wait_for(lambda: "adopted" in log.read_text(), 180, "the resumed learner to adopt its tasks", proc, log)
        text = log.read_text()
        assert "--resume: no learner state" in text
        assert f"adopted {count} tasks the TASKS stream held past the recorded index" in text, text[-3000:]
        # no task past the adopted ones: the gate is full of them (a re-issue of the same ids would be
        # hidden here by Msg-Id deduplication; the log line above is what tells adoption apart)
        assert await published() == count
    finally:
        proc.kill()
        proc.wait(timeout=30)


async def test_a_task_the_server_drops_as_a_repeat_is_issued_under_the_next_id_not_counted_in_flight(js):
    """--reset-streams purges TASKS, but the server's dedupe window (bus.duplicate_window_s) still
    remembers the Msg-Ids of the older learner's tasks: a fresh feeder publishing g000000 again gets a
    PubAck with duplicate=True and nothing is stored. Counted in flight, such a task would hold a slot
    that no actor ever fills, until task_deadline_s; it is counted as a repeat and the next index is
    issued instead, so every task in flight is one the stream holds."""
    from parley.learner.lease import check_fresh_streams
    from parley.protocol.bus import COUNTERS

    await topology.ensure_topology(js, RUN, BUS)
    await issue_until(feeder(js), 4)  # an older learner of this run
    await check_fresh_streams(js, RUN, reset=True)  # the new one's --reset-streams
    before = COUNTERS["duplicate.tasks.earlier"]
    fresh = feeder(js, FeederState())
    await issue_until(fresh, 8)
    stored = await stored_ids(js)
    assert sorted(fresh.state.in_flight) == stored, (sorted(fresh.state.in_flight), stored)
    assert stored == [task_id(RUN, i) for i in range(4, 8)] and fresh.state.next_index == 8
    assert COUNTERS["duplicate.tasks.earlier"] - before == 4
