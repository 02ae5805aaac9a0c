"""Policy weights by version: the learner publishes a version (safetensors + config.json, with sha256),
actors fetch and verify it. The blob travels by the run's object store or a shared directory; the
KV key `topology.WEIGHTS_KEY` names the version actors must serve. Called by deploy.cli_learner
(`publish_version`) and the actor's weight follower (`current_version`, `fetch_version`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import msgspec
from nats.js import api
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from protocol import codec, topology
from protocol.messages import CudaIpcBuffer, NcclSource, WeightVersion

log = logging.getLogger("parley.weights")

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TRANSPORTS = ("objstore", "shared_dir", "cuda_ipc", "nccl")
# Transports whose weights never become a file: the engine loads them itself (publish_gpu_version).
GPU_TRANSPORTS = ("cuda_ipc", "nccl")

# Object-store chunks: big enough that per-message overhead vanishes (150-250 MB/s measured with
# 1-4 MiB), small enough to stay under the server's max_payload (1 MiB on a stock server).
MAX_CHUNK = 4 * 1024 * 1024
_PAYLOAD_HEADROOM = 16 * 1024
# v<version>-<nonce>: every publication gets a fresh name, so re-publishing a version number (a resumed
# learner) never rewrites what an actor may be loading; the bare v<version> of older runs still matches.
_VERSION_DIR = re.compile(r"^v(\d{6,})(?:-[0-9a-f]+)?(?:/|$)")


class WeightVerifyError(Exception):
    """Fetched weights do not match their announcement (sha256 or size) or are missing."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class VersionConflict(RuntimeError):
    """Another writer changed the weights key between our read and our compare-and-set."""


def version_prefix(version: int) -> str:
    return f"v{version:06d}"


def fresh_prefix(version: int) -> str:
    """The name of one publication of `version`: never used before, never reused."""
    return f"{version_prefix(version)}-{secrets.token_hex(6)}"


def shared_root(shared_dir: str | Path, run: str) -> Path:
    """The absolute directory that holds run `run`'s shared_dir versions."""
    return Path(shared_dir).expanduser().resolve() / topology.check_run(run)


def _plain_name(wv: WeightVersion, name: str) -> str:
    # An extra file lands beside the verified model under this name: a path, "..", or the model's own
    # name would let an announcement write outside the version or replace the checked blob.
    if not name or "/" in name or "\\" in name or name in (".", "..", MODEL_FILE):
        raise WeightVerifyError(f"version {wv.version}: extra file name {name!r} is not allowed (a plain file name "
                                f"other than {MODEL_FILE}); refused")
    return name


def resolve_location(wv: WeightVersion, shared_dir: str | Path | None, run: str) -> Path:
    """The directory a shared_dir announcement names, resolved under the configured root; anything
    that resolves elsewhere (an absolute path outside it, `..`, a symlink out) is refused."""
    if not shared_dir:
        raise WeightVerifyError(
            f"version {wv.version} is on the shared_dir transport ({wv.location!r}) but this process has no shared "
            "directory configured; set [learner] shared_dir to the directory the learner publishes into"
        )
    root = shared_root(shared_dir, run)
    where = (root / wv.location).resolve()  # an absolute location replaces root here, and is checked the same
    if where == root or not where.is_relative_to(root):
        raise WeightVerifyError(
            f"version {wv.version}: location {wv.location!r} resolves to {where}, outside the shared directory {root}; "
            "refused (is [learner] shared_dir the same for learner and actors?)"
        )
    return where


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(8 * 1024 * 1024):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def chunk_size(js) -> int:
    """Object-store chunk size for this connection: MAX_CHUNK, or less when the server's max_payload is smaller."""
    nc = getattr(js, "_nc", None)
    max_payload = getattr(nc, "max_payload", 0) or 1024 * 1024
    return max(64 * 1024, min(MAX_CHUNK, max_payload - _PAYLOAD_HEADROOM))


async def current_version(js, run: str) -> WeightVersion | None:
    """The version actors must serve now, or None before the learner announced one."""
    kv = await js.key_value(topology.kv_bucket(run))
    try:
        entry = await kv.get(topology.WEIGHTS_KEY)
    except KeyNotFoundError:  # also a deleted key
        return None
    if not entry.value:
        return None
    return codec.decode("weights", entry.value)


async def publish_version(
    js,
    run: str,
    version: int,
    step: int,
    state_dir: Path,
    transport: str,
    shared_dir: str | Path | None = None,
    keep: int = 3,
    protect: frozenset[int] | set[int] = frozenset(),
) -> WeightVersion:
    """Upload `state_dir` (model.safetensors + config.json and any other small files) as `version`,
    then point the weights key at it (compare-and-set) and delete versions beyond the newest `keep`,
    except those in `protect` (what actors report serving: ServedVersions).

    Every publication goes to a fresh name (fresh_prefix): re-publishing a version number (a resumed
    learner) leaves the earlier blobs alone until pruned; the key always moves to what is published
    last, even if its number is lower (a rollback is logged).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} not allowed; use one of {TRANSPORTS}")
    if transport in GPU_TRANSPORTS:
        raise ValueError(f"transport={transport!r} publishes GPU buffers, not files; use publish_gpu_version")
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the current version is always kept)")
    state_dir = Path(state_dir)
    model = state_dir / MODEL_FILE
    if not model.is_file():
        raise FileNotFoundError(f"{model} does not exist; write the weights before publishing them")
    extras = sorted(p.name for p in state_dir.iterdir() if p.is_file() and p.name != MODEL_FILE)
    if CONFIG_FILE not in extras:
        raise FileNotFoundError(f"{state_dir / CONFIG_FILE} does not exist; vLLM needs it beside the weights")
    prefix = fresh_prefix(version)
    if transport == "objstore":
        store = await js.object_store(topology.object_bucket(run))
        opts = api.ObjectMetaOptions(max_chunk_size=chunk_size(js))
        location = f"{prefix}/{MODEL_FILE}"
        with model.open("rb") as f:
            info = await store.put(location, f, meta=api.ObjectMeta(name=location, options=opts))
        # The store hashed every byte it sent (sha256 too): no second pass over the file.
        sha, size = _store_sha_hex(info.digest), info.size
        files = []
        for name in extras:
            obj = f"{prefix}/{name}"
            await store.put(obj, (state_dir / name).read_bytes(), meta=api.ObjectMeta(name=obj, options=opts))
            files.append(obj)
    else:
        if not shared_dir:
            raise ValueError("transport='shared_dir' needs shared_dir (a directory every actor can read)")
        target = shared_root(shared_dir, run) / prefix
        sha, size = await asyncio.to_thread(file_digest, model)
        await asyncio.to_thread(_place_dir, state_dir, target)
        location, files = str(target), extras

    wv = WeightVersion(
        version=version, step=step, transport=transport, location=location, sha256=sha, bytes=size,
        created=time.time(), run=run, files=files,
    )
    await _announce(js, run, wv)
    await _prune(js, run, transport, shared_dir, keep, current=version, protect=set(protect))
    return wv


async def publish_gpu_version(js, run: str, version: int, step: int, source: CudaIpcBuffer | NcclSource) -> WeightVersion:
    """Announce `version` as the learner's packed GPU buffer (transport "cuda_ipc" for a
    CudaIpcBuffer, "nccl" for an NcclSource): nothing is uploaded; the announcement carries what
    the engine needs to get the buffer and the per-tensor checksums, and its sha256 is the digest
    of that table. The caller keeps the buffer unchanged for source.hold_s after it is superseded
    (learner.weights_io.IpcPublisher)."""
    wv = gpu_announcement(run, version, step, source)
    await _announce(js, run, wv)
    return wv


def gpu_announcement(run: str, version: int, step: int, source: CudaIpcBuffer | NcclSource) -> WeightVersion:
    """The WeightVersion that announces a packed GPU buffer (its sha256: the tensor table's digest)."""
    from protocol.cuda_ipc import table_digest

    if not source.tensors or any(len(t.checksum) == 0 for t in source.tensors):
        raise ValueError(f"version {version}: the shared buffer has no tensor table with checksums; pack it first")
    common = dict(version=version, step=step, sha256=table_digest(source.tensors), bytes=source.nbytes,
                  created=time.time(), run=run)
    if isinstance(source, NcclSource):
        return WeightVersion(transport="nccl", location=f"nccl://{source.address}", nccl=source, **common)
    return WeightVersion(transport="cuda_ipc", location=f"cuda:{source.device_uuid}", ipc=source, **common)


def _place_dir(src: Path, target: Path) -> None:
    """Copy (hard-link when on the same file system) src's files to target, atomically by rename."""
    if src.resolve() == target.resolve():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for p in src.iterdir():
        if p.is_file():
            try:
                os.link(p, tmp / p.name)  # the learner never rewrites a published file, so sharing the inode is safe
            except OSError:
                shutil.copyfile(p, tmp / p.name)
    tmp.rename(target)  # a fresh name (fresh_prefix): nothing there to replace


async def _announce(js, run: str, wv: WeightVersion) -> None:
    kv = await js.key_value(topology.kv_bucket(run))
    data = codec.encode(wv)
    try:
        entry = await kv.get(topology.WEIGHTS_KEY)
    except KeyNotFoundError:
        entry = None
    try:
        if entry is None or not entry.value:
            await kv.create(topology.WEIGHTS_KEY, data)
        else:
            try:
                previous = codec.decode("weights", entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # Someone else wrote junk there; what we publish replaces it (actors skip junk meanwhile).
                log.warning("weights key of run %r held no WeightVersion (%s); replacing it", run, e)
            else:
                if previous.version > wv.version:
                    log.warning("weights key moves back from version %d to %d (resumed learner)", previous.version,
                                wv.version)
            await kv.update(topology.WEIGHTS_KEY, data, last=entry.revision)
    except KeyWrongLastSequenceError as e:
        raise VersionConflict(
            f"the weights key of run {run!r} changed while publishing version {wv.version}; "
            "is a second learner running on this run?"
        ) from e


async def _prune(js, run: str, transport: str, shared_dir, keep: int, current: int, protect: set[int]) -> None:
    # By version number: every publication of a kept or protected number stays (an actor that serves
    # version v may hold the earlier publication of v).
    if transport == "objstore":
        store = await js.object_store(topology.object_bucket(run))
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return
        names = [i.name for i in infos if not i.deleted]
        old = _old_versions([_VERSION_DIR.match(n) for n in names], keep, current, protect)
        for name in names:
            m = _VERSION_DIR.match(name)
            if m and int(m.group(1)) in old:
                await store.delete(name)
    else:
        root = shared_root(shared_dir, run)
        dirs = [d for d in root.iterdir() if d.is_dir()]
        old = _old_versions([_VERSION_DIR.match(d.name) for d in dirs], keep, current, protect)
        for d in dirs:
            m = _VERSION_DIR.match(d.name)
            if m and int(m.group(1)) in old:
                shutil.rmtree(d, ignore_errors=True)


def _old_versions(matches, keep: int, current: int, protect: set[int]) -> set[int]:
    versions = sorted({int(m.group(1)) for m in matches if m}, reverse=True)
    kept = set(versions[:keep]) | {current} | protect
    return set(versions) - kept


class ServedVersions:
    """The weight versions the run's actors report serving (Heartbeat.version), for publish_version's
    `protect`: an actor reloads from, and falls back to, the version it serves, so it must not be pruned.
    A report counts until `ttl_s` passes without another (actors beat every few seconds) or the
    actor says it is stopping."""

    def __init__(self, nc, run: str, ttl_s: float = 120.0):
        self.nc, self.run, self.ttl_s = nc, run, ttl_s
        self._seen: dict[str, tuple[int, float]] = {}  # actor id -> (version, monotonic time)
        self._sub = None

    async def start(self) -> None:
        async def on_beat(msg) -> None:
            try:
                hb = codec.decode("status", msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return
            if hb.state == "stopping":
                self._seen.pop(hb.id, None)
            elif hb.version >= 0:
                self._seen[hb.id] = (hb.version, time.monotonic())

        self._sub = await self.nc.subscribe(topology.status_subject(self.run, "actor", "*"), cb=on_beat)

    def versions(self) -> set[int]:
        now = time.monotonic()
        return {v for v, t in self._seen.values() if now - t <= self.ttl_s}

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


async def fetch_version(js, run: str, wv: WeightVersion, dest_dir: Path, rehash: bool = False, *,
                        shared_dir: str | Path | None = None) -> Path:
    """Fetch and verify version `wv`; returns a directory holding model.safetensors and config.json.

    objstore: the files are written into `dest_dir` (created) and `dest_dir` is returned; the
    received bytes are hashed as they are written and checked against the announcement, so the
    file on disk is the learner's (rehash=True reads it back once more). shared_dir: nothing is
    copied; the version directory, which must resolve under `shared_dir`/<run> (the configured
    [learner] shared_dir), is hashed in place and returned. Raises WeightVerifyError(reason) on any
    mismatch, missing blob, or a location or file name that points anywhere else.
    """
    if wv.transport in GPU_TRANSPORTS:
        raise WeightVerifyError(f"version {wv.version}: transport {wv.transport!r} is loaded by the engine, not fetched")
    if wv.transport == "shared_dir":
        src = resolve_location(wv, shared_dir, run)
        for name in [MODEL_FILE, *(_plain_name(wv, f) for f in wv.files)]:
            if not (src / name).is_file():
                raise WeightVerifyError(f"version {wv.version}: {src / name} is missing (pruned or not shared?)")
        await asyncio.to_thread(_verify_file, src / MODEL_FILE, wv)
        return src
    if wv.transport != "objstore":
        raise WeightVerifyError(f"version {wv.version}: unknown transport {wv.transport!r}; known: {TRANSPORTS}")

    version_dir = wv.location.rsplit("/", 1)[0]
    extras = []
    for obj in wv.files:  # objects of the same publication, each landing under a plain name beside the model
        folder, _, name = obj.rpartition("/")
        if folder != version_dir:
            raise WeightVerifyError(f"version {wv.version}: extra object {obj!r} is not beside {wv.location!r}; refused")
        extras.append((obj, _plain_name(wv, name)))
    dest = Path(dest_dir)
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
            await asyncio.to_thread(_verify_file, part, wv)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, dest / MODEL_FILE)
    for obj, name in extras:
        await _get_object(js, run, obj, dest / name)
    return dest


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
        raise WeightVerifyError(f"object {name}: the bytes read do not match the store's digest/size (changed while reading?)")
    return sha, size


def _store_sha_hex(digest: str | None) -> str:
    # The object store keeps "SHA-256=<urlsafe base64>".
    if not digest or "=" not in digest:
        return ""
    raw = digest.split("=", 1)[1]
    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()


def _verify_file(path: Path, wv: WeightVersion) -> None:
    sha, size = file_digest(path)
    if sha != wv.sha256 or size != wv.bytes:
        raise WeightVerifyError(
            f"version {wv.version}: {path} has sha256 {sha[:16]}.. / {size} bytes, "
            f"announced {wv.sha256[:16]}.. / {wv.bytes} bytes"
        )
