"""weights.delta by itself (no NATS): build and apply are bit for bit for any dtype, a delta for
another base or a damaged one is refused leaving nothing behind, and announcements from before
WeightVersion.delta decode (and old actors, decoding without the field, see the full copy)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from safetensors.numpy import save_file

from parley.protocol import codec
from parley.protocol.messages import WeightDelta, WeightVersion
from parley.weights import delta as deltas
from parley.weights.common import WeightVerifyError, file_digest
from parley.weights.config import ObjstoreWeights
from parley.weights.registry import wants_delta


def two_versions(tmp_path, changed: float = 0.01):
    rng = np.random.default_rng(0)
    a = {
        "f32": rng.standard_normal((64, 33), dtype=np.float32),
        "u16": rng.integers(0, 2**16, 999, dtype=np.uint16),
        "i8": rng.integers(-128, 127, 77, dtype=np.int8),
        "f64": rng.standard_normal(5),
    }
    b = {k: v.copy() for k, v in a.items()}
    for v in b.values():
        flat = v.reshape(-1)
        hit = rng.random(flat.size) < changed
        flat[hit] = flat[hit] + 1 if flat.dtype.kind in "iu" else flat[hit] * 1.5
    b["i8"][0] += 1  # a change at index 0 (gap 0)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


def test_build_then_apply_is_bit_for_bit_for_any_dtype(tmp_path):
    a, b = two_versions(tmp_path)
    sa, sb = file_digest(a)[0], file_digest(b)[0]
    size = deltas.build(a, b, tmp_path / "d", sa, sb)
    assert size is not None and size < b.stat().st_size / 4
    deltas.apply(a, tmp_path / "d", tmp_path / "out", sa, sb, b.stat().st_size)
    assert (tmp_path / "out").read_bytes() == b.read_bytes()
    assert file_digest(a)[0] == sa  # the base is copied, never written


def test_no_delta_when_the_layouts_differ(tmp_path):
    save_file({"x": np.zeros(10, np.float32)}, str(tmp_path / "a"))
    save_file({"x": np.zeros(11, np.float32)}, str(tmp_path / "b"))
    assert deltas.build(tmp_path / "a", tmp_path / "b", tmp_path / "d", "", "") is None
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("damage", ["magic", "truncate", "flip_tail", "other_base", "other_target"])
def test_a_wrong_or_damaged_delta_is_refused_and_leaves_nothing(tmp_path, damage):
    a, b = two_versions(tmp_path)
    sa, sb = file_digest(a)[0], file_digest(b)[0]
    deltas.build(a, b, tmp_path / "d", sa, sb)
    raw = bytearray((tmp_path / "d").read_bytes())
    base_sha, sha = sa, sb
    if damage == "magic":
        raw[:8] = b"NOTADELT"
    elif damage == "truncate":
        raw = raw[: len(raw) - 10]
    elif damage == "flip_tail":
        raw[-3] ^= 0xFF  # inside the last zlib stream
    elif damage == "other_base":
        base_sha = "1" * 64
    else:
        sha = "2" * 64
    (tmp_path / "d").write_bytes(bytes(raw))
    with pytest.raises(WeightVerifyError):
        deltas.apply(a, tmp_path / "d", tmp_path / "out", base_sha, sha, b.stat().st_size)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.part"))
    assert file_digest(a)[0] == sa


OLD = dict(
    version=3,
    step=3,
    transport="objstore",
    location="v000003-ab/model.safetensors",
    sha256="a" * 64,
    bytes=10,
    created=1.0,
    run="r",
    files=["v000003-ab/config.json"],
)


def test_old_announcements_decode_without_a_delta():
    class OldWeightVersion(msgspec.Struct, kw_only=True):  # WeightVersion before the delta field (and ipc, nccl)
        version: int
        step: int
        transport: str
        location: str
        sha256: str
        bytes: int
        created: float
        run: str = ""
        files: list[str] = []

    wv = codec.decode("weights", msgspec.msgpack.encode(OldWeightVersion(**OLD)))
    assert wv.delta is None and wv.location == OLD["location"]


def test_an_old_actor_reads_a_delta_version_as_its_full_copy():
    """An actor decoding without the field (msgspec ignores unknown fields) gets location, sha256 and
    bytes of the full copy: it fetches that, never the delta."""
    new = WeightVersion(
        **OLD,
        delta=WeightDelta(
            base_version=2, base_sha256="b" * 64, location="v000003-ab/model.delta", sha256="c" * 64, bytes=3
        ),
    )
    old_view = msgspec.msgpack.decode(
        codec.encode(new), type=msgspec.defstruct("Old", [(k, type(v)) for k, v in OLD.items()], kw_only=True)
    )
    assert (old_view.location, old_view.sha256, old_view.bytes) == (OLD["location"], OLD["sha256"], OLD["bytes"])


def test_one_version_in_full_every_is_full_only():
    assert [wants_delta(ObjstoreWeights(full_every=4), n) for n in range(5)] == [True, True, True, False, False]
    assert not wants_delta(ObjstoreWeights(), 0)  # full_every = 1: no deltas
    with pytest.raises(ValueError, match="full_every"):
        ObjstoreWeights(full_every=0)
