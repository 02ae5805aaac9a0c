"""What every weight transport shares: the files of a version, their names and digests, the
announcement on the run's KV key (compare-and-set) and its reading, the pruning rule, and the
versions actors report serving. Used by the transports (weights.objstore, weights.shared_dir,
weights.cuda_ipc, weights.nccl), weights.registry, and the learner's publication.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
import time
import weakref
from pathlib import Path

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from parley.errors import ConfigError, ProtocolError, StateError, Unavailable
from parley.protocol import codec, topology
from parley.protocol.messages import WeightVersion

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# v<version>-<nonce>: every publication gets a fresh name, so re-publishing a version number (a resumed
# learner) never rewrites what an actor may be loading; the bare v<version> of older runs still matches.
VERSION_DIR = re.compile(r"^v(\d{6,})(?:-[0-9a-f]+)?(?:/|$)")


class WeightVerifyError(ProtocolError):
    """Fetched weights do not match their announcement (sha256 or size) or are missing."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class WeightUnavailable(Unavailable):
    """A GPU-transport version that could not be got this time, for a reason that passes (the buffer
    would not open, the receive broke or timed out, out of memory): nothing of the served weights
    changed, and the actor tries it again with back-off while it is announced. Only a WeightVerifyError
    (a checksum or digest mismatch) refuses a version for good."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class WeightStoreTooSmall(ConfigError, RuntimeError):
    """The run's weight store cannot hold one version of this learner's weights (a start-up error)."""


class VersionConflict(StateError):
    """Another writer changed the weights key between our read and our compare-and-set."""


def version_prefix(version: int) -> str:
    return f"v{version:06d}"


def fresh_prefix(version: int) -> str:
    """The name of one publication of `version`: never used before, never reused."""
    return f"{version_prefix(version)}-{secrets.token_hex(6)}"


def plain_name(wv: WeightVersion, name: str) -> str:
    # An extra file lands beside the verified model under this name: a path, "..", or the model's own
    # name would let an announcement write outside the version or replace the checked blob.
    if not name or "/" in name or "\\" in name or name in (".", "..", MODEL_FILE):
        raise WeightVerifyError(
            f"version {wv.version}: extra file name {name!r} is not allowed (a plain file name "
            f"other than {MODEL_FILE}); refused"
        )
    return name


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(8 * 1024 * 1024):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


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


# The fence of the weights keys: per JetStream context (one learner's connection) and (run, key), the
# revision of the key this writer wrote last. Its next write is a compare-and-set on that revision, so a
# learner that lost the run (paused past the lease's TTL while another learner took the run and
# announced) fails with VersionConflict instead of moving the key back. A compare-and-set on the
# revision just read would not: the stale learner reads the other's write and overwrites it.
_written: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fence(js) -> dict:
    try:
        return _written.setdefault(js, {})
    except TypeError:  # a context that takes no weak reference (a test double): unfenced
        return {}


def forget_writes(js, run: str) -> None:
    """A learner starts on `run` (after taking its lease): its first announcement on each key reads the
    key and writes on that revision (a fresh key, a resumed run's last version, junk); every later one
    on the revision it wrote itself. learner.service calls it before the first publication."""
    fence = _fence(js)
    for key in (topology.WEIGHTS_KEY, topology.WEIGHTS_EARLY_KEY):
        fence.pop((run, key), None)


async def _fenced_write(js, run: str, key: str, wv: WeightVersion) -> None:
    kv = await js.key_value(topology.kv_bucket(run))
    data = codec.encode(wv)
    fence = _fence(js)
    last = fence.get((run, key))
    try:
        if last is not None:  # ours was the last write, or someone else's came since: VersionConflict
            fence[(run, key)] = await kv.update(key, data, last=last)
            return
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            fence[(run, key)] = await kv.create(key, data)
            return
        try:
            previous = codec.decode("weights", entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # Someone else wrote junk there; what we publish replaces it (actors skip junk meanwhile).
            log.warning("weights key %s of run %r held no WeightVersion (%s); replacing it", key, run, e)
        else:
            if previous.version > wv.version:
                log.warning(
                    "weights key %s moves back from version %d to %d (resumed learner)",
                    key,
                    previous.version,
                    wv.version,
                )
        fence[(run, key)] = await kv.update(key, data, last=entry.revision)
    except KeyWrongLastSequenceError as e:
        since = f"this one's last announcement (revision {last})" if last is not None else "this one read it"
        raise VersionConflict(
            f"the weights key {key!r} of run {run!r} was written by another learner since {since}"
            f"{await _holding(kv, key)}; version {wv.version} is not announced and this learner stops without "
            "writing more, leaving the run to that one: let it run, or stop it and start this one again with "
            "--resume"
        ) from e


async def _holding(kv, key: str) -> str:
    """ ", it now announces version N" for a VersionConflict's line; "" where the key cannot be read in a
    few seconds or holds no WeightVersion (the line stands without it)."""
    try:
        entry = await asyncio.wait_for(kv.get(key), 5.0)
        return f", it now announces version {codec.decode('weights', entry.value).version}"
    except Exception:  # noqa: BLE001 - only for the operator's line
        return ""


async def announce(js, run: str, wv: WeightVersion) -> None:
    """Point the run's weights key at `wv` by compare-and-set on the revision this learner wrote last
    (the fence above; VersionConflict if another writer moved it since); a learner's first
    announcement reads the key instead: a key holding junk is replaced, a move to a lower version logged."""
    await _fenced_write(js, run, topology.WEIGHTS_KEY, wv)


async def announce_early(js, run: str, wv: WeightVersion) -> None:
    """Put `wv` (a delta version whose full copy is still being uploaded, full_pending) on the run's
    early key (topology.WEIGHTS_EARLY_KEY), fenced as announce() is: a learner that lost the run does
    not move the early key either. announce() on WEIGHTS_KEY follows with the same version; actors take
    whichever of the two was created last."""
    await _fenced_write(js, run, topology.WEIGHTS_EARLY_KEY, wv)


def old_versions(matches, keep: int, current: int, protect: set[int]) -> set[int]:
    """The version numbers (from VERSION_DIR matches) to prune: all but the newest `keep`, the
    current one and the protected ones."""
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


def checkpoint_elements(model_dir: Path) -> int:
    """The tensor elements of a checkpoint's *.safetensors files, read from their headers (no weights).
    Each header is checked first (weights.safetensors_header): a short or damaged file is a one-line
    ConfigError naming it, not a struct or JSON error from deep inside the learner's start."""
    import json
    import math
    import struct

    from parley.weights.safetensors_header import check_safetensors

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        problem = check_safetensors(path)
        if problem is not None:
            raise ConfigError(
                f"{path}: not a readable safetensors file ({problem}); "
                "re-download or re-copy the model into that directory"
            )
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def extras_sha256(state_dir: Path, extras: list[str]) -> list[str]:
    """The whole-file sha256 of each extra file of a version (WeightVersion.file_sha256), in order."""
    return [file_digest(Path(state_dir) / name)[0] for name in extras]


async def upload_files(transport, js, run: str, prefix: str, state_dir: Path, extras: list[str], settings) -> dict:
    """Store a version's files through `transport` (Transport.upload) and return the announcement's
    fields for them: location, sha256, bytes, files, each extra file's whole-file checksum
    (file_sha256) and the time (created)."""
    location, sha, size, files = await transport.upload(js, run, prefix, state_dir, extras, settings)
    file_sha256 = await asyncio.to_thread(extras_sha256, state_dir, extras)
    return dict(location=location, sha256=sha, bytes=size, files=files, file_sha256=file_sha256, created=time.time())


def extra_digests(wv: WeightVersion) -> dict[str, str]:
    """Plain file name -> announced sha256 of each extra file of `wv`; WeightVerifyError when the
    announcement does not give one for every file (an announcement from before whole-file checksums)."""
    if len(wv.file_sha256) != len(wv.files):
        raise WeightVerifyError(
            f"version {wv.version}: {len(wv.files)} extra files ({', '.join(wv.files)}) but "
            f"{len(wv.file_sha256)} checksums announced; refused (a learner older than whole-file "
            "checksums published it: run the learner of this release)"
        )
    return {f.rpartition("/")[2]: sha for f, sha in zip(wv.files, wv.file_sha256, strict=True)}


def check_extra(wv: WeightVersion, name: str, sha: str, where: Path | str) -> None:
    """The extra file `name` of `wv`, read as `sha` from `where`, is the one announced, or WeightVerifyError."""
    want = extra_digests(wv).get(name)
    if sha != want:
        raise WeightVerifyError(
            f"version {wv.version}: {name} at {where} has sha256 {sha[:16]}.., announced "
            f"{(want or 'none')[:16]}..; refused (changed or corrupted after it was published)"
        )


def verify_file(path: Path, wv: WeightVersion) -> None:
    sha, size = file_digest(path)
    if sha != wv.sha256 or size != wv.bytes:
        raise WeightVerifyError(
            f"version {wv.version}: {path} has sha256 {sha[:16]}.. / {size} bytes, "
            f"announced {wv.sha256[:16]}.. / {wv.bytes} bytes"
        )


class Transport:
    """One way for a version's weights to travel from the learner to the actors; weights.registry
    holds one instance per kind. A file transport (gpu False) moves model.safetensors + config.json:
    the learner uploads and prunes, the actor fetches and verifies a directory its engine reloads
    from. A GPU transport (gpu True) moves rank 0's packed buffer, which the engine's worker
    receives, checks and loads itself; nothing becomes a file."""

    kind: str = ""
    gpu: bool = False  # a packed GPU buffer the engine loads itself, not files
    needs_cuda: bool = False  # the learner must have a CUDA device
    receives_copy: bool = False  # a GPU transport whose actor holds a whole copy of a version while it loads
    # the actors' engines run on the learner's own GPU (cuda_ipc opens rank 0's memory): the learner
    # hands its cached memory back after each step (learner.trainer), so their loads find room
    shares_device: bool = False
    source_type: type | None = None  # GPU transports: the announcement's source struct (protocol.messages)
    # a LoRA adapter version can travel this way ([learner.lora], weights.lora): every file transport,
    # and cuda_ipc (the adapter packed like whole weights, its config in the announcement)
    carries_adapters: bool = True

    # learner side, file transports
    # a delta version is stored and announced (early key) before its full copy is uploaded; such a
    # transport also has full_location(prefix), upload_extras and upload_model (weights.objstore)
    delta_first: bool = False
    # versions are stored in the run's object store on the bus (sized by deploy.memory.blobs_max_bytes;
    # the other kinds leave it empty)
    stores_on_bus: bool = False

    async def upload(
        self, js, run: str, prefix: str, state_dir: Path, extras: list[str], settings
    ) -> tuple[str, str, int, list[str]]:
        """Store `state_dir`'s model and `extras` under the fresh name `prefix`:
        (location, sha256, bytes, files) for the announcement."""
        raise self._other_family("upload files", "publish_gpu_version")

    async def prune(self, js, run: str, settings, keep: int, current: int, protect: set[int]) -> None:
        """Remove stored versions beyond `keep`, never `current` or one in `protect`."""
        raise self._other_family("prune stored files", "nothing: a GPU buffer is reused, not stored")

    async def at_start(self, js, run: str, version_bytes: int) -> None:
        """The learner's start, before its first publication: what an earlier learner of the run left
        half done is cleaned up, and a store that cannot hold one version of `version_bytes` (0:
        unknown) raises WeightStoreTooSmall. Nothing to do for most transports."""

    async def upload_delta(self, js, run: str, prefix: str, path: Path, settings) -> tuple[str, str]:
        """Store the delta file `path` beside the version `prefix` just uploaded: (location, sha256)."""
        raise self._other_family("upload a delta", "publish_gpu_version")

    # learner side, GPU transports
    def sender(self, settings, device):
        """Rank 0's packer: `.pack(named, version)` returns the source to announce; `.close()`."""
        raise self._other_family("pack a GPU buffer", "publish_version")

    def announcement(self, source, **common) -> WeightVersion:
        """The WeightVersion that announces `source` (the sender's pack) with the `common` fields."""
        raise self._other_family("announce a GPU buffer", "publish_version")

    # actor side
    async def fetch(self, js, run: str, wv: WeightVersion, dest: Path, settings, rehash: bool) -> Path:
        raise WeightVerifyError(
            f"version {wv.version}: transport {wv.transport!r} is loaded by the engine, not fetched"
        )

    async def wait_full(self, js, run: str, wv: WeightVersion, settings, timeout_s: float) -> None:
        """Return once the full copy that `wv` (full_pending) names is stored; raise WeightUnavailable
        after `timeout_s`."""
        raise self._other_family("wait for a full copy", "receive")

    async def fetch_delta(self, js, run: str, wv: WeightVersion, out: Path, settings) -> Path:
        """The file of `wv.delta`, checked against its sha256 and size (written to `out`, or where it lies)."""
        raise self._other_family("fetch a delta", "receive")

    async def fetch_extras(self, js, run: str, wv: WeightVersion, dest: Path, settings) -> None:
        """The version's extra files (config.json) into `dest`, beside a model rebuilt from a delta."""
        raise self._other_family("fetch files", "receive")

    def source(self, wv: WeightVersion):
        """The packed buffer's source an announcement carries (None if missing or a file transport)."""
        return None

    def receive(self, wv: WeightVersion, state: dict, own: bool = False):
        """In the engine's worker: ((name, tensor) views of a checked buffer, None) or ([], reason) for a
        version refused for good (a checksum mismatch, no longer held); raises WeightUnavailable for a
        failure that passes (the buffer did not open, the receive broke or timed out). own=True: the
        views are into memory of this worker's own, which it may keep (an adapter staged for later),
        not into the sender's buffer."""
        raise self._other_family("receive a GPU buffer", "fetch_version")

    def loaded(self, wv: WeightVersion, state: dict) -> str | None:
        """In the engine's worker, after the received tensors were loaded: None, or why the loaded
        weights cannot be trusted (the source changed while it was read); the engine then raises and
        the actor restores what it served (weights.follow)."""
        return None

    def _other_family(self, what: str, instead: str) -> TypeError:
        # Each transport implements one side of this class: files (gpu False: upload, prune, fetch) or a
        # packed GPU buffer (gpu True: sender, announcement, source, receive). weights.registry calls
        # only the side `gpu` names, so reaching the other is a caller's bug: say which and what to use.
        family = "a GPU buffer" if self.gpu else "files"
        return TypeError(f"transport {self.kind!r} moves {family} and cannot {what}; use {instead}")
