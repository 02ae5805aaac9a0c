"""`parley up --actors auto`'s actor pool over a real nats-server: the pool `up` builds (deploy.autoscale
with the Supervisor's start and retire of real child processes), stepped the way up's main loop steps it
(deploy.up.scale_step on the live view's snapshot). The actors are tests/integration/actor_double.py:
the actor's shared TASKS consumer with an engine test double that takes PLAY_S per task. A growing
backlog adds an actor; once it drains the added one is removed, and the bounds hold throughout."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from parley.deploy.autoscale import ActorPool, ScalePolicy
from parley.deploy.live import RunWatcher
from parley.deploy.up import scale_step
from parley.protocol import topology
from parley.protocol.bus import publish
from parley.protocol.messages import ChatMessage, Task
from parley.runtime.supervisor import Supervisor
from tests.integration.actor_double import BUS

pytestmark = [pytest.mark.integration]
RUN, PLAY_S = "autoscale", 0.4
REPO = Path(__file__).resolve().parents[2]


def task(i: int) -> Task:
    return Task(task_id=f"{RUN}-g{i:06d}", run=RUN, item_id=f"i{i}", n=1, prefix=[ChatMessage("user", "Hello.")])


async def test_actor_pool_grows_under_a_backlog_and_shrinks_when_it_drains(js, nc, nats_server, tmp_path):
    await topology.ensure_topology(js, RUN, BUS)
    sup = Supervisor(tmp_path / "run")

    def spawn(name: str) -> None:
        sup.start(
            name, [sys.executable, "-m", "tests.integration.actor_double", nats_server.url, RUN, name, str(PLAY_S)]
        )

    async def retire(name: str) -> None:
        assert await asyncio.to_thread(sup.retire, name) == 0  # a retired actor drains and exits cleanly

    spawn("actor-0")
    pool = ActorPool(ScalePolicy(low=1, high=2, per_actor=3, down_after_s=2.0), spawn, retire, ["actor-0"])
    watcher = RunWatcher(nc, RUN)
    await watcher.start()
    actions: list[tuple[str, int]] = []  # (what, waiting when it happened)
    published = 0
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90:
            failed = next((c for c in sup.children if c.returncode not in (None, 0)), None)
            assert failed is None, failed.tail()
            # The backlog grows for the first 4 s: 3 tasks a second, one actor plays 2.5 a second.
            if time.monotonic() - t0 < 4.0:
                for _ in range(3):
                    await publish(js, RUN, "tasks", task(published))
                    published += 1
            snap = await watcher.poll()
            if did := await scale_step(pool, snap):
                actions.append((did.split(":")[0], snap.streams["tasks"].pending))
            assert 1 <= len(pool.names) <= 2
            if actions and actions[-1][0].startswith("removed"):
                break
            await asyncio.sleep(0.25)
        assert [a for a, _ in actions] == ["added actor-1", "removed actor-1"], actions
        assert actions[0][1] > 3 and actions[1][1] <= 3  # added above one actor's share, removed at or below it
        assert pool.names == ["actor-0"] and [c.name for c in sup.children] == ["actor-0"]
        plays = {hb.id: hb.counters.get("tasks", 0) for hb in watcher.snap.roles.values()}
        assert plays.get("actor-1", 0) > 0, plays  # the added actor took its share of the backlog
    finally:
        await watcher.stop()
        sup.stop_all(timeout=10)
