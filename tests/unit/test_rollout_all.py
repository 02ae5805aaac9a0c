"""rollout.score._all: the judge's concurrent calls. A cancellation of the caller (the scorer stopping:
rollout/score.py's caller is cancelled by scorer.Scorer._unless_stopping) must go on as CancelledError
even when it meets a child's failure; on Python 3.11 a TaskGroup dropped it for the child's error, and
a SIGTERM'd scorer waiting out an unreachable judge asked again for hours."""

from __future__ import annotations

import asyncio

import pytest

from parley.rollout.score import _all


async def test_a_cancel_that_meets_a_failing_child_goes_on():
    started = asyncio.Event()
    slow_cancelled = asyncio.Event()

    async def fails():
        started.set()
        await asyncio.sleep(0)
        raise ValueError("judge unreachable")

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            slow_cancelled.set()
            raise

    caller = asyncio.create_task(_all(fails(), slow()))
    await started.wait()
    caller.cancel()  # the stop arrives just as a child fails
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert slow_cancelled.is_set()  # nothing left running


async def test_the_first_failure_is_raised_as_itself_and_the_rest_are_cancelled():
    cancelled = []

    async def slow(i):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def fails():
        await asyncio.sleep(0.01)
        raise KeyError("first")

    with pytest.raises(KeyError, match="first"):
        await _all(slow(1), fails(), slow(2))
    assert sorted(cancelled) == [1, 2]
    assert await _all(asyncio.sleep(0, "a"), asyncio.sleep(0, "b")) == ["a", "b"]
    assert await _all() == []
