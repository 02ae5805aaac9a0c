"""A version loaded while the engine's KV cache sleeps ([up] gpu_share = "phased": weights woken, the
version loaded, then the KV cache) leaves vLLM's scheduler paused: a load's pause ends with
resume_generation, which in vLLM unpauses the scheduler whatever sleeps, and a request queued meanwhile
would run on KV cache memory that is not mapped. PolicyEngine resumes only when nothing sleeps; vLLM's
own wake_up resumes once both are awake. Also: the phase schedule lets no conversation reach the
engine before the KV cache is awake. No vLLM: a test double plays AsyncLLM with vLLM's pause and sleep
semantics (vllm/v1/engine/core.py: sleep pauses the scheduler, a partial wake keeps it paused,
resume_scheduler unpauses it)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from parley.actors.phases import ACTIVE, PhaseSchedule
from parley.engines.engine import EngineSettings, PolicyEngine
from tests.unit.test_engine_gpu_failures import announcement


class SleepingSchedulerLLMDouble:
    """Test double for vLLM's AsyncLLM as a load and the phase schedule drive it: a scheduler that is
    paused or not, memory tagged "weights" and "kv_cache" asleep or not, a queue of requests it runs as
    soon as it is unpaused (`ran` records each, and whether its KV cache memory was mapped then)."""

    def __init__(self):
        self.paused, self.asleep = False, set()
        self.queued: list[str] = []
        self.ran: list[tuple[str, bool]] = []  # (request, KV cache awake when it ran)
        self.calls: list[str] = []

    def add(self, request: str) -> None:
        """A request reaches vLLM's queue (generate): it runs at once unless the scheduler is paused."""
        self.queued.append(request)
        self._step()

    def _step(self) -> None:
        if not self.paused:
            self.ran += [(r, "kv_cache" not in self.asleep) for r in self.queued]
            self.queued.clear()

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append("pause")
        self.paused = True

    async def resume_generation(self):
        self.calls.append("resume")
        self.paused = False  # vLLM's resume_scheduler: unpaused, whatever sleeps
        self._step()

    async def sleep(self, level=1, mode="abort"):
        self.calls.append(f"sleep {level}")
        self.queued.clear()  # mode "abort": every request vLLM holds ends
        self.paused, self.asleep = True, {"weights", "kv_cache"}

    async def wake_up(self, tags=None):
        self.calls.append("wake " + ",".join(tags or ["all"]))
        self.asleep -= set(tags or self.asleep)
        if not self.asleep:  # vLLM resumes the scheduler once all its memory is resident again
            self.paused = False
            self._step()

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        return [None]  # every worker loaded (no reason to refuse)


def engine_double() -> PolicyEngine:
    engine = PolicyEngine.__new__(PolicyEngine)  # no vLLM
    engine.version, engine._llm, engine._reload_lock = 0, SleepingSchedulerLLMDouble(), asyncio.Lock()
    engine._weights_epoch, engine._removing = 0, None
    engine.settings = EngineSettings(model="double", sleep_mode=True)
    engine.packed_name = None
    return engine


def loads(engine: PolicyEngine, monkeypatch):
    """Every PolicyEngine load that pauses and resumes generation, by name."""
    from parley.protocol import codec

    monkeypatch.setattr("parley.weights.cuda_ipc.table_digest", lambda packed: "digest")
    monkeypatch.setattr(codec, "decode", lambda kind, data: SimpleNamespace(packed=None))
    return {
        "reload_weights": lambda: engine.reload_weights("/w/v1", version=1),
        "load_gpu": lambda: engine.load_gpu(announcement(1), hold_s=5.0, version=1),
        "load_packed_delta": lambda: engine.load_packed_delta(b"announcement", "/w/delta", version=1),
        "restore_packed": lambda: engine.restore_packed(1),
    }


@pytest.fixture(autouse=True)
def can_sleep(monkeypatch):
    monkeypatch.setattr("parley.engines.engine.sleep_available", lambda: True)


@pytest.mark.parametrize("load", ["reload_weights", "load_gpu", "load_packed_delta", "restore_packed"])
@pytest.mark.parametrize("level", [1, 2])
def test_a_load_while_the_kv_cache_sleeps_runs_no_request_until_it_wakes(load, level, monkeypatch):
    async def go():
        engine = engine_double()
        llm = engine._llm
        await engine.sleep(level)
        llm.add("queued while asleep")  # not through parley: vLLM holds it, paused
        await engine.wake_up(["weights"])  # as PhaseSchedule.before_load
        await loads(engine, monkeypatch)[load]()
        assert llm.ran == [] and llm.paused  # not on KV cache memory that is not mapped
        await engine.wake_up(["kv_cache"])  # as PhaseSchedule.after_load: vLLM resumes now
        assert llm.ran == [("queued while asleep", True)] and not llm.paused
        assert engine.version == 1

    asyncio.run(go())


@pytest.mark.parametrize("load", ["reload_weights", "load_gpu", "load_packed_delta", "restore_packed"])
def test_a_load_made_awake_still_resumes_generation(load, monkeypatch):
    async def go():
        engine = engine_double()
        await loads(engine, monkeypatch)[load]()
        assert engine._llm.calls[-1] == "resume" and not engine._llm.paused
        await engine.sleep(2)
        await engine.wake_up()  # both at once
        await loads(engine, monkeypatch)[load]()
        assert engine._llm.calls[-1] == "resume" and not engine._llm.paused

    asyncio.run(go())


def test_no_conversation_reaches_the_engine_before_its_kv_cache_wakes():
    """Through parley the window is closed by the schedule itself: a conversation that enters while a
    version is loaded into the woken weights waits for the KV cache (PhaseSchedule._awake), so nothing
    is in vLLM's queue when a load resumes it; the engine's own pause (above) is the second guard."""

    async def go():
        engine = engine_double()
        llm = engine._llm

        async def put_back():
            await engine.reload_weights("/w/v0", version=engine.version)

        p = PhaseSchedule(engine, level=2, quota=1, put_back=put_back, timeout_s=5.0)
        await p.enter()
        await p.leave(0)  # the step's conversation: the engine sleeps
        await p.before_load()  # the next version is announced: weights woken

        async def conversation():
            await p.enter()
            llm.add("turn")

        turn = asyncio.create_task(conversation())
        await asyncio.sleep(0.01)
        await engine.reload_weights("/w/v1", version=1)
        await asyncio.sleep(0.01)
        assert llm.ran == [] and not turn.done()
        await p.after_load(True)
        await asyncio.wait_for(turn, 1.0)
        assert p.phase == ACTIVE and llm.ran == [("turn", True)]
        assert llm.calls[:2] == ["sleep 2", "wake weights"] and llm.calls[-1] == "wake kv_cache"

    asyncio.run(go())


class LoadFailsHalfWayLLMDouble(SleepingSchedulerLLMDouble):
    """Test double of vLLM whose weight load raises after some tensors changed (the worker's
    parley_reload_weights failing half-way: out of memory, a broken file)."""

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        if method == "parley_reload_weights":
            raise RuntimeError("test double: CUDA error: out of memory while loading")
        return [None]


@pytest.mark.parametrize("level", [1, 2])
def test_a_load_that_fails_half_way_while_the_kv_cache_sleeps_is_never_woken_into(level):
    """The KV cache's wake would make vLLM resume its scheduler on mixed weights: refused, and the
    request vLLM holds does not run (the follower's restore, or the actor's stop, comes next)."""

    async def go():
        engine = engine_double()
        engine._llm = llm = LoadFailsHalfWayLLMDouble()
        await engine.sleep(level)
        llm.add("queued while asleep")
        await engine.wake_up(["weights"])  # as PhaseSchedule.before_load
        with pytest.raises(RuntimeError, match="out of memory while loading"):
            await engine.reload_weights("/w/v1", version=1)
        with pytest.raises(RuntimeError, match="weights are mixed after a load that failed half-way"):
            await engine.wake_up(["kv_cache"])  # as PhaseSchedule.after_load(False)
        assert llm.ran == [] and llm.paused and "wake kv_cache" not in llm.calls
        assert engine.version == 0

    asyncio.run(go())


def test_once_a_whole_version_is_loaded_again_the_kv_cache_wakes():
    async def go():
        engine = engine_double()
        engine._llm = llm = LoadFailsHalfWayLLMDouble()
        await engine.sleep(1)
        llm.add("queued while asleep")
        await engine.wake_up(["weights"])
        with pytest.raises(RuntimeError):
            await engine.reload_weights("/w/v1", version=1)
        await engine.load_gpu(announcement(0), hold_s=5.0, version=0)  # the follower's restore: whole
        await engine.wake_up(["kv_cache"])
        assert llm.ran == [("queued while asleep", True)]

    asyncio.run(go())
