"""weights.payloads: the payload kind is chosen inside weights/, once on each side, and every kind has
both halves. The learner side from [weights] and [learner.lora] (for_config), the actor side from the
announcement and its own [weights] (for_announcement). No bus, no model."""

from __future__ import annotations

import pytest

from parley.protocol.messages import LoraAdapter, WeightDelta, WeightVersion
from parley.weights import payloads
from parley.weights.config import CudaIpcWeights, NcclWeights, ObjstoreWeights, SharedDirWeights

KINDS = (
    payloads.Full,
    payloads.Delta,
    payloads.PackedDelta,
    payloads.GpuWeights,
    payloads.Adapter,
    payloads.AdapterGpu,
)


@pytest.mark.parametrize(
    "settings, adapter, kind",
    [
        (ObjstoreWeights(), False, payloads.Full),  # full_every 1: every version full only
        (ObjstoreWeights(full_every=4), False, payloads.Delta),
        (SharedDirWeights(dir="/tmp", full_every=4), False, payloads.Delta),
        (ObjstoreWeights(full_every=4, delta_format="packed"), False, payloads.PackedDelta),
        (ObjstoreWeights(delta_format="packed"), False, payloads.Full),  # no deltas: no packing
        (CudaIpcWeights(), False, payloads.GpuWeights),
        (NcclWeights(address="127.0.0.1:29600"), False, payloads.GpuWeights),
        (ObjstoreWeights(full_every=4), True, payloads.Adapter),
        (CudaIpcWeights(), True, payloads.AdapterGpu),
    ],
)
def test_the_learner_side_takes_its_kind_from_the_config(settings, adapter, kind):
    payload = payloads.for_config(settings, adapter)
    assert type(payload) is kind
    assert payloads.for_config(settings, adapter) is not payload  # a publish half keeps its own state


def announcement(**kw) -> WeightVersion:
    base = dict(version=3, step=3, transport="objstore", location="v3", sha256="a" * 64, bytes=10, created=0.0)
    return WeightVersion(**(base | kw))


class EngineDouble:  # test double: an engine that keeps a packed copy (load_packed_delta)
    async def load_packed_delta(self, *args):
        pass


ADAPTER = LoraAdapter(base="b" * 32, rank=4)
FILE_DELTA = WeightDelta(base_version=2, base_sha256="c" * 64, location="d", sha256="e" * 64, bytes=1)


@pytest.mark.parametrize(
    "wv, settings, engine, kind",
    [
        (announcement(), ObjstoreWeights(), object(), payloads.Full),
        (announcement(delta=FILE_DELTA), ObjstoreWeights(full_every=4), object(), payloads.Delta),
        (announcement(), ObjstoreWeights(full_every=4, delta_format="packed"), EngineDouble(), payloads.PackedDelta),
        # packed deltas announced, but this engine keeps no packed copy: the file path
        (announcement(), ObjstoreWeights(full_every=4, delta_format="packed"), object(), payloads.Full),
        (announcement(transport="cuda_ipc"), CudaIpcWeights(), object(), payloads.GpuWeights),
        (announcement(transport="nccl"), NcclWeights(address="127.0.0.1:29600"), object(), payloads.GpuWeights),
        (announcement(adapter=ADAPTER), ObjstoreWeights(), object(), payloads.Adapter),
        (announcement(transport="cuda_ipc", adapter=ADAPTER), CudaIpcWeights(), object(), payloads.AdapterGpu),
        # an unknown transport is a file payload: its fetch refuses it (weights.registry.fetch_version)
        (announcement(transport="carrier-pigeon"), None, object(), payloads.Full),
    ],
)
def test_the_actor_side_takes_its_kind_from_the_announcement(wv, settings, engine, kind):
    assert type(payloads.for_announcement(wv, settings, engine)) is kind


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_kind_has_a_publish_half_and_a_load_half(kind):
    assert kind.publish is not payloads.Payload.publish and kind.load is not payloads.Payload.load


def test_the_weight_paths_ends_load_without_torch():
    """The learner's control half (learner.checkpoint, the publication) and the actor's follower import
    weights/ without torch: torch comes in only where weights are taken, packed or loaded."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; import parley.learner.checkpoint, parley.weights.publish, parley.weights.follow; "
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "[]", out
