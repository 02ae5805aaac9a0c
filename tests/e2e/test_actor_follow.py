"""The weight follower against a real nats-server and the real weight transport
(weights/), with a test-double engine: which announcements are loaded, refused, followed
back, and when the actor must stop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from parley.protocol import codec, topology
from parley.protocol.messages import WeightVersion
from parley.weights import common, registry
from parley.weights.config import ObjstoreWeights
from parley.weights.follow import GPU_ATTEMPTS, WeightFollower, WeightsBroken

pytestmark = pytest.mark.integration
RUN = "follow"
BUS = topology.BusSettings(max_bytes=64 << 20)


class ReloadEngineDouble:
    """Test double of PolicyEngine's weight side: records reloads, fails the next `fail` ones."""

    def __init__(self):
        self.version = 0
        self.reloads: list[tuple[str, int | None]] = []
        self.fail = 0

    async def reload_weights(self, path, version=None):
        self.reloads.append((Path(path).name[:7], version))  # "v000002" of "v000002-<sha>"
        if self.fail:
            self.fail -= 1
            raise RuntimeError("size mismatch for model.embed_tokens.weight")
        assert (Path(path) / common.MODEL_FILE).is_file()
        if version is not None:
            self.version = version


def state_dir(root: Path, tag: str) -> Path:
    d = root / tag
    d.mkdir()
    (d / common.MODEL_FILE).write_bytes(f"weights {tag} ".encode() * 1000)
    (d / common.CONFIG_FILE).write_text(json.dumps({"tag": tag}))
    return d


async def until(cond, timeout=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_follower_loads_refuses_follows_back_and_stops_when_broken(js, tmp_path):
    await topology.ensure_topology(js, RUN, BUS)
    engine = ReloadEngineDouble()
    f = WeightFollower(js, RUN, engine, dest_root=tmp_path / "fetched", poll_s=0.3, base_dir=tmp_path / "base")
    assert not await f.check()  # nothing announced yet

    wv1 = await registry.publish_version(js, RUN, 1, 10, state_dir(tmp_path, "a"), ObjstoreWeights())
    assert await f.check() and engine.version == 1
    fetched = tmp_path / "fetched" / f"v000001-{wv1.sha256[:12]}"
    assert (fetched / common.MODEL_FILE).read_bytes() == (tmp_path / "a" / common.MODEL_FILE).read_bytes()
    assert not await f.check()  # served already: nothing fetched again

    stop = asyncio.Event()
    runner = asyncio.create_task(f.run_until(stop))
    await registry.publish_version(js, RUN, 2, 20, state_dir(tmp_path, "b"), ObjstoreWeights())
    await until(lambda: engine.version == 2)
    assert not fetched.exists()  # only the served version is kept

    # a blob that does not match its announcement is refused, once, and v2 keeps serving
    kv = await js.key_value(topology.kv_bucket(RUN))
    bad = WeightVersion(
        version=3,
        step=30,
        transport="objstore",
        location=wv1.location,
        sha256="0" * 64,
        bytes=wv1.bytes,
        created=0.0,
        run=RUN,
        files=wv1.files,
    )
    await kv.put(topology.WEIGHTS_KEY, codec.encode(bad))
    await until(lambda: 3 in f.refused)
    assert "verification failed" in f.refused[3] and engine.version == 2
    n = len(engine.reloads)
    await asyncio.sleep(1.0)  # several polls: the refused version is not tried again
    assert len(engine.reloads) == n

    # a load that fails half-way is undone by reloading what was served, then refused (published as a
    # learner that has just started would: the bad put above was another writer's, which the fence of
    # weights.common.announce refuses to write over for a learner that announced before it)
    engine.fail = 1
    common.forget_writes(js, RUN)
    await registry.publish_version(js, RUN, 4, 40, state_dir(tmp_path, "c"), ObjstoreWeights())
    await until(lambda: 4 in f.refused)
    assert engine.reloads[-2:] == [("v000004", 4), ("v000002", 2)] and engine.version == 2
    assert "reload failed" in f.refused[4]

    # a resumed learner moves the key back to a lower number with other weights: followed
    common.forget_writes(js, RUN)  # a new learner's start (learner.service does the same)
    await registry.publish_version(js, RUN, 1, 10, state_dir(tmp_path, "d"), ObjstoreWeights())
    await until(lambda: engine.version == 1)
    assert f.loaded == [1, 2, 1]

    # when even the served weights cannot be restored, the follower (and so the actor) stops
    engine.fail = 2
    await registry.publish_version(js, RUN, 5, 50, state_dir(tmp_path, "e"), ObjstoreWeights())
    with pytest.raises(WeightsBroken, match="mixed model"):
        await asyncio.wait_for(runner, 10)


class IpcEngineDouble(ReloadEngineDouble):
    """Test double that also takes cuda_ipc / nccl versions: `refuse` makes the next load_gpu fail its
    checksums (nothing changed), `unavailable` fail to get the buffer (it passes; nothing changed),
    `break_ipc` fail half-way with `break_error` (a restore is needed). `held`: the versions whose
    bytes the learner's buffers still hold (None: every one); another fails its checksums."""

    def __init__(self):
        super().__init__()
        self.ipc_loads: list[int] = []
        self.refuse = 0
        self.unavailable = 0
        self.break_ipc = 0
        self.break_error = "CUDA error: an illegal memory access was encountered"
        self.held: set[int] | None = None

    async def load_gpu(self, announcement, hold_s, version=None):
        wv = codec.decode("weights", announcement)
        assert hold_s == (wv.ipc or wv.nccl).hold_s
        self.ipc_loads.append(wv.version)
        if self.held is not None and wv.version not in self.held:
            raise common.WeightVerifyError(f"version {wv.version}: checksum mismatch in 1 of 1 tensors (first: w)")
        if self.refuse:
            self.refuse -= 1
            raise common.WeightVerifyError("checksum mismatch in 1 of 1 tensors (first: w)")
        if self.unavailable:
            self.unavailable -= 1
            raise common.WeightUnavailable("receiving from learner:29600 failed: Connection reset by peer")
        if self.break_ipc and version != self.version:  # a new version's load breaks; the restore works
            self.break_ipc -= 1
            raise RuntimeError(self.break_error)
        if version is not None:
            self.version = version


def ipc_buffer(tag: int):
    from parley.protocol.messages import CudaIpcBuffer, IpcTensor

    return CudaIpcBuffer(
        device_uuid="GPU-test",
        storage_handle=bytes([tag]) * 64,
        storage_size=1024,
        storage_offset=0,
        ref_counter_handle=b"/torch_test",
        ref_counter_offset=tag,
        event_handle=b"",
        event_sync_required=False,
        nbytes=256,
        hold_s=5.0,
        tensors=[IpcTensor(name="w", dtype="bfloat16", shape=[128], offset=0, checksum=[tag, tag, tag])],
    )


async def test_a_gpu_load_that_fails_is_tried_again_and_the_version_served(js, tmp_path):
    """Out of memory while the learner steps on the same GPU (seen on the H200 at the 4B shape): the
    load fails (and fails again when loaded once more at once), the served weights are put back, and
    the next poll loads the version. Refusing it for good (as before) left the actor on an old version
    for the rest of the run."""
    run = "follow-ipc-retry"
    await topology.ensure_topology(js, run, BUS)
    engine = IpcEngineDouble()
    f = WeightFollower(js, run, engine, dest_root=tmp_path / "fetched", poll_s=0.3, base_dir=tmp_path / "base")
    await registry.publish_gpu_version(js, run, 1, 1, ipc_buffer(1))
    assert await f.check() and engine.version == 1
    engine.break_ipc = 2 * (GPU_ATTEMPTS - 1)  # each check: its load and the load once more break
    await registry.publish_gpu_version(js, run, 2, 2, ipc_buffer(2))
    for _ in range(GPU_ATTEMPTS - 1):
        assert not await f.check() and engine.version == 1
        assert 2 not in f.refused and "reload failed" in f.failing[2]
        assert not await f.check() and engine.ipc_loads[-1] == 1  # within its backoff: not tried
        f.retry_at.clear()  # the backoff (poll_s x 2^k) has passed
    assert await f.check() and engine.version == 2 and 2 not in f.failing and not f.refused
    assert engine.ipc_loads == [1] + [2, 2, 1] * (GPU_ATTEMPTS - 1) + [2]


async def test_a_gpu_load_failing_for_a_passing_reason_is_tried_past_gpu_attempts_and_served(js, tmp_path):
    """Out of memory half-way through the load, then a receive that breaks (the learner restarting):
    both pass, so the version is tried again with back-off for as long as it is announced, more than
    GPU_ATTEMPTS times, and served once it loads. Only a mismatch refuses a version for good."""
    run = "follow-ipc-passing"
    await topology.ensure_topology(js, run, BUS)
    engine = IpcEngineDouble()
    f = WeightFollower(js, run, engine, dest_root=tmp_path / "fetched", poll_s=0.3, base_dir=tmp_path / "base")
    await registry.publish_gpu_version(js, run, 1, 1, ipc_buffer(1))
    assert await f.check() and engine.version == 1
    engine.break_ipc, engine.break_error = 2 * (GPU_ATTEMPTS + 1), "CUDA out of memory. Tried to allocate 2.00 GiB"
    await registry.publish_gpu_version(js, run, 2, 2, ipc_buffer(2))
    for _ in range(GPU_ATTEMPTS + 1):
        assert not await f.check() and engine.version == 1
        assert 2 not in f.refused and "out of memory" in f.failing[2]
        f.retry_at.clear()  # its backoff has passed
    engine.unavailable = GPU_ATTEMPTS + 1
    for _ in range(GPU_ATTEMPTS + 1):
        assert not await f.check() and engine.version == 1
        assert 2 not in f.refused and "unavailable: receiving from" in f.failing[2]
        f.retry_at.clear()
    assert list(f.failures.values()) == [2 * GPU_ATTEMPTS + 2]
    assert await f.check() and engine.version == 2 and 2 not in f.failing and not f.refused
    # a GPU load that failed half-way was loaded once more, then undone each time (the served version
    # loaded again); one that did not get its buffer changed nothing
    assert engine.ipc_loads == [1] + [2, 2, 1] * (GPU_ATTEMPTS + 1) + [2] * (GPU_ATTEMPTS + 1) + [2]


async def test_a_gpu_load_that_fails_half_way_over_one_buffer_serves_the_new_version(js, tmp_path):
    """[weights] max_buffers = 1, steps longer than hold_s (deploy/configs/gpu-1-4b.toml): the learner
    packs each version into the buffer the one served came from. A load that fails half-way is loaded
    once more from that buffer and served (version and heartbeat say so), not stopped on a put-back
    of the overwritten version; when it fails again, the actor stops with one line naming both."""
    run = "follow-ipc-one-buffer"
    await topology.ensure_topology(js, run, BUS)
    engine = IpcEngineDouble()
    f = WeightFollower(js, run, engine, dest_root=tmp_path / "fetched", poll_s=0.3, base_dir=tmp_path / "base")
    engine.held = {1}
    await registry.publish_gpu_version(js, run, 1, 1, ipc_buffer(1))
    assert await f.check() and engine.version == 1
    engine.held, engine.break_ipc = {2}, 1
    await registry.publish_gpu_version(js, run, 2, 2, ipc_buffer(1))
    assert await f.check() and engine.version == 2 and f.serving[0] == 2 and f.version == 2
    assert engine.ipc_loads == [1, 2, 2] and not f.failing and not f.refused and not f.failures
    assert not await f.check()  # served: not loaded again

    engine.held, engine.break_ipc = {3}, 2
    await registry.publish_gpu_version(js, run, 3, 3, ipc_buffer(1))
    with pytest.raises(WeightsBroken, match=r"version 3 failed to load .* second try .* served version 2 could not"):
        await asyncio.wait_for(f.run_until(asyncio.Event()), timeout=10)
    assert engine.ipc_loads == [1, 2, 2, 3, 3, 2] and engine.version == 2


async def test_follower_loads_cuda_ipc_versions_and_refuses_a_bad_copy_without_a_restore(js, tmp_path):
    run = "follow-ipc"
    await topology.ensure_topology(js, run, BUS)
    engine = IpcEngineDouble()
    f = WeightFollower(js, run, engine, dest_root=tmp_path / "fetched", poll_s=0.3, base_dir=tmp_path / "base")
    with pytest.raises(ValueError, match="pack it first"):
        await registry.publish_gpu_version(js, run, 1, 1, msgspec.structs.replace(ipc_buffer(1), tensors=[]))

    wv1 = await registry.publish_gpu_version(js, run, 1, 1, ipc_buffer(1))
    assert wv1.transport == "cuda_ipc" and wv1.location == "cuda:GPU-test" and wv1.bytes == 256
    assert await f.check() and engine.version == 1 and engine.ipc_loads == [1]
    assert not (tmp_path / "fetched").exists()  # nothing is fetched to disk
    assert not await f.check()

    # a copy that fails its checksums is refused at once, for good, and nothing is reloaded: the
    # engine checked it before touching a weight
    engine.refuse = 1
    await registry.publish_gpu_version(js, run, 2, 2, ipc_buffer(2))
    assert not await f.check() and 2 in f.refused
    assert "verification failed: checksum mismatch" in f.refused[2] and engine.version == 1
    assert engine.reloads == [] and engine.ipc_loads == [1, 2]
    f.retry_at.clear()
    assert not await f.check() and engine.ipc_loads == [1, 2]  # refused: not tried again

    # a load that fails half-way, also when loaded once more, is undone by loading the served
    # cuda_ipc version again
    engine.break_ipc = 2 * GPU_ATTEMPTS
    await registry.publish_gpu_version(js, run, 3, 3, ipc_buffer(3))
    for _ in range(GPU_ATTEMPTS):
        assert not await f.check()
        f.retry_at.clear()
    assert engine.ipc_loads[-3 * GPU_ATTEMPTS :] == [3, 3, 1] * GPU_ATTEMPTS and engine.version == 1
    assert "reload failed" in f.refused[3]

    # the next file version is followed as before
    await registry.publish_version(js, run, 4, 4, state_dir(tmp_path, "f"), ObjstoreWeights())
    assert await f.check() and engine.version == 4 and engine.reloads[-1] == ("v000004", 4)

    # an nccl version takes the same path, with its own hold time as the engine's deadline
    from parley.protocol.messages import NcclSource

    src = NcclSource(address="learner:29600", backend="nccl", nbytes=256, hold_s=7.0, tensors=ipc_buffer(5).tensors)
    wv5 = await registry.publish_gpu_version(js, run, 5, 5, src)
    assert wv5.transport == "nccl" and wv5.location == "nccl://learner:29600"
    assert await f.check() and engine.version == 5 and engine.ipc_loads[-1] == 5
