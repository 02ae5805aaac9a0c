"""The one registry of weight transports, by kind, and the calls every caller makes through it:
the learner publishes (`publish_version` for files, `publish_gpu_version` for a packed buffer),
the actor fetches (`fetch_version`) or its engine receives (`get(kind).receive`). Callers ask a
transport what it needs (`gpu`, `needs_cuda`) instead of comparing kinds.
Used by the payload kinds (weights.payloads), learner.trainer, engines.engine and bench/.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import msgspec

from parley.protocol.bus import COUNTERS
from parley.protocol.messages import CudaIpcBuffer, NcclSource, WeightDelta, WeightVersion
from parley.weights import delta as deltas
from parley.weights.common import (
    CONFIG_FILE,
    MODEL_FILE,
    Transport,
    WeightVerifyError,
    announce,
    announce_early,
    extras_sha256,
    file_digest,
    fresh_prefix,
    upload_files,
)
from parley.weights.config import WeightsConfig
from parley.weights.cuda_ipc import CudaIpc
from parley.weights.nccl import Nccl
from parley.weights.objstore import Objstore
from parley.weights.shared_dir import SharedDir

log = logging.getLogger(__name__)

TRANSPORTS: dict[str, Transport] = {t.kind: t for t in (Objstore(), SharedDir(), CudaIpc(), Nccl())}


def get(kind: str) -> Transport | None:
    """The transport of that kind (an announcement's `transport`), or None when none is registered."""
    return TRANSPORTS.get(kind)


def of(settings: WeightsConfig) -> Transport:
    """The transport a [weights] configuration selects."""
    return TRANSPORTS[type(settings).__struct_config__.tag]


async def publish_version(
    js,
    run: str,
    version: int,
    step: int,
    state_dir: Path,
    settings: WeightsConfig,
    keep: int = 3,
    protect: frozenset[int] | set[int] = frozenset(),
    base: tuple[WeightVersion, Path] | None = None,
    on_announced=None,
    packed: tuple[list, bytes | None, int | None, str | None] | None = None,
    write=None,
) -> WeightVersion:
    """Upload `state_dir` (model.safetensors + config.json and any other small files) as `version`
    by the transport `settings` selects, then point the weights key at it (compare-and-set) and
    delete versions beyond the newest `keep`, except those in `protect` (what actors report
    serving: ServedVersions).

    Every publication goes to a fresh name (fresh_prefix): re-publishing a version number (a resumed
    learner) leaves the earlier blobs alone until pruned; the key always moves to what is published
    last, even if its number is lower (a rollback is logged).

    `base`: the version announced before and its state directory (see wants_delta): the version is
    then also uploaded as a delta against it (weights.delta), unless their layouts differ or the delta
    is larger than `settings.delta_max_share` of the model. The full copy is uploaded either way.
    A transport with `delta_first` (objstore) stores the delta, announces it on the early key
    (WeightVersion.full_pending, topology.WEIGHTS_EARLY_KEY), then uploads the full copy and only
    then announces on WEIGHTS_KEY; otherwise the full copy goes first and one announcement follows.

    `on_announced(wv)`: called once, as soon as actors can follow the version (the early
    announcement when there is one): the caller's version moves there, not after the full upload.

    `packed` ([weights] delta_format = "packed"; `base` is not used then): (the version's packed table
    with checksums, its packed delta or None, the base's version, the base's table digest) from
    weights.gpu_delta.PackedVersions, built on the learner's GPU. Every announcement of the version
    carries the table (WeightVersion.packed); the delta goes where a file delta would
    (WeightDelta.format "packed"). With `delta_first` (objstore) the delta is uploaded and announced
    early before `write()` (the caller's writing of `state_dir`, None: written already) runs, so no
    pass over the model on the learner's host precedes it: the early announcement names the version
    by its table's digest (sha256, which actors read as the packed version's identity; its `bytes`
    are the packed tensors'), and only actors holding the base follow it; the full copy, its sha256
    and extras come with the WEIGHTS_KEY announcement after it.
    """
    transport = of(settings)
    if transport.gpu:
        raise ValueError(f"transport={transport.kind!r} publishes GPU buffers, not files; use publish_gpu_version")
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the current version is always kept)")
    state_dir = Path(state_dir)
    if packed is not None:
        return await _publish_packed(
            js, run, version, step, state_dir, settings, transport, keep, protect, packed, write, on_announced
        )
    if write is not None:
        await asyncio.to_thread(write)
    model, extras = _files_of(state_dir)
    prefix = fresh_prefix(version)
    common = dict(version=version, step=step, transport=transport.kind, run=run)
    wv = None
    if base and transport.delta_first:
        # Delta first: the actors that hold the base follow in the delta's time, the others wait for
        # the full copy uploaded next; WEIGHTS_KEY names the version once that copy is stored.
        sha, size = await asyncio.to_thread(file_digest, model)
        delta = await _upload_delta(js, run, transport, prefix, model, sha, size, base, settings)
        if delta is not None:
            files = await transport.upload_extras(js, run, prefix, state_dir, extras)
            file_sha256 = await asyncio.to_thread(extras_sha256, state_dir, extras)
            early = WeightVersion(
                location=transport.full_location(prefix),
                sha256=sha,
                bytes=size,
                created=time.time(),
                files=files,
                file_sha256=file_sha256,
                delta=delta,
                full_pending=True,
                **common,
            )
            await announce_early(js, run, early)
            if on_announced is not None:
                on_announced(early)
            location, got_sha, got_size = await transport.upload_model(js, run, prefix, state_dir)
            if (got_sha, got_size, location) != (sha, size, early.location):
                raise RuntimeError(
                    f"version {version}: the full copy uploaded ({location}, {got_sha[:16]}.., "
                    f"{got_size} bytes) is not the one announced early ({early.location}, "
                    f"{sha[:16]}.., {size} bytes): {model} changed while publishing"
                )
            wv = msgspec.structs.replace(early, full_pending=False)
    if wv is None:
        stored = await upload_files(transport, js, run, prefix, state_dir, extras, settings)
        delta = None
        if base and not transport.delta_first:
            delta = await _upload_delta(
                js, run, transport, prefix, model, stored["sha256"], stored["bytes"], base, settings
            )
        wv = WeightVersion(**stored, delta=delta, **common)
        await announce(js, run, wv)
        if on_announced is not None:
            on_announced(wv)
    else:
        await announce(js, run, wv)
    # By version number: every publication of a kept or protected number stays (an actor that serves
    # version v may hold the earlier publication of v).
    await transport.prune(js, run, settings, keep, current=version, protect=set(protect))
    return wv


def wants_delta(settings: WeightsConfig, since_full: int) -> bool:
    """Whether the next file version goes out with a delta, `since_full` versions after the last one
    sent full only: one version in every `settings.full_every` is full only (1: all of them)."""
    return not of(settings).gpu and since_full < getattr(settings, "full_every", 1) - 1


async def _upload_delta(
    js, run, transport, prefix, model: Path, sha: str, size: int, base: tuple[WeightVersion, Path], settings
) -> WeightDelta | None:
    base_wv, base_dir = base
    out = model.parent.parent / f".{prefix}.{deltas.DELTA_FILE}"
    try:
        t0 = time.perf_counter()
        built = await asyncio.to_thread(deltas.build, Path(base_dir) / MODEL_FILE, model, out, base_wv.sha256, sha)
        if built is None:
            log.info("version %s: no delta against version %d (the layouts differ); full only", prefix, base_wv.version)
            return None
        if built > settings.delta_max_share * size:
            log.info(
                "version %s: delta of %.1f MB is over delta_max_share=%.2f of %.1f MB; full only",
                prefix,
                built / 1e6,
                settings.delta_max_share,
                size / 1e6,
            )
            return None
        where, delta_sha = await transport.upload_delta(js, run, prefix, out, settings)
        log.info(
            "version %s: delta against version %d, %.2f MB of %.1f MB (built in %.2fs)",
            prefix,
            base_wv.version,
            built / 1e6,
            size / 1e6,
            time.perf_counter() - t0,
        )
        return WeightDelta(
            base_version=base_wv.version, base_sha256=base_wv.sha256, location=where, sha256=delta_sha, bytes=built
        )
    finally:
        out.unlink(missing_ok=True)


def _files_of(state_dir: Path) -> tuple[Path, list[str]]:
    model = state_dir / MODEL_FILE
    if not model.is_file():
        raise FileNotFoundError(f"{model} does not exist; write the weights before publishing them")
    extras = sorted(p.name for p in state_dir.iterdir() if p.is_file() and p.name != MODEL_FILE)
    if CONFIG_FILE not in extras:
        raise FileNotFoundError(f"{state_dir / CONFIG_FILE} does not exist; vLLM needs it beside the weights")
    return model, extras


async def _publish_packed(
    js, run, version, step, state_dir: Path, settings, transport, keep, protect, packed, write, on_announced
) -> WeightVersion:
    from parley.weights.cuda_ipc import _nbytes, table_digest

    table, blob, base_version, base_digest = packed
    prefix = fresh_prefix(version)
    common = dict(version=version, step=step, transport=transport.kind, run=run, packed=table)
    delta = None
    announced = False

    async def upload_delta() -> WeightDelta:
        out = state_dir.parent / f".{prefix}.{deltas.DELTA_FILE}"  # beside the version's directory
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(out.write_bytes, blob)
            where, delta_sha = await transport.upload_delta(js, run, prefix, out, settings)
        finally:
            out.unlink(missing_ok=True)
        log.info("version %s: packed delta against version %d, %.2f MB", prefix, base_version, len(blob) / 1e6)
        return WeightDelta(
            base_version=base_version,
            base_sha256=base_digest,
            location=where,
            sha256=delta_sha,
            bytes=len(blob),
            format="packed",
        )

    if blob is not None and transport.delta_first:
        delta = await upload_delta()
        early = WeightVersion(
            location=transport.full_location(prefix),
            sha256=table_digest(table),
            bytes=sum(_nbytes(e) for e in table),
            created=time.time(),
            delta=delta,
            full_pending=True,
            **common,
        )
        await announce_early(js, run, early)
        announced = True
        if on_announced is not None:
            on_announced(early)
    if write is not None:
        await asyncio.to_thread(write)
    _, extras = _files_of(state_dir)
    stored = await upload_files(transport, js, run, prefix, state_dir, extras, settings)
    if blob is not None and not transport.delta_first:  # shared_dir: the delta goes into the version's folder
        delta = await upload_delta()
    wv = WeightVersion(**stored, delta=delta, **common)
    await announce(js, run, wv)
    if on_announced is not None and not announced:
        on_announced(wv)
    await transport.prune(js, run, settings, keep, current=version, protect=set(protect))
    return wv


async def publish_gpu_version(
    js, run: str, version: int, step: int, source: CudaIpcBuffer | NcclSource
) -> WeightVersion:
    """Announce `version` as the learner's packed GPU buffer (transport "cuda_ipc" for a
    CudaIpcBuffer, "nccl" for an NcclSource): nothing is uploaded; the announcement carries what
    the engine needs to get the buffer and the per-tensor checksums, and its sha256 is the digest
    of that table. The caller keeps the buffer unchanged for source.hold_s after it filled it
    (weights.cuda_ipc.IpcPublisher)."""
    wv = gpu_announcement(run, version, step, source)
    await announce(js, run, wv)
    return wv


def gpu_announcement(run: str, version: int, step: int, source: CudaIpcBuffer | NcclSource) -> WeightVersion:
    """The WeightVersion that announces a packed GPU buffer (its sha256: the tensor table's digest)."""
    from parley.weights.cuda_ipc import table_digest

    if not source.tensors or any(len(t.checksum) == 0 for t in source.tensors):
        raise ValueError(f"version {version}: the shared buffer has no tensor table with checksums; pack it first")
    transport = next(t for t in TRANSPORTS.values() if t.gpu and t.source_type is type(source))
    return transport.announcement(
        source,
        version=version,
        step=step,
        sha256=table_digest(source.tensors),
        bytes=source.nbytes,
        created=time.time(),
        run=run,
    )


async def fetch_version(
    js,
    run: str,
    wv: WeightVersion,
    dest_dir: Path,
    rehash: bool = False,
    *,
    settings: WeightsConfig | None = None,
    base: tuple[str, Path] | None = None,
) -> Path:
    """Fetch and verify version `wv`; returns a directory holding model.safetensors and config.json.

    objstore: the files are written into `dest_dir`; shared_dir: the version directory, which must
    resolve under `settings.dir`/<run> (this process's [weights]), is hashed in place and
    returned. Raises WeightVerifyError(reason) on any mismatch, missing blob, unknown transport, or
    a location or file name that points anywhere else.

    `base`: (sha256, directory) of the version served now. When `wv` carries a delta against exactly
    that file, the delta is fetched and applied to a copy of it in `dest_dir` instead, and the result
    is kept only if its sha256 is the full version's; a delta that fails (missing, corrupt, a wrong
    digest) is refused, the base left untouched, and the full version fetched as without a base.
    An early announcement (full_pending) fetched full waits for the full copy first, at most
    full_wait_s, then raises WeightUnavailable (not refused: the actor tries again).
    """
    transport = get(wv.transport)
    if transport is None:
        raise WeightVerifyError(f"version {wv.version}: unknown transport {wv.transport!r}; known: {tuple(TRANSPORTS)}")
    dest_dir = Path(dest_dir)
    if wv.delta is not None and wv.delta.format == "file" and not transport.gpu:  # "packed": weights.follow
        if base is not None and base[0] == wv.delta.base_sha256 and (Path(base[1]) / MODEL_FILE).is_file():
            try:
                return await _apply_delta(js, run, transport, wv, Path(base[1]), dest_dir, settings)
            except WeightVerifyError as e:
                COUNTERS["weights.delta_refused"] += 1
                log.warning("weights version %d: delta refused (%s); fetching the full version", wv.version, e)
                shutil.rmtree(dest_dir, ignore_errors=True)
        else:
            COUNTERS["weights.delta_no_base"] += 1
            log.info(
                "weights version %d: the delta needs version %d, not served here; fetching the full version",
                wv.version,
                wv.delta.base_version,
            )
    if wv.full_pending:  # announced early: its full copy may still be on its way
        await transport.wait_full(js, run, wv, settings, full_wait_s(wv.bytes))
    return await transport.fetch(js, run, wv, dest_dir, settings, rehash)


def full_wait_s(nbytes: int) -> float:
    """How long an actor waits for the full copy of an early-announced version: the upload at 20 MB/s
    (objstore measures 150-250 MB/s here, so a slow store or a busy learner), at least a minute.
    Past it, WeightUnavailable: the version is tried again, not refused."""
    return max(60.0, nbytes / 20e6)


async def _apply_delta(js, run, transport, wv: WeightVersion, base_dir: Path, dest: Path, settings) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    got = await transport.fetch_delta(js, run, wv, dest / deltas.DELTA_FILE, settings)
    try:
        await asyncio.to_thread(
            deltas.apply, base_dir / MODEL_FILE, got, dest / MODEL_FILE, wv.delta.base_sha256, wv.sha256, wv.bytes
        )
    finally:
        (dest / deltas.DELTA_FILE).unlink(missing_ok=True)
    await transport.fetch_extras(js, run, wv, dest, settings)
    COUNTERS["weights.delta_applied"] += 1
    return dest
