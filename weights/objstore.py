"""The `objstore` weight transport (the default): a version's files in the run's NATS object store,
read back by actors with direct gets and checked as they arrive. Needs no shared disk; actors can
be anywhere the bus reaches. Registered in weights.registry.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import io
import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import APIError, NotFoundError
from nats.js.object_store import (
    MSG_ROLLUP_SUBJECT,
    OBJ_ALL_META_PRE_TEMPLATE,
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)
from nats.nuid import NUID

from parley.errors import ParleyError
from parley.protocol import topology
from parley.protocol.bus import COUNTERS
from parley.weights.common import (
    MODEL_FILE,
    VERSION_DIR,
    Transport,
    WeightStoreTooSmall,
    WeightUnavailable,
    WeightVerifyError,
    check_extra,
    extra_digests,
    old_versions,
    plain_name,
    verify_file,
)
from parley.weights.delta import DELTA_FILE

log = logging.getLogger(__name__)

# Object-store chunks: big enough that per-message overhead vanishes (docs/benchmarks.md, "Observations
# behind the code"), small enough to stay under the server's max_payload (1 MiB on a stock server).
MAX_CHUNK = 4 * 1024 * 1024
_PAYLOAD_HEADROOM = 16 * 1024
PUT_WINDOW = 8  # chunk publishes of one upload awaiting their acks at once (_put_object)
PUT_ACK_S = 30.0  # the longest wait for one chunk's ack before an upload gives up

# Purging an object's chunks (a stream purge filtered to its chunk subject) takes time with its size,
# and an 8 GB object's purge can outlast nats.py's 5 s API timeout (docs/benchmarks.md, "Weight path",
# has the figures). The wait is PURGE_FLOOR_S (twice that 5 s: a small object's purge is
# a round trip, but the server may be busy storing the next version's chunks) plus PURGE_S_PER_GIB per
# GiB (ten times what the 2-core VM's disk took a GiB, for a slower or busier disk), at most PURGE_MAX_S: the prune runs
# inside the learner's publication, and the next version's publication waits behind it. A purge that
# still outlasts it is made again at the next prune (_delete_object, _purge_left), so a short wait
# costs a second purge, never chunks left behind.
PURGE_FLOOR_S = 10.0
PURGE_S_PER_GIB = 5.0
PURGE_MAX_S = 120.0

# Chunk subjects whose purge timed out or failed, by bucket: {chunk subject: (object name, nuid,
# bytes)}, purged again by the next prune of that bucket before anything else. In the module, so that
# it lasts between the publications of a learner process (the transport object is one for all runs).
_UNPURGED: dict[str, dict[str, tuple[str, str, int]]] = {}

# A chunk subject that no listed object names (a learner killed during an upload leaves one; nothing
# else would ever purge it) is an orphan once its newest chunk is this old: an upload that is alive
# stores a chunk at least every PUT_ACK_S or gives up and purges its own, so the margin is generous.
ORPHAN_AGE_S = 4 * PUT_ACK_S


def chunk_size(js) -> int:
    """Object-store chunk size for this connection: MAX_CHUNK, or less when the server's max_payload is smaller."""
    nc = getattr(js, "_nc", None)
    max_payload = getattr(nc, "max_payload", 0) or 1024 * 1024
    return max(64 * 1024, min(MAX_CHUNK, max_payload - _PAYLOAD_HEADROOM))


def purge_timeout_s(size: int) -> float:
    """How long to wait for the purge of an object of `size` bytes (the rule above PURGE_FLOOR_S)."""
    return min(PURGE_MAX_S, PURGE_FLOOR_S + PURGE_S_PER_GIB * max(0, size or 0) / 2**30)


class Objstore(Transport):
    kind = "objstore"
    stores_on_bus = True
    delta_first = True  # the full upload (seconds to a minute) runs after the delta is announced

    def full_location(self, prefix: str) -> str:
        return f"{prefix}/{MODEL_FILE}"

    async def upload(self, js, run, prefix, state_dir, extras, settings):
        location, sha, size = await self.upload_model(js, run, prefix, state_dir)
        return location, sha, size, await self.upload_extras(js, run, prefix, state_dir, extras)

    async def upload_model(self, js, run, prefix, state_dir) -> tuple[str, str, int]:
        """model.safetensors under `prefix`: (location, sha256, bytes)."""
        location = self.full_location(prefix)
        # _put_object hashed every byte it sent (sha256): no second pass over the file.
        sha, size = await _put_object(js, run, location, state_dir / MODEL_FILE)
        return location, sha, size

    async def upload_extras(self, js, run, prefix, state_dir, extras) -> list[str]:
        """The small files beside the model (config.json): their object names. Before an early
        announcement, so that an actor rebuilding the model from the delta finds them."""
        files = []
        for name in extras:
            obj = f"{prefix}/{name}"
            await _put_object(js, run, obj, state_dir / name)
            files.append(obj)
        return files

    async def upload_delta(self, js, run, prefix, path, settings):
        location = f"{prefix}/{DELTA_FILE}"
        sha, _ = await _put_object(js, run, location, path)
        return location, sha  # as for the model: the upload hashed what it sent

    async def wait_full(self, js, run, wv, settings, timeout_s):
        # The store writes an object's meta after its last chunk: get_info finds it only once complete.
        store = await js.object_store(topology.object_bucket(run))
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + timeout_s, 0.05
        while True:
            try:
                await store.get_info(wv.location)
                return
            except NotFoundError:
                pass
            if loop.time() >= deadline:
                raise WeightUnavailable(
                    f"version {wv.version}: its full copy {wv.location} was not stored within "
                    f"{timeout_s:.0f}s of the early announcement; tried again at the next poll"
                )
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)

    async def fetch_delta(self, js, run, wv, out, settings):
        delta = wv.delta
        if delta.location != f"{wv.location.rsplit('/', 1)[0]}/{DELTA_FILE}":
            raise WeightVerifyError(
                f"version {wv.version}: delta object {delta.location!r} is not beside {wv.location!r}; refused"
            )
        try:
            sha, size = await _get_object(js, run, delta.location, out)
            if (sha, size) != (delta.sha256, delta.bytes):
                raise WeightVerifyError(
                    f"version {wv.version}: delta has sha256 {sha[:16]}.. / {size} bytes, "
                    f"announced {delta.sha256[:16]}.. / {delta.bytes} bytes"
                )
        except BaseException:
            out.unlink(missing_ok=True)
            raise
        return out

    async def fetch_extras(self, js, run, wv, dest, settings):
        version_dir = wv.location.rsplit("/", 1)[0]
        extras = []
        for obj in wv.files:  # objects of the same publication, each landing under a plain name beside the model
            folder, _, name = obj.rpartition("/")
            if folder != version_dir:
                raise WeightVerifyError(
                    f"version {wv.version}: extra object {obj!r} is not beside {wv.location!r}; refused"
                )
            extras.append((obj, plain_name(wv, name)))
        extra_digests(wv)  # every file announced with its checksum, before any is fetched
        for obj, name in extras:
            try:
                sha, _ = await _get_object(js, run, obj, dest / name)
                check_extra(wv, name, sha, obj)
            except BaseException:
                (dest / name).unlink(missing_ok=True)
                raise

    async def prune(self, js, run, settings, keep, current, protect):
        """Delete the objects of old versions (_delete_object), after purging again the chunks of
        earlier deletes whose purge timed out or failed (_purge_left). Pruning is cleanup after the
        announcement: a delete or purge that times out or is refused is logged and counted
        (weights.prune_failed), and the publication returns."""
        bucket = topology.object_bucket(run)
        store = await js.object_store(bucket)
        await _purge_left(js, store, bucket)
        try:
            infos = await list_objects(js, bucket)
        except NotFoundError:
            return
        await purge_orphans(js, bucket)
        live = [i for i in infos if not i.deleted]
        old = old_versions([VERSION_DIR.match(i.name) for i in live], keep, current, protect)
        for info in live:
            m = VERSION_DIR.match(info.name)
            if m and int(m.group(1)) in old:
                try:
                    await _delete_object(js, bucket, info)
                except _DeleteIncomplete as e:
                    # The version is announced already (purging an 8 GB object's 2,000 chunks can
                    # outlast nats.py's API timeout).
                    COUNTERS["weights.prune_failed"] += 1
                    log.warning("pruning %s: %s", info.name, e)

    async def at_start(self, js, run, version_bytes):
        """Orphan chunks of an earlier learner purged (purge_orphans); the store's max_bytes checked
        against one version (the learner then needs room for it beside the kept ones). Called under
        the run's lease (learner.service takes it first): no other learner can be uploading, so every
        chunk no object names is an orphan whatever its age, even one a learner killed a second ago left."""
        bucket = topology.object_bucket(run)
        await purge_orphans(js, bucket, min_age_s=0.0)
        limit = (await js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=bucket))).config.max_bytes or -1
        if version_bytes and 0 < limit < version_bytes:
            raise WeightStoreTooSmall(
                f"the weights object store {bucket} holds at most {limit} bytes (its max_bytes) but one version "
                f"of this policy is about {version_bytes} bytes: set [bus] blobs_max_bytes to at least "
                f"{version_bytes} x ([learner] keep_versions + 2) (or 0 to derive it) and run "
                "`parley auth topology` (admin) or `parley up` again"
            )

    async def fetch(self, js, run, wv, dest, settings, rehash):
        """The files are written into `dest` (created); the received bytes are hashed as they are
        written and checked against the announcement, so the file on disk is the learner's
        (rehash=True reads it back once more)."""
        version_dir = wv.location.rsplit("/", 1)[0]
        for obj in wv.files:  # checked before any byte is fetched
            if obj.rpartition("/")[0] != version_dir:
                raise WeightVerifyError(
                    f"version {wv.version}: extra object {obj!r} is not beside {wv.location!r}; refused"
                )
            plain_name(wv, obj.rpartition("/")[2])
        extra_digests(wv)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        part = dest / f"{MODEL_FILE}.part"
        try:
            sha, size = await _get_object(js, run, wv.location, part)
            if sha != wv.sha256 or size != wv.bytes:
                raise WeightVerifyError(
                    f"version {wv.version}: got sha256 {sha[:16]}.. / {size} bytes, "
                    f"announced {wv.sha256[:16]}.. / {wv.bytes} bytes"
                )
            if rehash:
                await asyncio.to_thread(verify_file, part, wv)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, dest / MODEL_FILE)
        await self.fetch_extras(js, run, wv, dest, settings)
        return dest


def chunks_stored(name: str) -> None:
    """Called by _put_object when every chunk of an upload is stored and no meta names them yet: a
    no-op that the learner replaces with its kill point there (runtime.killpoints "upload"; a
    neutral package may not import runtime, so the learner, above both, connects them)."""


async def _put_object(js, run: str, name: str, data: Path | bytes) -> tuple[str, int]:
    """Store `data` (a file, or bytes) as object `name` in the run's object store, in the store's own
    layout (NATS ADR-20, as nats.py's ObjectStore.put writes it: the chunks on a fresh subject, then
    the meta message with a rollup, then the chunks of an older object of that name purged), so any
    client reads it back, ObjectStore.get and _get_object alike. Unlike ObjectStore.put, which waits
    for each chunk's ack before it reads the next (docs/benchmarks.md has both rates), up to
    PUT_WINDOW chunks are acked at once, and the next chunk is read and hashed in a thread while
    they are. Chunks go out in order on one connection, so the stream holds them in order. Returns
    (sha256 hex, bytes). A chunk not acked within PUT_ACK_S, or refused, purges what was sent and raises."""
    nc = js._nc  # the connection under the JetStream context (chunk_size reads it too)
    bucket = topology.object_bucket(run)
    store = await js.object_store(bucket)
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    nuid = NUID().next().decode()
    chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
    try:
        old = await store.get_info(name)
    except NotFoundError:
        old = None
    size_chunk = chunk_size(js)
    h = hashlib.sha256()
    acks: asyncio.Queue = asyncio.Queue()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(f"{inbox}.*", cb=acks.put)
    sent = acked = replied = total = 0

    def read(f) -> bytes:
        chunk = f.read(size_chunk)
        h.update(chunk)
        return chunk

    async def ack() -> None:
        nonlocal acked, replied
        try:
            msg = await asyncio.wait_for(acks.get(), PUT_ACK_S)
        except TimeoutError:
            raise TimeoutError(
                f"object {name}: a chunk was not acknowledged within {PUT_ACK_S:.0f} s ({acked} of {sent} were)"
            ) from None
        replied += 1
        reply = json.loads(msg.data) if msg.data else {}
        if "error" in reply or "seq" not in reply:
            raise RuntimeError(
                f"object {name}: a chunk was refused by the server: "
                f"{reply.get('error') or msg.headers or 'no JetStream stream answered'}"
            )
        acked += 1

    try:
        with data.open("rb") if isinstance(data, Path) else io.BytesIO(data) as f:
            while chunk := await asyncio.to_thread(read, f):
                await nc.publish(chunks, chunk, reply=f"{inbox}.{sent}")
                sent += 1
                total += len(chunk)
                while sent - acked > PUT_WINDOW:
                    await ack()
            while acked < sent:
                await ack()
        chunks_stored(name)  # every chunk stored, no meta names them yet
        digest = h.digest()
        info = api.ObjectInfo(
            name=name,
            bucket=bucket,
            nuid=nuid,
            size=total,
            chunks=sent,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(digest).decode()),
            options=api.ObjectMetaOptions(max_chunk_size=size_chunk),
        )
        meta = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())
        await js.publish(meta, json.dumps(info.as_dict()).encode(), headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT})
    except BaseException:
        try:
            # Chunks still in flight are stored after a purge made now (a full bucket that refused one
            # chunk took the next ones once the purge freed it: two left behind, in
            # tests/integration/test_weights.py under load), so the replies to every chunk sent come
            # first (in order on one connection: the last one means all were handled), for at most
            # PUT_ACK_S.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + PUT_ACK_S
            while replied < sent and loop.time() < deadline:
                await asyncio.wait_for(acks.get(), deadline - loop.time())
                replied += 1
        except Exception:  # noqa: BLE001 - a reply that never came: purge what is there
            pass
        try:
            await js.purge_stream(stream, subject=chunks)
        except Exception:  # noqa: BLE001 - the upload's own error is the one to raise
            pass
        raise
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - a closed connection: the upload's own error, if any, is raised
            pass
    if old is not None and not old.deleted:
        await js.purge_stream(stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=old.nuid))
    return digest.hex(), total


class _DeleteIncomplete(ParleyError):
    """_delete_object did not finish; the message says what is left and what the next prune does."""


async def _purge_chunks(js, bucket: str, chunks: str, size: int) -> None:
    """Purge the chunk subject `chunks` from the bucket's stream, waiting purge_timeout_s(size): the
    request nats.py's purge_stream makes ($JS.API.STREAM.PURGE.<stream> under the context's API
    prefix, {"filter": subject}), whose wait purge_stream fixes at the context's API timeout."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    await js._api_request(
        f"{js._prefix}.STREAM.PURGE.{stream}", json.dumps({"filter": chunks}).encode(), timeout=purge_timeout_s(size)
    )


async def _delete_object(js, bucket: str, info: api.ObjectInfo) -> None:
    """Delete object `info` (as listed) from `bucket` in the store's own layout (NATS ADR-20, as
    nats.py's ObjectStore.delete writes it): its meta message replaced, with a rollup, by one marked
    deleted (size, chunks, digest and mtime emptied, the nuid kept), then its chunk subject purged.
    Unlike ObjectStore.delete, the purge waits purge_timeout_s(size), not the context's 5 s API timeout;
    a purge that still times out or is refused leaves the object deleted from the listing (no prune
    sees it again), so its chunk subject is remembered in _UNPURGED and purged at the next prune
    (_purge_left). A meta publish that fails purges nothing (ObjectStore.delete purges in a `finally`:
    the chunks of an object perhaps still listed); it is remembered too, since a publish that timed
    out may have been stored. Both raise _DeleteIncomplete; anything else (a closed connection) raises
    as it is, the subject remembered."""
    if not info.nuid:
        raise _DeleteIncomplete(f"its meta has no nuid ({info!r}); not deleted")
    chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
    size = info.size or 0
    meta = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(info.name.encode()).decode())
    deleted = dataclasses.replace(info, deleted=True, size=0, chunks=0, digest="", mtime="")
    left = _UNPURGED.setdefault(bucket, {})
    left[chunks] = (info.name, info.nuid, size)  # until the purge is done: whatever breaks, the next prune finishes it
    try:
        await js.publish(meta, json.dumps(deleted.as_dict()).encode(), headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT})
    except (TimeoutError, NatsTimeoutError, APIError) as e:
        raise _DeleteIncomplete(
            f"marking it deleted failed ({type(e).__name__}: {e}); the next prune "
            "deletes it if it is still listed, or purges its chunks"
        ) from e
    try:
        await _purge_chunks(js, bucket, chunks, size)
    except (TimeoutError, NatsTimeoutError, APIError) as e:
        timed_out = isinstance(e, (NatsTimeoutError, asyncio.TimeoutError))
        what = f"timed out after {purge_timeout_s(size):.0f} s" if timed_out else "was refused"
        raise _DeleteIncomplete(
            f"deleted from the listing, but the purge of its {info.chunks} chunks "
            f"({size / 1e9:.2f} GB) {what} ({type(e).__name__}: {e}); its chunks "
            f"({chunks}) are purged again at the next prune"
        ) from e
    del left[chunks]
    if not left:
        _UNPURGED.pop(bucket, None)


async def _purge_left(js, store, bucket: str) -> None:
    """Purge again the chunk subjects in _UNPURGED[bucket] (a purge of a subject already purged
    removes nothing). One whose object is listed with that nuid (a meta publish that timed out and
    was not stored) is not purged: it is dropped, and the listing that follows deletes the object if
    it is still old. A stream that is gone has nothing left to purge. One that times out or is refused
    again stays for the next prune, counted in weights.prune_failed."""
    left = _UNPURGED.get(bucket)
    for chunks, (name, nuid, size) in list((left or {}).items()):
        try:
            info = await store.get_info(name, show_deleted=True)
        except NotFoundError:
            info = None
        except (TimeoutError, NatsTimeoutError, APIError) as e:
            COUNTERS["weights.prune_failed"] += 1
            log.warning(
                "purging the chunks of %s again: reading its meta failed (%s: %s); tried at the next prune",
                name,
                type(e).__name__,
                e,
            )
            continue
        if info is not None and info.nuid == nuid and not info.deleted:
            del left[chunks]
            continue
        try:
            await _purge_chunks(js, bucket, chunks, size)
        except NotFoundError:  # the stream is gone, and its chunks with it
            pass
        except (TimeoutError, NatsTimeoutError, APIError) as e:
            COUNTERS["weights.prune_failed"] += 1
            log.warning(
                "purging the chunks of %s (%s) again failed (%s: %s); tried again at the next prune",
                name,
                chunks,
                type(e).__name__,
                e,
            )
            continue
        else:
            log.info("purged the chunks of %s (%s) left by an earlier prune", name, chunks)
        del left[chunks]
    if left == {}:
        _UNPURGED.pop(bucket, None)


async def purge_orphans(js, bucket: str, min_age_s: float | None = None) -> int:
    """Purge every chunk subject of `bucket` that no live (not deleted) object names and whose newest
    chunk is at least `min_age_s` old: what a learner killed during an upload, or during a delete
    whose purge never came, left behind (the in-memory _UNPURGED dies with that process). Called at
    the learner's start (Objstore.at_start) and by every prune. The chunk subjects are listed first
    and the objects after, so an upload that stores its meta in between is seen as live; one still
    sending chunks is younger than min_age_s. Failures are logged and counted (weights.prune_failed):
    the next prune tries again. Returns the number of subjects purged. min_age_s: ORPHAN_AGE_S."""
    min_age_s = ORPHAN_AGE_S if min_age_s is None else min_age_s
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    prefix = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj="")
    try:
        subjects = (await js.stream_info(stream, subjects_filter=prefix + ">")).state.subjects or {}
        live = {i.nuid for i in await list_objects(js, bucket) if not i.deleted}
    except NotFoundError:
        return 0
    except (TimeoutError, NatsTimeoutError, APIError) as e:
        COUNTERS["weights.prune_failed"] += 1
        log.warning(
            "listing the chunks of %s for orphans failed (%s: %s); tried at the next prune", bucket, type(e).__name__, e
        )
        return 0
    purged = 0
    for chunks, count in subjects.items():
        if chunks.removeprefix(prefix) in live:
            continue
        try:
            last = await js.get_last_msg(stream, chunks, direct=True)
        except NotFoundError:  # purged meanwhile
            continue
        age = (datetime.now(UTC) - last.time).total_seconds() if last.time else float("inf")
        if age < min_age_s:
            continue
        try:
            await _purge_chunks(js, bucket, chunks, count * len(last.data or b""))
        except (TimeoutError, NatsTimeoutError, APIError) as e:
            COUNTERS["weights.prune_failed"] += 1
            log.warning(
                "purging orphan chunks %s failed (%s: %s); tried at the next prune", chunks, type(e).__name__, e
            )
            continue
        log.info("purged %d orphan chunks (%s, no object names them, the newest %.0f s old)", count, chunks, age)
        purged += 1
    return purged


async def _get_object(js, run: str, name: str, out: Path) -> tuple[str, int]:
    """Read object `name` into the file `out` chunk by chunk with direct gets (about 3x the
    throughput of the client's flow-controlled push read here: 215 vs 60 MB/s), overlapping the
    next request with writing and hashing the current chunk. Returns (sha256 hex, bytes) after
    checking them against the store's own record. Raises WeightVerifyError if anything is missing."""
    bucket = topology.object_bucket(run)
    store = await js.object_store(bucket)
    try:
        info = await store.get_info(name)
    except NotFoundError:
        raise WeightVerifyError(f"object {name} is not in the store (pruned?)") from None
    # The object store's own layout (NATS ADR-20): one stream per bucket, an object's chunks on one subject.
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
    h = hashlib.sha256()
    size = 0

    def get(seq: int):
        return asyncio.ensure_future(js.get_msg(stream, seq=seq, subject=chunks, next=True, direct=True))

    def write(f, data: bytes) -> None:
        f.write(data)
        h.update(data)

    pending = get(1) if info.chunks else None
    try:
        with out.open("wb") as f:
            for i in range(info.chunks or 0):
                try:
                    msg = await pending
                except NotFoundError:
                    raise WeightVerifyError(f"object {name}: chunk {i + 1} of {info.chunks} is missing") from None
                pending = get(msg.seq + 1) if i + 1 < info.chunks else None
                await asyncio.to_thread(write, f, msg.data)
                size += len(msg.data)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
    sha = h.hexdigest()
    if sha != _store_sha_hex(info.digest) or size != info.size:
        raise WeightVerifyError(
            f"object {name}: the bytes read do not match the store's digest/size (changed while reading?)"
        )
    return sha, size


async def list_objects(js, bucket: str) -> list[api.ObjectInfo]:
    """Every object's latest meta (deleted ones included), read with direct gets, next by subject.

    Not the client's store.list(): that is a KV-style watcher, an ordered push consumer, which the
    learner may not create (a push consumer delivers wherever its creator says; deploy/permissions.py).
    Each object's meta subject keeps only its last message (the bucket rolls meta up), so one pass
    over the meta subjects in stream order is the listing.
    """
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    metas = OBJ_ALL_META_PRE_TEMPLATE.format(bucket=bucket)
    infos: dict[str, api.ObjectInfo] = {}
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=metas, next=True, direct=True)
        except NotFoundError:
            break
        info = api.ObjectInfo.from_response(json.loads(msg.data))
        infos[info.name] = info
        seq = msg.seq + 1
    return list(infos.values())


def _store_sha_hex(digest: str | None) -> str:
    # The object store keeps "SHA-256=<urlsafe base64>".
    if not digest or "=" not in digest:
        return ""
    raw = digest.split("=", 1)[1]
    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
