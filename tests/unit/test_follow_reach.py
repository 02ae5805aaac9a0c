"""WeightFollower.reach: an actor given a task admitted at a version it does not serve yet waits for
that version (bounded) instead of sampling the task with the previous one. No NATS: the poll loop's
load is played by hand."""

from __future__ import annotations

import asyncio

from actors.follow import WeightFollower


class EngineDouble:
    version = 1


async def test_reach_waits_for_the_admitted_version_and_wakes_the_poll_loop(tmp_path):
    engine = EngineDouble()
    follower = WeightFollower(None, "r", engine, dest_root=tmp_path)
    assert await follower.reach(1, timeout_s=0.0)  # served already: no wait

    async def load_later():
        await asyncio.sleep(0.3)
        engine.version = 2  # what the poll loop's reload does

    loader = asyncio.create_task(load_later())
    assert await follower.reach(2, timeout_s=5.0, poll_s=0.05)
    assert follower._wake.is_set()  # the poll loop was asked to read the key now, not at its next poll
    await loader


async def test_reach_gives_up_after_its_bound_or_on_a_refused_version(tmp_path):
    follower = WeightFollower(None, "r", EngineDouble(), dest_root=tmp_path)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await follower.reach(2, timeout_s=0.2, poll_s=0.05)
    assert 0.2 <= loop.time() - t0 < 2.0
    follower.refused[3] = "sha256 mismatch"
    t0 = loop.time()
    assert not await follower.reach(3, timeout_s=30.0, poll_s=0.05)
    assert loop.time() - t0 < 1.0
