"""PolicyEngine.watch: a role whose engine died, or holds requests without taking a step, stops with
EngineFailed instead of holding its conversations (and the tasks behind them) until the learner's group
timeout or for good. An engine that steps slowly, one with nothing to do, and one that parley itself
paused (a weights load, bounded on its own; a sleep) are left alone. No vLLM: test doubles play AsyncLLM;
tests/e2e/test_engine.py runs the watch on a real engine."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("vllm")  # PolicyEngine._run builds vLLM's prompt type

from parley.engines.backend import is_fatal
from parley.engines.engine import EngineCounts, EngineFailed, EngineSettings
from tests.unit.test_engine_sleep_resume import engine_double


class CoreLLMDouble:
    """Test double of vLLM's AsyncLLM: each generate yields one output a `step_s` for `steps` steps,
    recording each step as vLLM's stat logger would (EngineCounts.record); `hung` stops the steps (a
    kernel that never returns), `errored` is vLLM's own "the engine core is gone"."""

    def __init__(self, counts: EngineCounts, step_s: float = 0.02, steps: int = 5):
        self.counts, self.step_s, self.steps = counts, step_s, steps
        self.hung, self.errored = False, False

    async def generate(self, prompt, params, request_id, lora_request=None):
        for _ in range(self.steps):
            await asyncio.sleep(self.step_s)
            while self.hung:
                await asyncio.sleep(0.01)
            self.counts.record(None)
        if False:  # an async generator that yields no output: _run reports an abort
            yield None


def watched_engine(stall_s: float, **core):
    engine = engine_double()
    engine.settings = EngineSettings(model="double", stall_timeout_s=stall_s)
    engine.counts = EngineCounts()
    engine._steps_counted, engine._prefix_epochs, engine.adapters = True, None, {}
    engine.base_version = 0
    engine._llm = CoreLLMDouble(engine.counts, **core)
    return engine


async def generate(engine):
    """One request through PolicyEngine._run (which counts the requests waiting on vLLM)."""
    from parley.engines.engine import PolicyEngine

    return await PolicyEngine._run(engine, [1, 2, 3], params=None)


def test_a_hung_engine_with_a_request_waiting_fails_the_watch_past_the_stall_bound():
    async def go():
        engine = watched_engine(0.3, steps=1000)
        engine._llm.hung = True
        stop = asyncio.Event()
        request = asyncio.ensure_future(generate(engine))
        await asyncio.sleep(0.05)  # in _run (its first call imports vllm.inputs, blocking the loop a while)
        t0 = time.monotonic()
        with pytest.raises(EngineFailed, match=r"held 1 requests for \d+ s without taking a step \(\[\*\.engine\] stall_timeout_s = 0\.3\)"):  # fmt: skip
            await asyncio.wait_for(engine.watch(stop, tick_s=0.05), timeout=5)
        assert 0.3 <= time.monotonic() - t0 < 2
        request.cancel()

    asyncio.run(go())


def test_an_engine_that_steps_slowly_a_long_request_an_idle_engine_and_a_load_are_left_alone():
    async def go():
        # each step well inside the bound (slack for a loaded test machine), the request 3x longer than it
        engine = watched_engine(0.3, step_s=0.03, steps=30)
        stop = asyncio.Event()
        watch = asyncio.ensure_future(engine.watch(stop, tick_s=0.01))
        await generate(engine)
        await asyncio.sleep(0.4)  # then idle, longer than the bound: nothing waits on the engine
        # parley's own pause: a weights load holds the scheduler past the stall bound (the load has its own)
        engine._llm.hung = True
        request = asyncio.ensure_future(generate(engine))
        async with engine._reload_lock:
            await asyncio.sleep(0.4)
        engine._llm.hung = False
        await request
        engine._asleep = frozenset({"kv_cache"})  # asleep under gpu_share = "phased": requests wait for the wake
        engine._llm.hung = True
        request = asyncio.ensure_future(generate(engine))
        await asyncio.sleep(0.4)
        engine._asleep, engine._llm.hung = frozenset(), False
        await request
        stop.set()
        await asyncio.wait_for(watch, timeout=2)  # ended by stop, no EngineFailed

    asyncio.run(go())


def test_a_pause_of_this_process_longer_than_the_bound_is_not_a_stall():
    """SIGSTOP (or a loop blocked) past the bound: the first tick after it comes late and the engine's
    outputs are still unread; the watch starts its count again there instead of failing the engine."""

    async def go():
        engine = watched_engine(0.3, steps=1000)
        engine._llm.hung = True
        request = asyncio.ensure_future(generate(engine))
        await asyncio.sleep(0.05)  # in _run
        watch = asyncio.ensure_future(engine.watch(asyncio.Event(), tick_s=0.05))
        await asyncio.sleep(0.06)
        time.sleep(1.5)  # this process does not run, for 5x the bound
        t0 = time.monotonic()
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(watch, timeout=5)  # a real stall still fails, a bound after the pause
        assert time.monotonic() - t0 >= 0.3
        request.cancel()

    asyncio.run(go())


def test_a_dead_engine_core_fails_the_watch_at_once_and_is_fatal_to_a_service():
    async def go():
        engine = watched_engine(300.0)
        engine._llm.errored = True
        with pytest.raises(EngineFailed, match="has died") as caught:
            await asyncio.wait_for(engine.watch(asyncio.Event(), tick_s=0.02), timeout=2)
        assert is_fatal(caught.value)

    asyncio.run(go())
