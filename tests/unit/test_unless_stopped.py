"""runtime.process.unless_stopped: the work's result when it ends first; Stopped once the stop comes
first, the work cancelled and ended (also a work that swallows its cancellation); and a caller that is
itself cancelled takes its work down with it. Plain asyncio, no role."""

from __future__ import annotations

import asyncio

import pytest

from parley.runtime.process import Stopped, unless_stopped


def test_the_work_that_ends_first_gives_its_result():
    async def go():
        return await unless_stopped(asyncio.sleep(0.01, result="done"), asyncio.Event())

    assert asyncio.run(go()) == "done"


@pytest.mark.parametrize("swallows", [False, True])
def test_a_stop_first_cancels_the_work_and_waits_for_its_end(swallows):
    ended = []

    async def work():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("cancelled")
            if not swallows:
                raise
        return "swallowed its cancellation"

    async def go():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        with pytest.raises(Stopped):
            await unless_stopped(work(), stop)
        assert ended == ["cancelled"]  # ended before unless_stopped returned

    asyncio.run(go())


def test_a_caller_cancelled_takes_its_work_down_with_it():
    ended = []

    async def work():
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("work ended")

    async def go():
        caller = asyncio.ensure_future(unless_stopped(work(), asyncio.Event()))
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert ended == ["work ended"]

    asyncio.run(go())
