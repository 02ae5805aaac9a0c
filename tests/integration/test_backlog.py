"""A stream whose unconsumed messages near its byte limit is reported before it drops work: the
learner logs it once, the live view and `parley up`'s progress line show it. Real nats-server,
streams of 64 KiB, Scored messages nobody consumes yet."""

from __future__ import annotations

import logging

import pytest

from parley.deploy.live import RunWatcher, backlog_warnings, render
from parley.deploy.up import progress_line
from parley.protocol import backlog, topology
from parley.protocol.bus import publish
from parley.protocol.messages import Task
from tests.integration.test_learner_fates import TrainerDouble, base_model, make_cfg, scored_for

pytestmark = [pytest.mark.integration]

TINY = topology.BusSettings(max_bytes=64 * 1024, max_msg_bytes=32 * 1024)


def test_share_is_the_unconsumed_messages_at_average_size():
    assert backlog.unconsumed_share(10, 10_000, 4, 8_000) == 0.5
    assert backlog.unconsumed_share(0, 0, 0, 8_000) == 0.0 and backlog.unconsumed_share(3, 30, 3, 0) == 0.0


async def test_a_filling_backlog_is_warned_about(js, nc, tmp_path, caplog):
    from parley.learner.service import Learner

    run = "backlog"
    await topology.ensure_topology(js, run, TINY)
    task = Task(task_id=f"{run}-g000000", run=run, item_id="i", n=6)
    for i in range(5):  # 5 x ~11 KB of 64 KiB (86%), none consumed
        await publish(js, run, "scored", scored_for(task, i, pad=11_000))

    shares = await backlog.shares(js, run)
    assert shares["scored"][0] >= backlog.WARN_SHARE and shares["scored"][1] == 64 * 1024
    assert shares["tasks"][0] == 0.0

    cfg = make_cfg(run, tmp_path / "run", bus=TINY)
    learner = Learner(cfg, js, nc, TrainerDouble(), model_dir=base_model(tmp_path), resume=False, steps=1)
    with caplog.at_level(logging.WARNING, logger="parley.learner"):
        await learner.backlog.check()
        await learner.backlog.check()  # still full: no second warning
    warned = [r.getMessage() for r in caplog.records if "unconsumed messages fill" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("stream scored: unconsumed messages fill")
    assert learner.heartbeat().counters["backlog.scored"] >= backlog.WARN_SHARE

    watcher = RunWatcher(nc, run)
    snap = await watcher.poll()
    assert snap.streams["scored"].backlog >= backlog.WARN_SHARE
    assert backlog_warnings(snap)[0].startswith("stream scored:")
    assert "BACKLOG scored" in progress_line(snap)
    render(snap, run)  # renders with the warning caption
