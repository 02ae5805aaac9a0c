"""Weights by version against a real nats-server: object store and shared-dir transports, the KV
announcement, verification failures and pruning."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from parley.protocol import topology
from parley.weights.common import CONFIG_FILE, MODEL_FILE, WeightVerifyError, current_version
from parley.weights.config import ObjstoreWeights, SharedDirWeights
from parley.weights.objstore import chunk_size
from parley.weights.registry import fetch_version, publish_version

pytestmark = pytest.mark.integration
RUN = "wtest"


def write_state(d, seed: int, mib: float = 9.0):
    """A safetensors file of ~`mib` MiB (several object-store chunks) plus config.json."""
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = int(mib * 1024 * 1024 / 4)
    save_file({"model.embed_tokens.weight": rng.standard_normal(n, dtype=np.float32)}, str(d / MODEL_FILE))
    (d / CONFIG_FILE).write_text(json.dumps({"model_type": "qwen3", "seed": seed}))
    return d


async def test_objstore_round_trip_announce_and_prune(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    assert await current_version(js, RUN) is None
    assert chunk_size(js) == 4 * 1024 * 1024  # the test server raises max_payload to 8 MiB

    published = []
    for v in range(5):
        state = write_state(tmp_path / f"state{v}", seed=v)
        wv = await publish_version(js, RUN, v, step=v, state_dir=state, settings=ObjstoreWeights(), keep=3)
        published.append(wv)
        assert (await current_version(js, RUN)) == wv

    got = await fetch_version(js, RUN, published[-1], tmp_path / "actor" / "v4", rehash=True)
    assert (got / MODEL_FILE).read_bytes() == (tmp_path / "state4" / MODEL_FILE).read_bytes()
    assert json.loads((got / CONFIG_FILE).read_text()) == {"model_type": "qwen3", "seed": 4}
    assert not list(got.glob("*.part"))

    # versions 0 and 1 are beyond keep=3 and were deleted
    with pytest.raises(WeightVerifyError, match="not in the store"):
        await fetch_version(js, RUN, published[0], tmp_path / "actor" / "v0")
    await fetch_version(js, RUN, published[2], tmp_path / "actor" / "v2")

    # an announcement that does not match the blob is refused, and nothing is left behind
    forged = msgspec.structs.replace(published[3], sha256="0" * 64)
    with pytest.raises(WeightVerifyError, match="announced 0000"):
        await fetch_version(js, RUN, forged, tmp_path / "actor" / "forged")
    assert not (tmp_path / "actor" / "forged" / MODEL_FILE).exists()
    short = msgspec.structs.replace(published[3], bytes=published[3].bytes - 1)
    with pytest.raises(WeightVerifyError):
        await fetch_version(js, RUN, short, tmp_path / "actor" / "short")


async def test_republishing_a_lower_version_moves_the_key_back(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    await publish_version(js, RUN, 3, step=3, state_dir=write_state(tmp_path / "a", 1, 0.1), settings=ObjstoreWeights())
    again = await publish_version(
        js, RUN, 2, step=2, state_dir=write_state(tmp_path / "b", 2, 0.1), settings=ObjstoreWeights()
    )
    assert (await current_version(js, RUN)) == again


async def test_shared_dir_transport_verifies_in_place(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    shared = tmp_path / "shared"
    settings = SharedDirWeights(dir=str(shared))
    for v in range(3):
        wv = await publish_version(
            js,
            RUN,
            v,
            step=v,
            state_dir=write_state(tmp_path / f"s{v}", v, 0.5),
            settings=settings,
            keep=2,
        )
    assert sorted(p.name[:7] for p in (shared / RUN).iterdir()) == ["v000001", "v000002"]
    got = await fetch_version(js, RUN, wv, tmp_path / "unused", settings=settings)
    assert got == Path(wv.location) and got.parent == shared / RUN and got.name.startswith("v000002-")
    (got / MODEL_FILE).write_bytes(b"corrupt")
    with pytest.raises(WeightVerifyError, match="has sha256"):
        await fetch_version(js, RUN, wv, tmp_path / "unused", settings=settings)


async def test_shared_dir_locations_outside_the_configured_root_are_refused(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    shared = tmp_path / "shared"
    settings = SharedDirWeights(dir=str(shared))
    wv = await publish_version(js, RUN, 1, step=1, state_dir=write_state(tmp_path / "s", 1, 0.1), settings=settings)
    elsewhere = write_state(tmp_path / "attacker", 2, 0.1)  # a valid version, but not where versions live
    (shared / RUN / "escape").symlink_to(elsewhere)
    for location in (str(elsewhere), "../../attacker", f"{shared / RUN}/../../attacker", "escape", ".", "/"):
        forged = msgspec.structs.replace(wv, location=location)
        with pytest.raises(WeightVerifyError, match="outside the shared directory"):
            await fetch_version(js, RUN, forged, tmp_path / "unused", settings=settings)
    for files in (["../config.json"], [MODEL_FILE], [".."]):
        with pytest.raises(WeightVerifyError, match="extra file name"):
            await fetch_version(
                js, RUN, msgspec.structs.replace(wv, files=files), tmp_path / "unused", settings=settings
            )
    with pytest.raises(WeightVerifyError, match="no shared directory configured"):
        await fetch_version(js, RUN, wv, tmp_path / "unused")
    # A relative location is taken under the root, like the absolute one the learner announces.
    relative = msgspec.structs.replace(wv, location=Path(wv.location).name)
    assert await fetch_version(js, RUN, relative, tmp_path / "unused", settings=settings) == Path(wv.location)


async def test_objstore_extra_objects_must_be_plain_files_beside_the_model(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    wv = await publish_version(
        js, RUN, 1, step=1, state_dir=write_state(tmp_path / "s", 1, 0.1), settings=ObjstoreWeights()
    )
    folder = wv.location.rsplit("/", 1)[0]
    # An extra object named like the model would overwrite the verified blob with an unverified one.
    for files, match in (
        ([f"{folder}/{MODEL_FILE}"], "extra file name"),
        ([f"{folder}/.."], "extra file name"),
        (["v000009-00/config.json"], "not beside"),
    ):
        with pytest.raises(WeightVerifyError, match=match):
            await fetch_version(js, RUN, msgspec.structs.replace(wv, files=files), tmp_path / "actor")
    assert not (tmp_path / "actor" / MODEL_FILE).exists()


@pytest.mark.parametrize(
    "make",
    [lambda shared: ObjstoreWeights(), lambda shared: SharedDirWeights(dir=str(shared))],
    ids=["objstore", "shared_dir"],
)
async def test_republishing_a_version_leaves_what_actors_load_alone(js, tmp_path, make):
    """A resumed learner publishes version 2 again: the first publication (an actor may be loading it,
    or serves it) is not rewritten, and a version an actor serves is not pruned."""
    await topology.ensure_topology(js, RUN)
    settings = make(tmp_path / "shared")

    async def pub(v, seed, protect=frozenset()):
        return await publish_version(
            js,
            RUN,
            v,
            step=v,
            state_dir=write_state(tmp_path / f"s{v}-{seed}", seed, 0.1),
            settings=settings,
            keep=1,
            protect=protect,
        )

    first = await pub(2, seed=1)
    served = await fetch_version(js, RUN, first, tmp_path / "actor-first", settings=settings)
    second = await pub(2, seed=2)
    assert second.location != first.location and second.sha256 != first.sha256
    # the first publication is intact: same bytes, still verifies (the version number is kept)
    again = await fetch_version(js, RUN, first, tmp_path / "actor-again", settings=settings, rehash=True)
    assert (again / MODEL_FILE).read_bytes() == (served / MODEL_FILE).read_bytes()
    # version 2 served by an actor survives keep=1 while 3 and 4 are published
    await pub(3, seed=3, protect={2})
    await pub(4, seed=4, protect={2})
    await fetch_version(js, RUN, second, tmp_path / "actor-2", settings=settings)
    await pub(5, seed=5)  # nobody serves 2 any more: pruned
    with pytest.raises(WeightVerifyError):
        await fetch_version(js, RUN, second, tmp_path / "actor-2b", settings=settings)


async def test_served_versions_come_from_the_actors_heartbeats(nc):
    import asyncio

    from parley.protocol import status
    from parley.protocol.messages import Heartbeat
    from parley.weights.common import ServedVersions

    served = ServedVersions(nc, RUN)
    await served.start()
    for ident, version, state in (
        ("a0", 3, "busy"),
        ("a1", 5, "ready"),
        ("a2", 7, "ready"),
        ("a2", 7, "stopping"),
        ("a3", -1, "starting"),
    ):
        await status.send(nc, RUN, Heartbeat(role="actor", id=ident, state=state, version=version))
    await status.send(nc, RUN, Heartbeat(role="learner", id="l", state="ready", version=9))  # not an actor
    for _ in range(100):
        await nc.flush()
        if served.versions() == {3, 5}:
            break
        await asyncio.sleep(0.05)
    assert served.versions() == {3, 5}
    await served.stop()


async def test_learner_publication_waits_out_a_nats_outage(nats_server, tmp_path):
    """The learner's publish retries while nats-server is down and completes once it is back."""
    import asyncio

    from parley.protocol.bus import retry_unreachable
    from parley.protocol.connect import connect

    nc = await connect(nats_server.url, name="outage")
    js = nc.jetstream()
    try:
        await topology.ensure_topology(js, RUN)
        state = write_state(tmp_path / "v1", seed=1, mib=1.0)
        nats_server.stop()

        async def restart_later():
            await asyncio.sleep(3.0)
            await asyncio.to_thread(nats_server.start)  # same store dir, same port

        restart = asyncio.create_task(restart_later())
        wv = await retry_unreachable(
            lambda: publish_version(js, RUN, 1, 1, state, ObjstoreWeights()),
            what="publish v1",
            give_up_s=120.0,
            first_delay_s=0.5,
        )
        await restart
        assert wv.version == 1
        assert (await current_version(js, RUN)).sha256 == wv.sha256
    finally:
        await nc.close()


async def test_a_pipelined_upload_is_an_object_any_client_reads_and_replaces_the_old_one(js, monkeypatch, tmp_path):
    """weights.objstore._put_object (up to PUT_WINDOW chunks awaiting their acks) writes the object
    store's own layout: nats.py's ObjectStore.get reads it back and checks its digest, _get_object
    reads it with the same sha256, and a second upload under the same name replaces the first and
    purges its chunks (the stream then holds the new chunks and one meta message)."""
    import hashlib
    import os

    from nats.js.object_store import OBJ_STREAM_TEMPLATE

    from parley.weights import objstore

    monkeypatch.setattr(objstore, "MAX_CHUNK", 256 * 1024)  # 13 chunks: more than the window below
    monkeypatch.setattr(objstore, "PUT_WINDOW", 2)
    await topology.ensure_topology(js, RUN)
    store = await js.object_store(topology.object_bucket(RUN))
    stream = OBJ_STREAM_TEMPLATE.format(bucket=topology.object_bucket(RUN))
    first, second = os.urandom(3 * 1024 * 1024 + 123), os.urandom(2 * 1024 * 1024)
    sha, size = await objstore._put_object(js, RUN, "v1/blob", first)
    assert (sha, size) == (hashlib.sha256(first).hexdigest(), len(first))
    got = await store.get("v1/blob")  # nats.py's reader: checks the digest itself
    assert got.data == first and got.info.chunks == 13
    sha, size = await objstore._put_object(js, RUN, "v1/blob", second)
    assert (await store.get("v1/blob")).data == second
    assert await objstore._get_object(js, RUN, "v1/blob", tmp_path / "out") == (
        hashlib.sha256(second).hexdigest(),
        len(second),
    )
    assert (await js.stream_info(stream)).state.messages == 8 + 1  # the first upload's 13 chunks purged


async def test_a_refused_chunk_fails_the_upload_and_leaves_nothing_behind(js, monkeypatch):
    """A chunk the server refuses (here: the bucket is full) raises with the server's reason; the
    chunks already sent are purged and no meta is written, so no reader ever sees a partial object."""
    import os

    from nats.js import api
    from nats.js.errors import NotFoundError
    from nats.js.object_store import OBJ_STREAM_TEMPLATE

    from parley.weights import objstore

    run = "refused"
    monkeypatch.setattr(objstore, "MAX_CHUNK", 256 * 1024)
    bucket = topology.object_bucket(run)
    store = await js.create_object_store(bucket, config=api.ObjectStoreConfig(bucket=bucket, max_bytes=1024 * 1024))
    with pytest.raises(RuntimeError, match="refused by the server"):
        await objstore._put_object(js, run, "v1/blob", os.urandom(3 * 1024 * 1024))
    with pytest.raises(NotFoundError):
        await store.get_info("v1/blob")
    assert (await js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=bucket))).state.messages == 0


async def test_a_prune_whose_purge_times_out_still_announces_and_the_next_prune_purges_the_chunks(
    js, tmp_path, monkeypatch
):
    """Pruning is cleanup after the announcement. The H200's failure (an 8 GB object's purge outlasted
    nats.py's 5 s API timeout, 2026-12-04) as the store sees it: the old object's meta is published as
    deleted (it leaves the listing, so no prune sees it again), then the purge of its chunk subject times
    out without the server having purged it. The publication returns and is current, the failure is
    counted, the chunks are still in the stream, and the next publication's prune purges them."""
    import nats.errors
    from nats.js.errors import NotFoundError
    from nats.js.manager import JetStreamManager
    from nats.js.object_store import OBJ_META_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

    from parley.protocol.bus import COUNTERS
    from parley.weights import objstore

    run = "prunetimeout"
    monkeypatch.setattr(objstore, "MAX_CHUNK", 128 * 1024)  # several chunks an object
    await topology.ensure_topology(js, run)
    bucket = topology.object_bucket(run)
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    real, timed_out = JetStreamManager._api_request, []

    async def chunk_purge_times_out_once(self, subject, req=b"", timeout=5):
        # The first purge of an object's chunks is not made (as a server that never finished it) and
        # times out as nats.py's request does; every other request is made.
        purge = subject.endswith(f".STREAM.PURGE.{stream}") and ".C." in json.loads(req or b"{}").get("filter", "")
        if purge and not timed_out:
            timed_out.append(json.loads(req)["filter"])
            raise nats.errors.TimeoutError
        return await real(self, subject, req, timeout)

    async def chunks_of(subject):
        info = await js.stream_info(stream, subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0)

    monkeypatch.setattr(JetStreamManager, "_api_request", chunk_purge_times_out_once)
    failed = COUNTERS["weights.prune_failed"]
    published = [
        await publish_version(
            js, run, v, v, write_state(tmp_path / f"s{v}", seed=v, mib=0.5), ObjstoreWeights(), keep=1
        )
        for v in range(2)
    ]
    assert await current_version(js, run) == published[1]  # announced although its prune failed
    assert COUNTERS["weights.prune_failed"] == failed + 1
    assert len(timed_out) == 1
    # Version 0's objects are out of the listing (their metas marked deleted), but the chunks of the one
    # whose purge timed out are still in the stream.
    store = await js.object_store(bucket)
    for name in [published[0].location] + published[0].files:
        with pytest.raises(NotFoundError):
            await store.get_info(name)
    assert await chunks_of(timed_out[0]) > 1

    latest = await publish_version(
        js, run, 2, 2, write_state(tmp_path / "s2", seed=2, mib=0.5), ObjstoreWeights(), keep=1
    )
    assert COUNTERS["weights.prune_failed"] == failed + 1
    assert await chunks_of(timed_out[0]) == 0
    for old in published:
        with pytest.raises(WeightVerifyError, match="not in the store"):
            await fetch_version(js, run, old, tmp_path / f"gone{old.version}")
    # What is left: the chunks of version 2's objects and one meta message for each object ever stored
    # (two a version: the model and config.json).
    live = await store.list(ignore_deletes=True)
    assert sorted(i.name for i in live) == sorted([latest.location] + latest.files)
    metas = (await js.stream_info(stream, subjects_filter=OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=">"))).state
    assert len(metas.subjects) == 3 * len(live)
    assert (await js.stream_info(stream)).state.messages == sum(i.chunks for i in live) + len(metas.subjects)
    await fetch_version(js, run, latest, tmp_path / "latest", rehash=True)


@pytest.mark.parametrize("stored", [False, True], ids=["meta_not_stored", "meta_stored"])
async def test_a_prune_whose_deleted_meta_times_out_purges_nothing_then_the_next_prune_finishes_it(
    js, tmp_path, monkeypatch, stored
):
    """A prune's publish of the deleted meta that times out purges no chunk (nats.py's ObjectStore.delete
    purges in a `finally`: the chunks of an object perhaps still listed). Either the meta was not
    stored (the object is still listed, whole) or it was (the object is out of the listing, its chunks
    still in the stream); the next publication's prune deletes the one and purges the other's chunks."""
    import nats.errors
    from nats.js.client import JetStreamContext
    from nats.js.errors import NotFoundError
    from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

    from parley.protocol.bus import COUNTERS

    run = "prunemeta"
    await topology.ensure_topology(js, run)
    bucket = topology.object_bucket(run)
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    real, timed_out = JetStreamContext.publish, []

    async def deleted_meta_times_out_once(self, subject, payload=b"", *args, **kwargs):
        if subject.startswith(f"$O.{bucket}.M.") and json.loads(payload).get("deleted") and not timed_out:
            timed_out.append(json.loads(payload))
            if stored:
                await real(self, subject, payload, *args, **kwargs)
            raise nats.errors.TimeoutError
        return await real(self, subject, payload, *args, **kwargs)

    async def chunks_of(nuid):
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
        info = await js.stream_info(stream, subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0)

    monkeypatch.setattr(JetStreamContext, "publish", deleted_meta_times_out_once)
    failed = COUNTERS["weights.prune_failed"]
    published = [
        await publish_version(
            js, run, v, v, write_state(tmp_path / f"s{v}", seed=v, mib=0.5), ObjstoreWeights(), keep=1
        )
        for v in range(2)
    ]
    assert await current_version(js, run) == published[1]
    assert COUNTERS["weights.prune_failed"] == failed + 1
    name, nuid = timed_out[0]["name"], timed_out[0]["nuid"]
    store = await js.object_store(bucket)
    if stored:
        with pytest.raises(NotFoundError):
            await store.get_info(name)
    else:
        assert (await store.get_info(name)).nuid == nuid  # still listed, and whole
    assert await chunks_of(nuid) >= 1

    await publish_version(js, run, 2, 2, write_state(tmp_path / "s2", seed=2, mib=0.5), ObjstoreWeights(), keep=1)
    assert COUNTERS["weights.prune_failed"] == failed + 1
    with pytest.raises(NotFoundError):
        await store.get_info(name)
    assert await chunks_of(nuid) == 0


def test_the_purge_of_an_object_waits_a_floor_plus_time_per_gib_up_to_a_ceiling():
    from parley.weights import objstore

    assert objstore.purge_timeout_s(0) == objstore.PURGE_FLOOR_S > 5  # more than nats.py's 5 s API timeout
    assert objstore.purge_timeout_s(8 * 2**30) == objstore.PURGE_FLOOR_S + 8 * objstore.PURGE_S_PER_GIB
    assert objstore.purge_timeout_s(8 * 2**30) > 10 * 3.7  # ten times the 2-core VM's 8 GiB purge
    assert objstore.purge_timeout_s(10**12) == objstore.PURGE_MAX_S
