"""Weight publication off the training path: the real Learner, its Publisher and the real
weights.registry.publish_version on a real nats-server, with a test-double trainer and actor (as in
test_learner_fates) and a slow transport double: the object store's upload of a chosen version waits
until the test lets it go. Shown: the next step starts before the previous version's upload ends;
with steps faster than uploads at most one upload runs, a version overtaken while waiting is never
uploaded nor announced, the newest is; each version's sha256 is computed once; a stop during an
upload lets it finish and announce."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest

from parley.protocol import codec, topology
from parley.weights.common import current_version
from parley.weights.config import ObjstoreWeights, SharedDirWeights
from tests.integration.test_learner_fates import BUS, ActorDouble, TrainerDouble, base_model, make_cfg

pytestmark = [pytest.mark.integration]


class SlowUploads:
    """Test double around the object store's real upload (weights.objstore._put_object, installed
    with monkeypatch): the upload of a version's model.safetensors first awaits `gate(version)`;
    uploads are timed and their concurrency counted."""

    def __init__(self, monkeypatch, gate):
        from parley.weights import objstore

        self.gate = gate
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.running = self.max_running = 0
        real = objstore._put_object

        async def put(js, run, name, data):
            if not name.endswith("/model.safetensors"):
                return await real(js, run, name, data)
            version = int(name[1:7])
            self.started[version] = time.monotonic()
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            try:
                await self.gate(version)
                return await real(js, run, name, data)
            finally:
                self.running -= 1
                self.ended[version] = time.monotonic()

        monkeypatch.setattr(objstore, "_put_object", put)


class TimedTrainer(TrainerDouble):
    """TrainerDouble that notes when each train_step begins (event k: step k began)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.began: list[float] = []
        self.step_began = [threading.Event() for _ in range(8)]

    def __call__(self, op, *args):
        if op == "train_step":
            self.began.append(time.monotonic())
            self.step_began[len(self.began)].set()
        return super().__call__(op, *args)


async def key_history(js, run: str, key: str) -> list[bytes]:
    """Every value the run's KV holds for `key`, oldest first, read from the bucket's stream one message
    at a time (direct get, next by subject). Not nats.py's KeyValue.history: its watcher can put the
    "no more" marker ahead of entries the server has already sent when the client is slow, and then
    answers NoKeysError for a key with values (CI, 2026-12-05, on a loaded machine)."""
    from nats.js.errors import NotFoundError

    bucket = topology.kv_bucket(run)
    values, seq = [], 1
    while True:
        try:
            msg = await js.get_msg(f"KV_{bucket}", seq=seq, subject=f"$KV.{bucket}.{key}", next=True)
        except NotFoundError:
            return values
        if msg.data:  # a delete or purge marker has none
            values.append(msg.data)
        seq = msg.seq + 1


async def announced(js, run: str) -> list[int]:
    return [codec.decode("weights", v).version for v in await key_history(js, run, topology.WEIGHTS_KEY)]


async def run_learner(js, nc, cfg, trainer, transport, stop: asyncio.Event | None = None, tmp_path=None):
    from parley.learner.service import Learner

    learner = Learner(
        cfg, transport, nc, trainer, model_dir=base_model(cfg.run_dir.parent), resume=False, steps=cfg.learner.steps
    )
    halt = asyncio.Event()
    worker = ActorDouble(js, cfg.run.name, lambda i: "answer").start(halt)
    try:
        code = await asyncio.wait_for(learner.run(stop or asyncio.Event()), timeout=120)
    finally:
        halt.set()
        await asyncio.gather(worker, return_exceptions=True)
    assert code == 0
    return learner


async def test_the_next_step_starts_before_the_upload_ends(js, nc, tmp_path, monkeypatch):
    run = "overlap"
    cfg = make_cfg(run, tmp_path / "run", steps=2, groups_per_step=1, max_staleness=1)
    await topology.ensure_topology(js, run, BUS)
    trainer = TimedTrainer()

    async def gate(version):
        if version == 1:  # version 1's upload lasts until step 2 has begun (20 s at most)
            await asyncio.to_thread(trainer.step_began[2].wait, 20)

    slow = SlowUploads(monkeypatch, gate)
    await run_learner(js, nc, cfg, trainer, js)
    assert len(trainer.began) == 2
    assert trainer.began[1] < slow.ended[1], "step 2 waited for version 1's upload"
    assert slow.max_running == 1
    assert await announced(js, run) == [0, 1, 2]


async def test_a_version_overtaken_while_waiting_is_never_announced(js, nc, tmp_path, monkeypatch):
    run = "supersede"
    run_dir = tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=3, groups_per_step=1, max_staleness=2)
    await topology.ensure_topology(js, run, BUS)
    box = []

    async def gate(version):
        if version == 1:  # slow: versions 2 and 3 are both taken while version 1 uploads
            t0 = time.monotonic()
            while (
                not (
                    box
                    and box[0].state.step == 3
                    and box[0].publisher.waiting is not None
                    and box[0].publisher.waiting.version == 3
                )
                and time.monotonic() - t0 < 30
            ):
                await asyncio.sleep(0.05)

    slow = SlowUploads(monkeypatch, gate)
    from parley.learner.service import Learner

    learner = Learner(cfg, js, nc, TrainerDouble(), model_dir=base_model(tmp_path), resume=False, steps=3)
    box.append(learner)
    halt = asyncio.Event()
    worker = ActorDouble(js, run, lambda i: "answer").start(halt)
    try:
        assert await asyncio.wait_for(learner.run(asyncio.Event()), timeout=120) == 0
    finally:
        halt.set()
        await asyncio.gather(worker, return_exceptions=True)

    assert sorted(slow.started) == [0, 1, 3]  # version 2 was never uploaded
    assert slow.max_running == 1
    assert await announced(js, run) == [0, 1, 3]
    assert (await current_version(js, run)).version == 3
    assert learner.publisher.superseded == [2]
    beat = learner.heartbeat().counters
    assert beat["weights.superseded"] == 1.0 and beat["weights.published"] == 3.0  # 0, 1, 3
    weights = run_dir / "learner" / "weights"
    assert not (weights / "v000002").exists() and (weights / "v000003" / "model.safetensors").is_file()


class RealWeightsTrainer(TrainerDouble):
    """TrainerDouble whose snapshots are real weights.snapshot.WeightSnapshot (safetensors files)."""

    def __call__(self, op, *args):
        if op == "weights_snapshot":
            import torch

            from parley.weights.snapshot import WeightSnapshot

            n = sum(c == "train_step" for c in self.calls)
            self.calls.append(op)
            return WeightSnapshot(
                {"w": torch.full((256, 256), float(n)), "b": torch.arange(64.0) + n}, '{"model_type": "double"}'
            )
        return super().__call__(op, *args)


@pytest.mark.parametrize(
    "make",
    [lambda shared: ObjstoreWeights(), lambda shared: SharedDirWeights(dir=str(shared))],
    ids=["objstore", "shared_dir"],
)
async def test_each_version_is_hashed_once(js, nc, tmp_path, monkeypatch, make):
    import nats.js.object_store

    digests: list[tuple[bytes, int]] = []  # (digest, bytes hashed) of every sha256 computed

    class CountingSha256:
        """Test double for hashlib.sha256 (where weights/ and nats.py's object store take it: the
        upload, weights.objstore._put_object, hashes through hashlib)."""

        def __init__(self, data=b""):
            self._h, self._n = real(), 0
            self.update(data)

        def update(self, data):
            self._n += len(data)
            self._h.update(data)

        def digest(self):
            digests.append((self._h.digest(), self._n))
            return self._h.digest()

        def hexdigest(self):
            return self.digest().hex()

    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", CountingSha256)
    monkeypatch.setattr(nats.js.object_store, "sha256", CountingSha256)

    settings = make(tmp_path / "shared")
    run = f"hash-{type(settings).__name__.lower()}"
    cfg = make_cfg(run, tmp_path / "run", steps=3, groups_per_step=1, max_staleness=1)
    cfg.weights = settings  # [weights], which the learner and the actors read
    await topology.ensure_topology(js, run, BUS)
    await run_learner(js, nc, cfg, RealWeightsTrainer(), js)

    versions = [codec.decode("weights", v) for v in await key_history(js, run, topology.WEIGHTS_KEY)]
    assert [wv.version for wv in versions] == [0, 1, 2, 3]
    assert len({wv.sha256 for wv in versions}) == 4  # different weights per step
    for wv in versions:
        computed = [n for d, n in digests if d.hex() == wv.sha256]
        assert computed == [wv.bytes], f"version {wv.version}: sha256 computed {len(computed)} times"


async def test_a_stop_during_an_upload_lets_it_finish_and_announce(js, nc, tmp_path, monkeypatch):
    """SIGTERM sets the stop event: the step ends, the upload under way finishes, its version is announced."""
    run = "stopping"
    cfg = make_cfg(run, tmp_path / "run", steps=0, groups_per_step=1, max_staleness=0)  # steps=0: forever
    await topology.ensure_topology(js, run, BUS)
    stop = asyncio.Event()

    async def gate(version):
        if version == 1:
            stop.set()  # the stop comes while version 1 uploads
            await asyncio.sleep(1.0)

    SlowUploads(monkeypatch, gate)
    learner = await run_learner(js, nc, cfg, TrainerDouble(), js, stop=stop)
    assert learner.state.step == 1
    assert await announced(js, run) == [0, 1]
    assert learner.publisher.counters["published"] == 2


class PackedTrainer(TrainerDouble):
    """TrainerDouble with bf16 weights that change in a few values each step and a real
    weights.gpu_delta.PackedVersions behind pack_versions, its files written from the packed buffer
    (what Trainer.pack_versions does after its gather, on CPU tensors here)."""

    def __init__(self):
        import torch

        from parley.weights.gpu_delta import PackedVersions

        super().__init__(step_s=0.2)  # steps slower than these small uploads: few versions superseded
        gen = torch.Generator().manual_seed(0)
        self.w = (torch.randn(256, 256, generator=gen) * 0.02).to(torch.bfloat16)
        self.b = torch.ones(64, dtype=torch.bfloat16)
        self.gen, self.packed = gen, PackedVersions()

    def __call__(self, op, *args):
        import torch

        from parley.weights.snapshot import PackedSnapshot, WeightSnapshot

        if op == "train_step":
            flat = self.w.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=self.gen)
            flat[idx] = (flat[idx].float() * 1.01).to(torch.bfloat16)  # 2% of the values, a step or two each
        if op == "pack_versions":
            self.calls.append(op)
            table, pending = self.packed.pack([("w", self.w), ("b", self.b)], *args)
            return table, PackedSnapshot(pending, '{"model_type": "double"}')
        if op == "weights_snapshot":  # the learner's own first version (v0) is not packed this way
            self.calls.append(op)
            return WeightSnapshot({"w": self.w.clone(), "b": self.b.clone()}, '{"model_type": "double"}')
        return super().__call__(op, *args)


@pytest.mark.parametrize("kind", ["objstore", "shared_dir"])
async def test_packed_deltas_are_announced_early_and_chain_to_the_full_versions(js, nc, tmp_path, kind):
    """[weights] delta_format = "packed", full_every = 3 through the real Learner and publish_version:
    every announcement carries its version's packed table; the two versions after each full-only one
    (v0, the learner's start, and v3) also go out as a packed delta against the version before (on the
    object store announced on the early key before their full copy is stored, under their table's
    digest; shared_dir has no early announcement); each delta, applied to a packed copy of the base's
    full file, gives the next version's table; one version in three is full only."""
    from safetensors.torch import load_file

    from parley.weights import registry
    from parley.weights.cuda_ipc import table_digest
    from parley.weights.gpu_delta import Mirror

    run = f"packedpub-{kind}"
    cfg = make_cfg(run, tmp_path / "run", steps=5, groups_per_step=1, max_staleness=1, keep_versions=10)
    cfg.weights = (
        ObjstoreWeights(full_every=3, delta_format="packed")
        if kind == "objstore"
        else SharedDirWeights(dir=str(tmp_path / "shared"), full_every=3, delta_format="packed")
    )
    settings, transport = cfg.weights, registry.of(cfg.weights)
    await topology.ensure_topology(js, run, BUS)
    await run_learner(js, nc, cfg, PackedTrainer(), js)

    final = {
        wv.version: wv for wv in (codec.decode("weights", v) for v in await key_history(js, run, topology.WEIGHTS_KEY))
    }
    early = [
        codec.decode("weights", v) for v in await key_history(js, run, topology.WEIGHTS_EARLY_KEY)
    ]  # none: shared_dir
    # a version overtaken while its upload waited is never announced (weights.publish), on a busy
    # machine now and then; the deltas are counted at packing, in step order, all the same
    assert 5 in final and len(final) >= 4
    assert all(wv.packed for wv in final.values())
    with_delta = sorted(v for v in final if final[v].delta is not None)
    assert with_delta == [v for v in sorted(final) if v in (1, 2, 4, 5)]  # v0: nothing before it; v3 full only
    assert [(e.version, e.sha256, e.full_pending) for e in early] == (
        [(v, table_digest(final[v].packed), True) for v in with_delta] if kind == "objstore" else []
    )
    checked = 0
    for v in with_delta:
        delta = final[v].delta
        assert (delta.format, delta.base_version) == ("packed", v - 1)
        if v - 1 not in final:
            continue  # its base was overtaken: actors fetch the full copy
        assert delta.base_sha256 == table_digest(final[v - 1].packed)
        checked += 1
        base_dir = await registry.fetch_version(js, run, final[v - 1], tmp_path / f"base{v}", settings=settings)
        blob = await transport.fetch_delta(js, run, final[v], tmp_path / f"delta{v}", settings)
        held = Mirror()
        held.fill(load_file(base_dir / "model.safetensors"), final[v - 1].packed, "cpu")
        held.apply(blob.read_bytes(), final[v].packed)  # checked against v's table inside
        full = load_file(
            await registry.fetch_version(js, run, final[v], tmp_path / f"full{v}", settings=settings)
            / "model.safetensors"
        )
        assert all(t.equal(full[n]) for n, t in held.named())
    assert checked >= 1


async def test_packed_format_without_deltas_packs_nothing(js, nc, tmp_path):
    """delta_format = "packed" with full_every = 1 (no deltas): nothing is packed on the learner and no
    announcement carries a packed table, so no actor keeps a packed copy (deploy.memory plans none)."""
    run = "packednodelta"
    cfg = make_cfg(run, tmp_path / "run", steps=2, groups_per_step=1, max_staleness=1)
    cfg.weights = ObjstoreWeights(full_every=1, delta_format="packed")
    await topology.ensure_topology(js, run, BUS)
    trainer = PackedTrainer()
    await run_learner(js, nc, cfg, trainer, js)
    announced = [codec.decode("weights", v) for v in await key_history(js, run, topology.WEIGHTS_KEY)]
    assert [wv.version for wv in announced][-1] == 2
    assert "pack_versions" not in trainer.calls and not any(wv.packed or wv.delta for wv in announced)
