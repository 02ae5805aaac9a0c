"""The weights object store and the KV buckets stay bounded (issue 57): chunks a learner killed
mid-upload left (no meta names them) are purged at the learner's start and by every prune, and
every bucket has a max_bytes that refuses a put beyond it. Real nats-server (tests/conftest.py)."""

from __future__ import annotations

import pytest
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.errors import APIError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE
from nats.nuid import NUID

from parley.protocol import topology
from parley.weights import objstore
from parley.weights.config import ObjstoreWeights
from parley.weights.registry import fetch_version, publish_version
from tests.integration.test_weights import write_state

pytestmark = pytest.mark.integration
RUN = "bounds"
BUCKET = topology.object_bucket(RUN)
STREAM = OBJ_STREAM_TEMPLATE.format(bucket=BUCKET)


async def plant_orphan(js, chunks: int = 3) -> str:
    """What a learner killed during an upload leaves: chunks on a fresh subject, no meta naming them."""
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=BUCKET, obj=NUID().next().decode())
    for _ in range(chunks):
        await js.publish(subject, b"x" * 64 * 1024)
    return subject


async def chunk_subjects(js) -> dict[str, int]:
    prefix = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=BUCKET, obj=">")
    return (await js.stream_info(STREAM, subjects_filter=prefix)).state.subjects or {}


async def test_orphan_chunks_are_purged_by_prune_and_at_start(js, tmp_path, monkeypatch):
    await topology.ensure_topology(js, RUN)
    settings = ObjstoreWeights()
    v0 = await publish_version(js, RUN, 0, step=0, state_dir=write_state(tmp_path / "s0", 0, mib=5), settings=settings)
    orphan = await plant_orphan(js)
    assert orphan in await chunk_subjects(js)

    # a fresh orphan may be an upload still running: kept
    assert await objstore.purge_orphans(js, BUCKET) == 0
    assert orphan in await chunk_subjects(js)

    # once older than an upload can take, the next publication's prune purges it
    monkeypatch.setattr(objstore, "ORPHAN_AGE_S", 0.0, raising=False)
    v1 = await publish_version(js, RUN, 1, step=1, state_dir=write_state(tmp_path / "s1", 1, mib=5), settings=settings)
    left = await chunk_subjects(js)
    assert orphan not in left
    live = {OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=BUCKET, obj=i.nuid) for i in await objstore.list_objects(js, BUCKET)}
    assert set(left) == live and len(live) == 4  # v0's and v1's model and config.json: every object whole
    for wv in (v0, v1):
        await fetch_version(js, RUN, wv, tmp_path / f"got{wv.version}", rehash=True)

    # and the learner's start purges them too (a learner killed mid-upload, then restarted)
    orphan = await plant_orphan(js)
    await objstore.Objstore().at_start(js, RUN, version_bytes=0)
    assert orphan not in await chunk_subjects(js)


async def test_object_store_and_kv_buckets_have_max_bytes(js, tmp_path):
    bus = topology.BusSettings(max_bytes=64 * 1024**2, blobs_max_bytes=12 * 1024**2, kv_max_bytes=1024**2)
    await topology.ensure_topology(js, RUN, bus)
    assert (await js.stream_info(STREAM)).config.max_bytes == 12 * 1024**2
    for bucket in (topology.kv_bucket(RUN), topology.held_bucket(RUN), topology.lease_bucket(RUN)):
        assert (await js.stream_info(KV_STREAM_TEMPLATE.format(bucket=bucket))).config.max_bytes == 1024**2

    # a put beyond the object store's max_bytes is refused, and what it had sent is purged
    with pytest.raises(RuntimeError, match="refused by the server"):
        await objstore._put_object(js, RUN, "v000001/model.safetensors", b"y" * (16 * 1024**2))
    assert await chunk_subjects(js) == {}
    # the learner's start says so before any training: one version (4 Mi fp32 elements) does not fit
    import numpy as np
    from safetensors.numpy import save_file

    from parley.config.run import load_config
    from parley.learner.service import weights_at_start

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.zeros(4 * 1024**2, dtype=np.float32)}, str(model / "model.safetensors"))
    cfg = load_config(None, [f'run.name="{RUN}"', 'learner.dtype="float32"'])
    with pytest.raises(objstore.WeightStoreTooSmall, match="blobs_max_bytes"):
        await weights_at_start(js, cfg, model)

    # a KV put beyond its bucket's max_bytes is refused
    kv = await js.key_value(topology.kv_bucket(RUN))
    await kv.put("a", b"z" * 600 * 1024)
    with pytest.raises(APIError):
        await kv.put("b", b"z" * 600 * 1024)


async def test_buckets_made_without_a_limit_get_one(js):
    from nats.js import api

    await js.create_object_store(BUCKET, config=api.ObjectStoreConfig(bucket=BUCKET, storage=api.StorageType.FILE))
    await topology.ensure_topology(js, RUN)  # blobs_max_bytes 0: the default for a bucket with none
    assert (await js.stream_info(STREAM)).config.max_bytes == topology.DEFAULT_BLOBS_MAX_BYTES
    await topology.ensure_topology(js, RUN, topology.BusSettings(blobs_max_bytes=256 * 1024**2))
    assert (await js.stream_info(STREAM)).config.max_bytes == 256 * 1024**2
    await topology.ensure_topology(js, RUN)  # a role whose [bus] nothing derived keeps what the set-up gave
    assert (await js.stream_info(STREAM)).config.max_bytes == 256 * 1024**2
