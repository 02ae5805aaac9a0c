"""The load halves of weights.payloads through WeightFollower._load, on the paths a CPU can take: a
file version whose reload fails half-way is refused after the served weights are reloaded (or the
actor stops, WeightsBroken, when they cannot be); a GPU-buffer version (cuda_ipc) whose load fails
is refused for a mismatch and tried again for a reason that passes, the served weights put back
first when it failed half-way. No bus: the fetch, the engine and the buffer are test doubles."""

from __future__ import annotations

from pathlib import Path

import pytest

from parley.protocol.bus import COUNTERS
from parley.protocol.messages import CudaIpcBuffer, WeightVersion
from parley.weights.common import WeightUnavailable, WeightVerifyError
from parley.weights.follow import WeightFollower, WeightsBroken


class EngineDouble:
    """Serves `version`; its reloads and GPU loads are recorded, and fail with what `fail` holds."""

    settings = None

    def __init__(self):
        self.version, self.calls, self.fail = 1, [], {}

    async def reload_weights(self, path, version):
        self.calls.append(("reload", Path(path).name, version))
        if "reload" in self.fail and version != self.version:
            raise self.fail["reload"]
        if "restore" in self.fail and version == self.version:
            raise self.fail["restore"]
        self.version = version

    async def load_gpu(self, announcement, hold_s, version):
        self.calls.append(("gpu", version))
        if "gpu" in self.fail and version != self.version:  # putting back the one served passes
            raise self.fail["gpu"]
        self.version = version


async def fetch_double(js, run, wv, dest, settings=None, base=None):
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def follower(tmp_path) -> tuple[WeightFollower, EngineDouble]:
    (tmp_path / "base").mkdir()
    engine = EngineDouble()
    return (
        WeightFollower(None, "r", engine, dest_root=tmp_path / "actor", base_dir=tmp_path / "base", fetch=fetch_double),
        engine,
    )


def file_version(version=2) -> WeightVersion:
    return WeightVersion(
        version=version, step=version, transport="objstore", location="v", sha256="a" * 64, bytes=10, created=0.0
    )


def gpu_version(version=2) -> WeightVersion:
    ipc = CudaIpcBuffer(
        device_uuid="GPU-0",
        storage_handle=b"",
        storage_size=8,
        storage_offset=0,
        ref_counter_handle=b"",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
        nbytes=8,
        hold_s=5.0,
    )
    return WeightVersion(
        version=version,
        step=version,
        transport="cuda_ipc",
        location="cuda:GPU-0",
        sha256="b" * 64,
        bytes=8,
        created=0.0,
        ipc=ipc,
    )


async def test_a_file_version_is_loaded_and_only_it_is_kept(tmp_path):
    f, engine = follower(tmp_path)
    assert await f._load(file_version(2)) and engine.version == 2 and f.serving == (2, "a" * 64)
    assert await f._load(file_version(3)) and engine.version == 3
    assert [p.name for p in (tmp_path / "actor").iterdir()] == [f"v000003-{'a' * 12}"]  # v2's files removed


async def test_a_file_reload_that_fails_half_way_puts_the_served_weights_back_and_refuses(tmp_path):
    f, engine = follower(tmp_path)
    engine.fail["reload"] = RuntimeError("a tensor of the wrong shape")
    assert not await f._load(file_version(2))
    assert engine.calls == [("reload", "v000002-" + "a" * 12, 2), ("reload", "base", 1)] and engine.version == 1
    assert "reload failed" in f.refused[2] and not (tmp_path / "actor" / ("v000002-" + "a" * 12)).exists()


async def test_a_failed_reload_whose_served_weights_cannot_be_put_back_stops_the_actor(tmp_path):
    f, engine = follower(tmp_path)
    engine.fail.update(reload=RuntimeError("half-way"), restore=OSError("the base is gone"))
    with pytest.raises(WeightsBroken, match="could not be restored"):
        await f._load(file_version(2))


async def test_an_announcement_with_dishonest_sizes_is_refused_unread(tmp_path):
    f, engine = follower(tmp_path)
    wv = file_version(2)
    wv.bytes = 0
    assert not await f._load(wv) and engine.calls == [] and "announcement refused" in f.refused[2]


@pytest.mark.parametrize(
    "error, refused, restored",
    [
        (WeightVerifyError("checksum mismatch in 1 of 3 tensors"), True, False),  # for good, nothing changed
        (WeightUnavailable("the buffer did not open"), False, False),  # passes: tried again
        (TimeoutError("past its hold time"), False, True),  # half-way: put back, tried again
    ],
    ids=["mismatch", "unavailable", "timeout"],
)
async def test_a_gpu_buffer_version_that_fails_is_refused_or_tried_again(tmp_path, error, refused, restored):
    f, engine = follower(tmp_path)
    engine.fail["gpu"] = error
    assert not await f._load(gpu_version(2)) and engine.version == 1
    assert (2 in f.refused) is refused and (2 in f.failing) is not refused
    assert (("reload", "base", 1) in engine.calls) is restored
    del engine.fail["gpu"]
    if not refused:  # its back-off waited out, the next try loads it
        f.retry_at.clear()
        assert await f._load(gpu_version(2)) and engine.version == 2 and 2 not in f.failing


async def test_a_gpu_load_that_fails_half_way_puts_back_the_gpu_version_served(tmp_path):
    """Served from a GPU buffer: a version that fails half-way twice (loaded once more first: see
    test_a_gpu_load_that_fails_half_way_over_one_buffer_loads_the_new_version_again) is tried again
    later, after what was served is put back from that version's buffer (its checksums refuse it if
    the learner has overwritten it since), not from the files the engine started from."""
    f, engine = follower(tmp_path)
    assert await f._load(gpu_version(2)) and engine.version == 2
    engine.fail["gpu"] = TimeoutError("past its hold time")
    assert not await f._load(gpu_version(3))
    assert engine.calls == [("gpu", 2), ("gpu", 3), ("gpu", 3), ("gpu", 2)] and engine.version == 2
    assert 3 in f.failing and f.serving == (2, "b" * 64)


class OneBufferEngine(EngineDouble):
    """The learner's GPU buffers as an actor's engine sees them: `held` is the versions whose bytes are
    still in a buffer (with [weights] max_buffers = 1 and steps longer than hold_s, only the newest).
    Loading a version no buffer holds fails its checksums before any weight changed
    (WeightVerifyError); `half` holds the failures of loads that break after changing weights (the
    engine's version stays, its weights are mixed: `mixed`)."""

    def __init__(self):
        super().__init__()
        self.held, self.half, self.mixed = set(), [], False

    async def load_gpu(self, announcement, hold_s, version):
        from parley.protocol import codec

        wanted = codec.decode("weights", announcement).version
        self.calls.append(("gpu", wanted, version))
        if wanted not in self.held:
            raise WeightVerifyError(f"version {wanted}: checksum mismatch in 1 of 1 tensors")
        if self.half:
            self.mixed = True
            raise self.half.pop(0)
        self.version, self.mixed = version, False


async def test_a_gpu_load_that_fails_half_way_over_one_buffer_loads_the_new_version_again(tmp_path):
    """max_buffers = 1: the learner packed version 3 into the buffer version 2 was served from. A load
    of 3 that fails half-way cannot put 2 back (its bytes are gone), but 3 is in the buffer, within
    its hold: it is loaded once more and served, rather than stopping the actor with WeightsBroken."""
    (tmp_path / "base").mkdir()
    engine = OneBufferEngine()
    f = WeightFollower(None, "r", engine, dest_root=tmp_path / "actor", base_dir=tmp_path / "base", fetch=fetch_double)
    engine.held = {2}
    assert await f._load(gpu_version(2)) and engine.version == 2
    engine.held = {3}  # 2's hold ran out: the learner refilled its only buffer with 3
    engine.half = [RuntimeError("CUDA error: an illegal memory access was encountered")]
    again = COUNTERS["weights.gpu_load_again"]
    assert await f._load(gpu_version(3))
    assert COUNTERS["weights.gpu_load_again"] == again + 1  # in the actor's heartbeat
    assert engine.calls == [("gpu", 2, 2), ("gpu", 3, 3), ("gpu", 3, 3)]
    assert engine.version == 3 and not engine.mixed and f.serving == (3, "b" * 64) and 3 not in f.failing
    assert f.loaded == [2, 3]
    engine.half = [RuntimeError("again")]  # what is put back after a later failure is 3, from its buffer
    engine.held = {3, 4}
    assert await f._load(gpu_version(4)) and engine.version == 4


async def test_a_gpu_version_failing_half_way_twice_over_one_buffer_stops_the_actor_naming_both(tmp_path):
    """Version 3 fails half-way at both tries and version 2's buffer holds 3 now: nothing whole is left
    to serve, so the actor stops (WeightsBroken) with one line naming both versions, both failures and
    the settings that would have kept version 2 at hand."""
    (tmp_path / "base").mkdir()
    engine = OneBufferEngine()
    f = WeightFollower(None, "r", engine, dest_root=tmp_path / "actor", base_dir=tmp_path / "base", fetch=fetch_double)
    engine.held = {2}
    assert await f._load(gpu_version(2))
    engine.held = {3}
    engine.half = [RuntimeError("first"), RuntimeError("second")]
    with pytest.raises(WeightsBroken) as broken:
        await f._load(gpu_version(3))
    why = str(broken.value)
    assert "\n" not in why and engine.mixed and engine.version == 2
    assert "version 3 failed to load (RuntimeError: first), and again at a second try (RuntimeError: second)" in why
    assert "served version 2 could not be restored (version 2: checksum mismatch" in why
    assert "hold_s" in why and "max_buffers >= 2" in why
    assert engine.calls == [("gpu", 2, 2), ("gpu", 3, 3), ("gpu", 3, 3), ("gpu", 2, 2)]
