"""WeightFollower.reach: an actor given a task admitted at a version it does not serve yet waits for
that version (bounded) instead of sampling the task with the previous one. No NATS: the poll loop's
load is played by hand."""

from __future__ import annotations

import asyncio

from parley.weights.follow import WeightFollower


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


async def test_reach_returns_when_the_follower_serves_the_version_not_at_its_next_poll(tmp_path):
    """The load wakes reach() itself: a task admitted at the version just published starts as soon as
    the actor serves it. (It used to poll every 0.25 s, a quarter second added to every group admitted
    at a step's end, which is all of them; here the poll is 10 s so only the wake-up can pass.)"""
    from parley.protocol.messages import WeightVersion

    engine = EngineDouble()
    follower = WeightFollower(None, "r", engine, dest_root=tmp_path)
    loop = asyncio.get_running_loop()

    async def load_later():
        await asyncio.sleep(0.2)
        engine.version = 2  # the engine's load sets its version, then the follower records it
        follower.served_now(
            WeightVersion(
                run="r", version=2, step=2, sha256="ab" * 32, location="", transport="cuda_ipc", bytes=0, created=0.0
            )
        )

    loader = asyncio.create_task(load_later())
    t0 = loop.time()
    assert await follower.reach(2, timeout_s=30.0, poll_s=10.0)
    assert loop.time() - t0 < 2.0
    assert follower.loaded == [2] and follower.serving == (2, "ab" * 32)
    await loader


async def test_a_refusal_wakes_reach_at_once(tmp_path):
    follower = WeightFollower(None, "r", EngineDouble(), dest_root=tmp_path)
    loop = asyncio.get_running_loop()

    async def refuse_later():
        await asyncio.sleep(0.2)
        from parley.protocol.messages import WeightVersion

        follower.refuse(
            WeightVersion(
                run="r", version=3, step=3, sha256="cd" * 32, location="", transport="cuda_ipc", bytes=0, created=0.0
            ),
            "sha256 mismatch",
            None,
        )

    refuser = asyncio.create_task(refuse_later())
    t0 = loop.time()
    assert not await follower.reach(3, timeout_s=30.0, poll_s=10.0)
    assert loop.time() - t0 < 2.0
    await refuser
