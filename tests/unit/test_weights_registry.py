"""The weights registry: every kind [weights] accepts has exactly one transport, which says
what it needs; a GPU announcement is made by the transport its source belongs to; the old flat
keys are translated without touching the caller's table."""

from __future__ import annotations

import pytest

from parley.protocol.messages import CudaIpcBuffer, IpcTensor, NcclSource
from parley.weights import registry
from parley.weights.config import KINDS, CudaIpcWeights, NcclWeights, ObjstoreWeights, SharedDirWeights


def test_every_configured_kind_has_its_transport():
    assert tuple(registry.TRANSPORTS) == KINDS
    for settings in (
        ObjstoreWeights(),
        SharedDirWeights(dir="/srv/w"),
        CudaIpcWeights(),
        NcclWeights(address="10.0.0.1:29600"),
    ):
        assert registry.of(settings).kind == type(settings).__struct_config__.tag
    assert registry.get("carrier-pigeon") is None


@pytest.mark.parametrize(
    "settings, gpu, needs_cuda, shares_device",
    [
        (ObjstoreWeights(), False, False, False),
        (SharedDirWeights(dir="/srv/w"), False, False, False),
        (CudaIpcWeights(), True, True, True),  # the actors' engines open rank 0's own GPU memory
        (NcclWeights(address="h:1"), True, False, False),  # gloo where rank 0 has no GPU; actors on other GPUs
    ],
)
def test_each_transport_says_what_it_needs(settings, gpu, needs_cuda, shares_device):
    t = registry.of(settings)
    assert (t.gpu, t.needs_cuda, t.shares_device) == (gpu, needs_cuda, shares_device)


def test_a_gpu_announcement_is_made_by_the_transport_of_its_source():
    tensors = [IpcTensor(name="w", dtype="bfloat16", shape=[128], offset=0, checksum=[1, 2, 3])]
    ipc = CudaIpcBuffer(
        device_uuid="GPU-1",
        storage_handle=b"h",
        storage_size=256,
        storage_offset=0,
        ref_counter_handle=b"r",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
        nbytes=256,
        hold_s=5.0,
        tensors=tensors,
    )
    nccl = NcclSource(address="learner:29600", backend="gloo", nbytes=256, hold_s=5.0, tensors=tensors)
    a, b = registry.gpu_announcement("r", 1, 1, ipc), registry.gpu_announcement("r", 2, 2, nccl)
    assert (a.location, a.ipc, a.nccl) == ("cuda:GPU-1", ipc, None)
    assert (b.location, b.nccl, b.ipc) == ("nccl://learner:29600", nccl, None)
    assert registry.get(a.transport).source(a) is ipc and registry.get(b.transport).source(b) is nccl
    assert a.sha256 == b.sha256  # the digest of the same tensor table


def test_a_transport_asked_for_the_other_family_names_what_to_use():
    """A file transport has no GPU sender and a GPU transport stores no files: asking is a caller's
    bug, refused with the kind and the call to use instead."""
    with pytest.raises(TypeError, match="'objstore' moves files and cannot pack a GPU buffer; use publish_version"):
        registry.get("objstore").sender(ObjstoreWeights(), "cpu")
    with pytest.raises(
        TypeError, match="'cuda_ipc' moves a GPU buffer and cannot upload files; use publish_gpu_version"
    ):
        import asyncio

        asyncio.run(registry.get("cuda_ipc").upload(None, "r", "p", None, [], CudaIpcWeights()))
