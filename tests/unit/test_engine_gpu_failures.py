"""How a GPU-transport load that did not happen reaches the actor (engines.engine): the worker's
parley_load_gpu says whether it passes (the transport's receive raised WeightUnavailable: the buffer
did not open, the receive broke, out of memory) or refuses for good (a checksum mismatch), and
PolicyEngine.load_gpu raises WeightUnavailable or WeightVerifyError for it. No vLLM: a test double
plays AsyncLLM and the worker; the transport's receive is replaced."""

from __future__ import annotations

import asyncio

import pytest

from parley.engines.engine import EngineSettings, PolicyEngine
from parley.protocol import codec
from parley.protocol.messages import IpcTensor, NcclSource
from parley.weights import registry
from parley.weights.common import WeightUnavailable, WeightVerifyError
from parley.weights.worker import REFUSED, UNAVAILABLE, WorkerExtension


def announcement(version: int = 2) -> bytes:
    src = NcclSource(
        address="learner:29600",
        backend="gloo",
        nbytes=256,
        hold_s=5.0,
        tensors=[IpcTensor(name="w", dtype="bfloat16", shape=[128], offset=0, checksum=[1, 1, 1])],
    )
    return codec.encode(
        registry.TRANSPORTS["nccl"].announcement(
            src, version=version, step=version, sha256="0" * 64, bytes=256, created=0.0, run="r", files=[]
        )
    )


class WorkerDouble(WorkerExtension):
    """The worker side, with nothing loaded: parley_load_gpu stops at the transport's receive."""


class LLMDouble:
    """AsyncLLM's side that load_gpu uses; collective_rpc runs the worker's method on each worker."""

    async def pause_generation(self, **kw):
        pass

    async def resume_generation(self):
        pass

    async def reset_prefix_cache(self, **kw):
        pass

    def __init__(self, workers):
        self.workers, self.calls = workers, []

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        return [getattr(w, method)(**(kwargs or {})) for w in self.workers]

    async def remove_lora(self, lora_id):
        self.calls.append("remove_lora")
        return all([w.remove_lora(lora_id) for w in self.workers if hasattr(w, "remove_lora")])


class PausingLLMDouble(LLMDouble):
    """LLMDouble that remembers whether vLLM's scheduler is paused."""

    paused = False

    async def pause_generation(self, **kw):
        self.paused = True

    async def resume_generation(self):
        self.paused = False


def engine_of(*workers) -> PolicyEngine:
    engine = PolicyEngine.__new__(PolicyEngine)  # no vLLM
    engine.version, engine._llm, engine._reload_lock = 1, LLMDouble(workers), asyncio.Lock()
    engine._weights_epoch = 0
    engine.settings = EngineSettings(model="double")
    return engine


def test_a_receive_that_breaks_passes_and_a_mismatch_refuses(monkeypatch):
    nccl = registry.TRANSPORTS["nccl"]

    def broken(wv, state):
        raise WeightUnavailable("receiving from learner:29600 failed: Connection reset by peer")

    monkeypatch.setattr(type(nccl), "receive", lambda self, wv, state: broken(wv, state))
    assert WorkerDouble().parley_load_gpu(announcement()) == (
        UNAVAILABLE,
        "version 2: receiving from learner:29600 failed: Connection reset by peer",
    )
    engine = engine_of(WorkerDouble())
    with pytest.raises(WeightUnavailable, match="Connection reset"):
        asyncio.run(engine.load_gpu(announcement(), hold_s=5.0, version=2))
    assert engine.version == 1

    monkeypatch.setattr(
        type(nccl), "receive", lambda self, wv, state, own=False: ([], "checksum mismatch in 1 of 1 tensors")
    )
    assert WorkerDouble().parley_load_gpu(announcement()) == (REFUSED, "version 2: checksum mismatch in 1 of 1 tensors")
    with pytest.raises(WeightVerifyError, match="checksum mismatch"):
        asyncio.run(engine_of(WorkerDouble()).load_gpu(announcement(), hold_s=5.0, version=2))


def test_one_workers_mismatch_refuses_whatever_the_others_say():
    class Says(WorkerExtension):
        def __init__(self, said):
            self.said = said

        def parley_load_gpu(self, announcement):
            return self.said

    engine = engine_of(
        Says((UNAVAILABLE, "version 2: out of memory")), Says(None), Says((REFUSED, "version 2: checksum mismatch"))
    )
    with pytest.raises(WeightVerifyError, match="checksum mismatch"):
        asyncio.run(engine.load_gpu(announcement(), hold_s=5.0, version=2))


def test_the_nccl_transport_says_a_broken_receive_passes(monkeypatch):
    class Gone:
        def fetch(self, source, version, device):
            raise RuntimeError("Connection closed by peer")

    with pytest.raises(WeightUnavailable, match="receiving from learner:29600 failed: Connection closed"):
        registry.TRANSPORTS["nccl"].receive(codec.decode("weights", announcement()), {"nccl": Gone()})


def test_the_checksum_is_prepared_once_before_the_first_load_outside_its_time_bound(monkeypatch):
    """PolicyEngine.load_gpu asks every worker to choose (on CUDA: compile and check) its checksum
    before the first load, not inside the hold-time-bounded load: a first compile of a second or two
    would otherwise eat a short hold (gpu-1.toml: 2 s)."""
    nccl = registry.TRANSPORTS["nccl"]
    monkeypatch.setattr(
        type(nccl), "receive", lambda self, wv, state, own=False: ([], "checksum mismatch in 1 of 1 tensors")
    )
    engine = engine_of(WorkerDouble())
    for _ in range(2):
        with pytest.raises(WeightVerifyError):
            asyncio.run(engine.load_gpu(announcement(), hold_s=5.0, version=2))
    assert engine._llm.calls == ["parley_prepare_gpu_load", "parley_load_gpu", "parley_load_gpu"]


def test_an_adapter_from_a_gpu_buffer_that_fails_changes_nothing_served(monkeypatch):
    """PolicyEngine.load_adapter_gpu through the worker's parley_stage_adapter: a receive that breaks
    raises WeightUnavailable (tried again), a mismatch WeightVerifyError (refused), an announcement
    without an adapter is refused; each time the staged id is dropped again and no adapter is added.
    The receive is replaced; test doubles for AsyncLLM and the worker."""
    import msgspec

    from parley.protocol.messages import LoraAdapter

    nccl = registry.TRANSPORTS["nccl"]
    plain = codec.decode("weights", announcement())
    adapter = codec.encode(msgspec.structs.replace(plain, adapter=LoraAdapter(base="b", rank=4, config="{}")))

    def engine():
        e = engine_of(WorkerDouble())
        e.adapters, e._users, e._staged, e._next_lora_id = {}, {}, set(), 1
        return e

    def broken(wv, state):
        raise WeightUnavailable("receiving from learner:29600 failed: Connection reset by peer")

    monkeypatch.setattr(type(nccl), "receive", lambda self, wv, state, own=False: broken(wv, state))
    e = engine()
    with pytest.raises(WeightUnavailable, match="Connection reset"):
        asyncio.run(e.load_adapter_gpu(adapter, 2, hold_s=5.0))
    assert e._llm.calls == ["parley_prepare_gpu_load", "parley_stage_adapter", "remove_lora", "parley_unstage_adapter"]
    assert not e.adapters and e.version == 1

    monkeypatch.setattr(
        type(nccl), "receive", lambda self, wv, state, own=False: ([], "checksum mismatch in 1 of 1 tensors")
    )
    e = engine()
    with pytest.raises(WeightVerifyError, match="checksum mismatch"):
        asyncio.run(e.load_adapter_gpu(adapter, 2, hold_s=5.0))
    assert not e.adapters and not e._staged
    assert WorkerDouble().parley_stage_adapter(1, announcement=announcement())[0] == REFUSED  # whole weights


def test_an_adapter_is_staged_and_added_in_one_rpc_and_a_failed_add_leaves_nothing_staged():
    """parley_stage_adapter with lora_name adds the staged adapter to the worker's LoRA manager
    itself (what vLLM's add_lora RPC would do), so the engine makes one RPC; when the add fails the
    worker drops the staged tensors and the engine removes what any worker may have added. Test
    doubles for the worker's LoRA manager and AsyncLLM."""
    import types

    import torch
    from safetensors.torch import save

    class AddingWorker(WorkerExtension):
        def __init__(self, accept):
            self.accept, self.added, self.removed = accept, [], []
            self.model_runner = types.SimpleNamespace(lora_manager=types.SimpleNamespace(_load_adapter=None))

        def add_lora(self, request):
            self.added.append((request.lora_name, request.lora_int_id, request.lora_path))
            return self.accept

        def remove_lora(self, lora_id):
            self.removed.append(lora_id)
            return False

    blob = save({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 4)})
    ok, refusing = AddingWorker(True), AddingWorker(False)
    e = engine_of(ok, refusing)
    e.adapters, e._users, e._staged, e._next_lora_id = {}, {}, set(), 1
    with pytest.raises(RuntimeError, match="did not add adapter v3-1"):
        asyncio.run(e.load_adapter_tensors({"x": torch.zeros(2)}, {"r": 2}, 3))
    assert e._llm.calls == ["parley_stage_adapter", "remove_lora", "parley_unstage_adapter"]
    assert ok.added == refusing.added == [("v3-1", 1, "/parley/staged-adapter/1")] and ok.removed == [1]
    assert not ok._parley_adapters and not refusing._parley_adapters and not e.adapters and e.version == 1

    e = engine_of(ok)
    e.adapters, e._users, e._staged, e._next_lora_id = {}, {}, set(), 7
    asyncio.run(e._stage_adapter(4, None, tensors=blob, config="{}"))
    assert e._llm.calls == ["parley_stage_adapter"]  # staged and added: nothing else
    assert ok.added[-1] == ("v4-7", 7, "/parley/staged-adapter/7") and list(ok._parley_adapters) == [7]
    assert e.version == 4 and e.adapters[4].lora_int_id == 7 and e._staged == {7}


def test_a_replaced_adapter_is_removed_after_the_new_one_serves_and_before_the_next_load():
    """The adapter a new version replaces (and older ones no conversation uses) leave `adapters` at
    once, while their removal RPCs run in the background, off the new version's path to serving; the
    next load waits for them, so vLLM never holds more adapters than max_loras allowed before. A pinned
    version stays. Test doubles for vLLM (the removal held until released)."""

    class LoraLLMDouble(LLMDouble):
        def __init__(self):
            super().__init__([])
            self.release = asyncio.Event()

        async def add_lora(self, request):
            self.calls.append(f"add {request.lora_int_id}")
            return True

        async def remove_lora(self, lora_id):
            await self.release.wait()
            self.calls.append(f"remove {lora_id}")

    async def main():
        e = engine_of()
        e._llm = llm = LoraLLMDouble()
        e.adapters, e._users, e._staged, e._next_lora_id = {}, {}, set(), 1
        await e.load_adapter("/a1", 1)
        e.pin(1)  # a conversation started on version 1
        await e.load_adapter("/a2", 2)
        await e.load_adapter("/a3", 3)  # replaces 2; 1 is pinned
        assert set(e.adapters) == {1, 3} and e.version == 3
        assert llm.calls == ["add 1", "add 2", "add 3"]  # 3 served before 2's removal ran
        load4 = asyncio.ensure_future(e.load_adapter("/a4", 4))
        await asyncio.sleep(0.05)
        assert not load4.done() and "add 4" not in llm.calls  # the next load waits for the removal
        llm.release.set()
        await load4
        assert llm.calls[:5] == ["add 1", "add 2", "add 3", "remove 2", "add 4"]
        await e._settled()
        assert llm.calls[5:] == ["remove 3"] and set(e.adapters) == {1, 4}

    asyncio.run(main())


def test_a_load_that_fails_half_way_keeps_generation_paused_until_a_whole_version_is_loaded():
    """A worker that raises mid-load may have changed weights: vLLM's scheduler stays paused (requests
    kept across the load wait) rather than generate tokens of a mixed model stamped with the old
    version, through a load that is refused (nothing changed, still mixed), until a whole version is
    loaded (the follower loads the new one once more or puts the served one back). A load that fails
    before changing anything resumes at once, as before. Test doubles for AsyncLLM and the worker."""

    class Worker(WorkerExtension):
        said: list = []

        def parley_load_gpu(self, announcement):
            said = self.said.pop(0)
            if isinstance(said, Exception):
                raise said
            return said

    worker = Worker()
    engine = engine_of(worker)
    engine._llm = llm = PausingLLMDouble([worker])
    worker.said = [(REFUSED, "version 2: checksum mismatch"), RuntimeError("CUDA error: illegal memory access")]
    worker.said += [(REFUSED, "version 1: checksum mismatch"), None]

    async def go():
        with pytest.raises(WeightVerifyError):  # nothing changed: generation goes on
            await engine.load_gpu(announcement(2), hold_s=5.0, version=2)
        assert not llm.paused and engine.version == 1
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await engine.load_gpu(announcement(2), hold_s=5.0, version=2)
        assert llm.paused and engine.version == 1  # mixed: no token until a whole version is in
        with pytest.raises(WeightVerifyError):
            await engine.load_gpu(announcement(1), hold_s=5.0, version=1)
        assert llm.paused
        await engine.load_gpu(announcement(2), hold_s=5.0, version=2)
        assert not llm.paused and engine.version == 2

    asyncio.run(go())


def test_a_file_reload_that_fails_half_way_keeps_generation_paused_until_one_succeeds():
    """The same for a version loaded from files (reload_weights; the follower reloads the served files
    next). Test doubles for AsyncLLM and the worker."""

    class Worker(WorkerExtension):
        fail = True

        def parley_reload_weights(self, weights_path):
            if self.fail:
                raise RuntimeError("size mismatch for model.embed_tokens.weight")

    worker = Worker()
    engine = engine_of(worker)
    engine._llm = llm = PausingLLMDouble([worker])

    async def go():
        with pytest.raises(RuntimeError, match="size mismatch"):
            await engine.reload_weights("/w/v2", version=2)
        assert llm.paused and engine.version == 1
        worker.fail = False
        await engine.reload_weights("/w/v1", version=1)
        assert not llm.paused and engine.version == 1

    asyncio.run(go())
