"""Delta versions over the file transports against a real nats-server: the learner's publication
(weights.publish.Weights) sends v1 full and v2..v4 as deltas, an actor's WeightFollower
rebuilds each from the version it serves and serves it only when the result is the full file bit
for bit; without the base, or with a bad delta, it fetches the full version and its served files
are never written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from nats.js.errors import NotFoundError

from parley.learner.service import weights_publication
from parley.protocol import topology
from parley.protocol.bus import COUNTERS
from parley.weights import delta as deltas
from parley.weights.common import CONFIG_FILE, MODEL_FILE, WeightUnavailable, current_version, file_digest
from parley.weights.config import ObjstoreWeights, SharedDirWeights
from parley.weights.follow import WeightFollower
from parley.weights.publish import Publisher

pytestmark = pytest.mark.integration
RUN = "dtest"
SHAPES = {
    "model.embed_tokens.weight": (512, 256),
    "model.layers.0.mlp.up_proj.weight": (256, 512),
    "model.norm.weight": (256,),
}


class Learner:
    """An fp32 master taking Adam-like steps (lr * sign(noise) per weight), saved as bf16 like the
    learner's snapshot: most bf16 values do not change from one version to the next."""

    def __init__(self, seed: int = 0):
        import torch

        self.g = torch.Generator().manual_seed(seed)
        self.master = {n: torch.randn(s, generator=self.g) * 0.02 for n, s in SHAPES.items()}

    def step(self, lr: float) -> None:
        import torch

        for t in self.master.values():
            t += lr * torch.sign(torch.randn(t.shape, generator=self.g))

    def write(self, d: Path) -> Path:
        import torch
        from safetensors.torch import save_file

        d.mkdir(parents=True, exist_ok=True)
        save_file(
            {n: t.to(torch.bfloat16) for n, t in self.master.items()}, str(d / MODEL_FILE), metadata={"format": "pt"}
        )
        (d / CONFIG_FILE).write_text(json.dumps({"model_type": "llama"}))
        return d


class Snap:  # weights.snapshot.WeightSnapshot, already written
    def write(self, d):
        return d


class EngineDouble:
    def __init__(self):
        self.version, self.loads = 0, []

    async def reload_weights(self, path, version):
        self.loads.append((version, file_digest(Path(path) / MODEL_FILE)[0]))
        self.version = version


def learner_weights(js, tmp_path, settings, keep=3):
    lc = SimpleNamespace(keep_versions=keep)
    feeder = SimpleNamespace(set_version=lambda v: None)
    return weights_publication(lc, settings, js, None, RUN, tmp_path / "run", None, Publisher(), feeder)


SETTINGS = {
    "objstore": lambda tmp: ObjstoreWeights(full_every=4),
    "shared_dir": lambda tmp: SharedDirWeights(dir=str(tmp / "shared"), full_every=4),
}


@pytest.mark.parametrize("kind", SETTINGS)
async def test_a_delta_chain_reproduces_each_full_version_bit_for_bit(js, tmp_path, kind):
    await topology.ensure_topology(js, RUN)
    settings = SETTINGS[kind](tmp_path)
    pub, learner = learner_weights(js, tmp_path, settings), Learner()
    engine = EngineDouble()
    follower = WeightFollower(js, RUN, engine, dest_root=tmp_path / "actor", settings=settings)
    applied = COUNTERS["weights.delta_applied"]
    announced = []
    for v in range(1, 6):
        learner.step(1e-6)
        wdir = learner.write(tmp_path / "run" / "learner" / "weights" / f"v{v:06d}")
        await pub.payload.upload(pub, v, Snap(), wdir)
        wv = await current_version(js, RUN)
        announced.append(wv)
        assert await follower.check()
        assert engine.loads[-1] == (v, file_digest(wdir / MODEL_FILE)[0])  # bit for bit: the learner's file
    assert [wv.delta is not None for wv in announced] == [False, True, True, True, False]  # full_every = 4
    assert [wv.delta.base_version for wv in announced[1:4]] == [1, 2, 3]
    assert all(wv.delta.bytes < 0.1 * wv.bytes for wv in announced[1:4]), [wv.delta.bytes for wv in announced[1:4]]
    assert COUNTERS["weights.delta_applied"] - applied == 3
    served = follower.served_dir
    assert served.is_relative_to(tmp_path / "actor") or kind == "shared_dir"
    assert json.loads((served / CONFIG_FILE).read_text()) == {"model_type": "llama"}
    # only the served version is kept on the actor's disk
    assert len(list((tmp_path / "actor").iterdir())) <= 1


async def test_an_actor_without_the_base_fetches_the_full_version(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    settings = ObjstoreWeights(full_every=10)
    pub, learner = learner_weights(js, tmp_path, settings), Learner()
    for v in (1, 2):
        learner.step(1e-5)
        await pub.payload.upload(pub, v, Snap(), learner.write(tmp_path / "run" / "learner" / "weights" / f"v{v:06d}"))
    wv = await current_version(js, RUN)
    assert wv.delta is not None and wv.delta.base_version == 1
    want = file_digest(tmp_path / "run" / "learner" / "weights" / "v000002" / MODEL_FILE)[0]

    # a new actor (serving its start checkpoint, of no known digest)
    fresh = EngineDouble()
    no_base = COUNTERS["weights.delta_no_base"]
    assert await WeightFollower(js, RUN, fresh, dest_root=tmp_path / "fresh", settings=settings).check()
    assert fresh.loads == [(2, want)] and COUNTERS["weights.delta_no_base"] == no_base + 1

    # an actor that served version 1 but lost its files
    lost = EngineDouble()
    follower = WeightFollower(js, RUN, lost, dest_root=tmp_path / "lost", settings=settings)
    v1 = msgspec.structs.replace(wv, version=1, sha256=wv.delta.base_sha256, delta=None)
    follower.serving, follower.served_dir = (1, v1.sha256), tmp_path / "lost" / "gone"
    assert await follower.check()
    assert lost.loads == [(2, want)] and COUNTERS["weights.delta_no_base"] == no_base + 2


async def test_a_corrupted_delta_is_refused_with_the_served_weights_untouched(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    settings = ObjstoreWeights(full_every=10)
    pub, learner = learner_weights(js, tmp_path, settings), Learner()
    wdirs = {}
    engine = EngineDouble()
    follower = WeightFollower(js, RUN, engine, dest_root=tmp_path / "actor", settings=settings)
    learner.step(1e-5)
    wdirs[1] = learner.write(tmp_path / "run" / "learner" / "weights" / "v000001")
    await pub.payload.upload(pub, 1, Snap(), wdirs[1])
    assert await follower.check()
    served = follower.served_dir / MODEL_FILE
    served_sha = file_digest(served)[0]

    learner.step(1e-5)
    wdirs[2] = learner.write(tmp_path / "run" / "learner" / "weights" / "v000002")
    await pub.payload.upload(pub, 2, Snap(), wdirs[2])
    wv = await current_version(js, RUN)
    store = await js.object_store(topology.object_bucket(RUN))
    # A delta that is well formed and says it rebuilds version 2, but rebuilds other weights: only the
    # digest of the result can tell. Stored in place of the real one, announced with its own sha256.
    other = Learner(seed=7).write(tmp_path / "other")
    forged = tmp_path / "forged.delta"
    size = deltas.build(served, other / MODEL_FILE, forged, wv.delta.base_sha256, wv.sha256)
    await store.put(wv.delta.location, forged.read_bytes())
    lie = msgspec.structs.replace(
        wv, delta=msgspec.structs.replace(wv.delta, sha256=file_digest(forged)[0], bytes=size)
    )
    refused = COUNTERS["weights.delta_refused"]
    path = await follower.fetch(
        js, RUN, lie, tmp_path / "actor" / "v2", settings=settings, base=(served_sha, served.parent)
    )
    assert COUNTERS["weights.delta_refused"] == refused + 1  # refused, then the full version fetched
    assert file_digest(path / MODEL_FILE)[0] == file_digest(wdirs[2] / MODEL_FILE)[0]
    assert file_digest(served)[0] == served_sha  # the served file was never written

    # The announced delta, now not matching its announced sha256, and the full copy gone too: the
    # version is refused and the actor serves version 1 from the same, unchanged files.
    await store.delete(wv.location)
    assert not await follower.check()
    assert 2 in follower.refused and engine.version == 1 and follower.served_dir == served.parent
    assert COUNTERS["weights.delta_refused"] == refused + 2
    assert file_digest(served)[0] == served_sha


async def test_no_delta_when_it_is_over_delta_max_share(js, tmp_path):
    """fp32 weights (the CPU learner's): every value moves by lr, far above its fp32 step, so the
    delta is larger than the file and the version goes out full only."""
    import torch
    from safetensors.torch import save_file

    await topology.ensure_topology(js, RUN)
    pub, learner = learner_weights(js, tmp_path, ObjstoreWeights(full_every=10)), Learner()
    for v in (1, 2):
        learner.step(1e-6)
        d = tmp_path / "run" / "learner" / "weights" / f"v{v:06d}"
        d.mkdir(parents=True)
        save_file({n: t.to(torch.float32) for n, t in learner.master.items()}, str(d / MODEL_FILE))
        (d / CONFIG_FILE).write_text("{}")
        await pub.payload.upload(pub, v, Snap(), d)
    assert (await current_version(js, RUN)).delta is None


class HeldUpload:
    """Holds the objstore transport's model upload until `release()`: a test double of a slow upload
    only (the real upload runs after), so what an actor does meanwhile can be checked."""

    def __init__(self, monkeypatch):
        from parley.weights import registry

        transport = registry.get("objstore")
        real, self.gate, self.started = transport.upload_model, asyncio.Event(), asyncio.Event()

        async def upload(*args, **kwargs):
            self.started.set()
            await self.gate.wait()
            return await real(*args, **kwargs)

        monkeypatch.setattr(transport, "upload_model", upload)

    def release(self) -> None:
        self.gate.set()


async def _early_v2(js, tmp_path, monkeypatch, lr=1e-6):
    """v1 published full and served by an actor; v2 published with its full upload held. Returns
    (follower, engine, v2's learner dir, the publication task, the held upload)."""
    await topology.ensure_topology(js, RUN)
    settings = ObjstoreWeights(full_every=10)
    pub, learner = learner_weights(js, tmp_path, settings), Learner()
    engine = EngineDouble()
    follower = WeightFollower(js, RUN, engine, dest_root=tmp_path / "actor", settings=settings)
    learner.step(lr)
    await pub.payload.upload(pub, 1, Snap(), learner.write(tmp_path / "run" / "learner" / "weights" / "v000001"))
    assert await follower.check() and engine.version == 1
    held = HeldUpload(monkeypatch)
    learner.step(lr)
    wdir = learner.write(tmp_path / "run" / "learner" / "weights" / "v000002")
    task = asyncio.create_task(pub.payload.upload(pub, 2, Snap(), wdir))
    await asyncio.wait_for(held.started.wait(), 10)  # the delta is stored and announced early by now
    return follower, engine, wdir, task, held


async def test_an_actor_with_the_base_serves_a_delta_version_before_its_full_copy_exists(js, tmp_path, monkeypatch):
    follower, engine, wdir, task, held = await _early_v2(js, tmp_path, monkeypatch)
    try:
        early = await follower._read()
        assert early.version == 2 and early.full_pending and early.delta is not None
        store = await js.object_store(topology.object_bucket(RUN))
        with pytest.raises(NotFoundError):
            await store.get_info(early.location)  # no full copy yet
        # what older actors read (WEIGHTS_KEY) still names version 1: they never see a missing file
        assert (await current_version(js, RUN)).version == 1
        assert await follower.check()
        assert engine.loads[-1] == (2, file_digest(wdir / MODEL_FILE)[0])
        assert not task.done()  # the learner's publication is still uploading the full copy
    finally:
        held.release()
        await asyncio.wait_for(task, 30)
    wv = await current_version(js, RUN)
    assert (wv.version, wv.sha256, wv.full_pending) == (2, early.sha256, False)
    await store.get_info(wv.location)
    assert not await follower.check()  # the same version, served already: nothing to do


async def test_an_actor_without_the_base_gets_the_full_copy_of_an_early_version_once_uploaded(
    js, tmp_path, monkeypatch
):
    _, _, wdir, task, held = await _early_v2(js, tmp_path, monkeypatch)
    fresh = EngineDouble()
    follower = WeightFollower(js, RUN, fresh, dest_root=tmp_path / "fresh", settings=ObjstoreWeights(full_every=10))
    check = asyncio.create_task(follower.check())
    try:
        await asyncio.sleep(1.0)
        assert not check.done() and fresh.loads == []  # waiting for the full copy, not refused
    finally:
        held.release()
    assert await asyncio.wait_for(check, 30)
    assert fresh.loads == [(2, file_digest(wdir / MODEL_FILE)[0])] and not follower.refused
    await asyncio.wait_for(task, 30)


async def test_the_wait_for_an_early_full_copy_is_bounded_and_not_a_refusal(js, tmp_path, monkeypatch):
    from parley.weights import registry

    _, _, wdir, task, held = await _early_v2(js, tmp_path, monkeypatch)
    monkeypatch.setattr(registry, "full_wait_s", lambda nbytes: 0.5)
    fresh = EngineDouble()
    follower = WeightFollower(js, RUN, fresh, dest_root=tmp_path / "fresh", settings=ObjstoreWeights(full_every=10))
    early = await follower._read()
    with pytest.raises(WeightUnavailable, match="was not stored within"):
        await registry.fetch_version(js, RUN, early, tmp_path / "fresh" / "x", settings=follower.settings)
    assert not await follower.check()  # tried, timed out, not refused: tried again later
    assert not follower.refused and fresh.loads == []
    held.release()
    await asyncio.wait_for(task, 30)
    assert await follower.check() and fresh.loads == [(2, file_digest(wdir / MODEL_FILE)[0])]


async def test_a_corrupted_early_delta_is_refused_and_the_full_copy_served_once_uploaded(js, tmp_path, monkeypatch):
    follower, engine, wdir, task, held = await _early_v2(js, tmp_path, monkeypatch, lr=1e-5)
    served = follower.served_dir / MODEL_FILE
    served_sha = file_digest(served)[0]
    early = await follower._read()
    store = await js.object_store(topology.object_bucket(RUN))
    await store.put(early.delta.location, b"PARLEYD1 not a delta")  # its sha256 no longer the announced one
    refused = COUNTERS["weights.delta_refused"]
    check = asyncio.create_task(follower.check())
    try:
        await asyncio.sleep(1.0)
        assert COUNTERS["weights.delta_refused"] == refused + 1 and not check.done()
        assert engine.version == 1 and file_digest(served)[0] == served_sha  # served weights untouched
    finally:
        held.release()
    assert await asyncio.wait_for(check, 30)
    assert engine.loads[-1] == (2, file_digest(wdir / MODEL_FILE)[0])
    assert not served.exists()  # the old version removed only after the new one was served
    await asyncio.wait_for(task, 30)
