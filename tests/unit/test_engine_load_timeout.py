"""Every step of a weights load into a PolicyEngine is bounded by [actor.engine] load_timeout_s: a worker
that hangs in a file reload, a packed load or an adapter's add raises TimeoutError naming what it was
doing and the key, generation stays paused on the weights that may be mixed (the follower puts the
served ones back, bounded the same way, or stops the actor), instead of the actor waiting for good.
No vLLM: a test double plays AsyncLLM whose worker calls never return."""

from __future__ import annotations

import asyncio
import time

import pytest

from parley.config.run import load_config
from parley.engines.backend import engine_settings
from parley.engines.engine import EngineSettings
from tests.unit.test_engine_sleep_resume import SleepingSchedulerLLMDouble, engine_double


class HangingWorkerLLMDouble(SleepingSchedulerLLMDouble):
    """Test double of vLLM whose worker RPCs and adapter adds never return (a stuck engine core)."""

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        await asyncio.Event().wait()

    async def add_lora(self, request):
        self.calls.append("add_lora")
        await asyncio.Event().wait()


def hanging_engine(limit: float):
    engine = engine_double()
    engine._llm = HangingWorkerLLMDouble()
    engine.settings = EngineSettings(model="double", load_timeout_s=limit)
    engine._next_lora_id = 1
    return engine


def test_a_reload_that_hangs_ends_with_a_timeout_and_generation_stays_paused():
    async def go():
        engine = hanging_engine(0.2)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"reloading the weights from /w/v1 took over 0.2 s \(\[actor.engine\] load_timeout_s\)"):  # fmt: skip
            await engine.reload_weights("/w/v1", version=1)
        assert time.monotonic() - t0 < 2
        assert engine._llm.paused and engine._mixed and engine.version == 0  # no request runs on mixed weights

    asyncio.run(go())


@pytest.mark.parametrize(
    "load, what",
    [
        (lambda e: e.load_packed_delta(b"announcement", "/w/delta", version=1), "applying the packed delta"),
        (lambda e: e.restore_packed(0), "loading version 0 again from the packed copy"),
        (lambda e: e.load_adapter("/w/adapter", version=1), "adding adapter version 1"),
        (lambda e: e.keep_packed(b"announcement", "/w/v1"), "preparing the GPU-buffer loads"),
    ],
)
def test_every_other_load_that_hangs_ends_with_a_timeout(load, what, monkeypatch):
    monkeypatch.setattr("parley.engines.engine.PolicyEngine._settled", lambda self: asyncio.sleep(0))
    pytest.importorskip("vllm")

    async def go():
        engine = hanging_engine(0.2)
        with pytest.raises(TimeoutError, match=what):
            await asyncio.wait_for(load(engine), timeout=5)

    asyncio.run(go())


@pytest.mark.parametrize("key", ["load_timeout_s", "stall_timeout_s"])  # stall: PolicyEngine.watch's bound
def test_the_bound_comes_from_the_engine_section(key):
    cfg = load_config(None, [f"actor.engine.{key}=42"])
    assert getattr(engine_settings(cfg.actor.engine, "/m"), key) == 42
    with pytest.raises(Exception, match=key):
        load_config(None, [f"actor.engine.{key}=0"])


@pytest.mark.parametrize("adapter", [False, True])
def test_a_gpu_buffer_load_is_bounded_by_the_learners_hold_time_not_the_load_timeout(adapter, monkeypatch):
    """A cuda_ipc / nccl version (whole weights or an adapter) waits at most the learner's hold time, far
    below load_timeout_s: past it the buffer may be overwritten. An adapter's staging is forgotten again."""
    from tests.unit.test_engine_gpu_failures import announcement

    monkeypatch.setattr("parley.engines.engine.PolicyEngine._settled", lambda self: asyncio.sleep(0))
    if adapter:
        pytest.importorskip("vllm")

    async def go():
        engine = hanging_engine(600.0)
        engine._gpu_load_prepared = True  # its one-time preparation is load_timeout_s's (above)
        engine._staged, engine._llm.remove_lora = set(), lambda lora_id: asyncio.sleep(0)
        forgot = []

        async def forget(request):
            forgot.append(request.lora_int_id)

        engine._forget = forget
        load = (
            engine.load_adapter_gpu(announcement(1), version=1, hold_s=0.2)
            if adapter
            else engine.load_gpu(announcement(1), hold_s=0.2, version=1)
        )
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"took over 0.2 s \(the learner's hold time\)"):
            await load
        assert time.monotonic() - t0 < 2
        assert forgot == ([1] if adapter else [])
        if not adapter:
            assert engine._mixed and engine._llm.paused and engine.version == 0

    asyncio.run(go())
