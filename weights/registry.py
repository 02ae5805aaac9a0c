"""The one registry of weight transports, by kind, and the calls every caller makes through it:
the learner publishes (`publish_version` for files, `publish_gpu_version` for a packed buffer),
the actor fetches (`fetch_version`) or its engine receives (`get(kind).receive`). Callers ask a
transport what it needs (`gpu`, `needs_cuda`) instead of comparing kinds.
Used by learner.service, learner.trainer, actors.follow, engines.engine and bench/.
"""

from __future__ import annotations

import time
from pathlib import Path

from protocol.messages import CudaIpcBuffer, NcclSource, WeightVersion
from weights.common import (
    CONFIG_FILE,
    MODEL_FILE,
    Transport,
    WeightVerifyError,
    announce,
    fresh_prefix,
)
from weights.config import WeightsConfig
from weights.cuda_ipc import CudaIpc
from weights.nccl import Nccl
from weights.objstore import Objstore
from weights.shared_dir import SharedDir

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
) -> WeightVersion:
    """Upload `state_dir` (model.safetensors + config.json and any other small files) as `version`
    by the transport `settings` selects, then point the weights key at it (compare-and-set) and
    delete versions beyond the newest `keep`, except those in `protect` (what actors report
    serving: ServedVersions).

    Every publication goes to a fresh name (fresh_prefix): re-publishing a version number (a resumed
    learner) leaves the earlier blobs alone until pruned; the key always moves to what is published
    last, even if its number is lower (a rollback is logged).
    """
    transport = of(settings)
    if transport.gpu:
        raise ValueError(f"transport={transport.kind!r} publishes GPU buffers, not files; use publish_gpu_version")
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the current version is always kept)")
    state_dir = Path(state_dir)
    model = state_dir / MODEL_FILE
    if not model.is_file():
        raise FileNotFoundError(f"{model} does not exist; write the weights before publishing them")
    extras = sorted(p.name for p in state_dir.iterdir() if p.is_file() and p.name != MODEL_FILE)
    if CONFIG_FILE not in extras:
        raise FileNotFoundError(f"{state_dir / CONFIG_FILE} does not exist; vLLM needs it beside the weights")
    location, sha, size, files = await transport.upload(js, run, fresh_prefix(version), state_dir, extras, settings)
    wv = WeightVersion(
        version=version, step=step, transport=transport.kind, location=location, sha256=sha, bytes=size,
        created=time.time(), run=run, files=files,
    )
    await announce(js, run, wv)
    # By version number: every publication of a kept or protected number stays (an actor that serves
    # version v may hold the earlier publication of v).
    await transport.prune(js, run, settings, keep, current=version, protect=set(protect))
    return wv


async def publish_gpu_version(js, run: str, version: int, step: int, source: CudaIpcBuffer | NcclSource) -> WeightVersion:
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
    from weights.cuda_ipc import table_digest

    if not source.tensors or any(len(t.checksum) == 0 for t in source.tensors):
        raise ValueError(f"version {version}: the shared buffer has no tensor table with checksums; pack it first")
    transport = next(t for t in TRANSPORTS.values() if t.gpu and t.source_type is type(source))
    return transport.announcement(source, version=version, step=step, sha256=table_digest(source.tensors),
                                  bytes=source.nbytes, created=time.time(), run=run)


async def fetch_version(js, run: str, wv: WeightVersion, dest_dir: Path, rehash: bool = False, *,
                        settings: WeightsConfig | None = None) -> Path:
    """Fetch and verify version `wv`; returns a directory holding model.safetensors and config.json.

    objstore: the files are written into `dest_dir`; shared_dir: the version directory, which must
    resolve under `settings.dir`/<run> (this process's [weights]), is hashed in place and
    returned. Raises WeightVerifyError(reason) on any mismatch, missing blob, unknown transport, or
    a location or file name that points anywhere else.
    """
    transport = get(wv.transport)
    if transport is None:
        raise WeightVerifyError(f"version {wv.version}: unknown transport {wv.transport!r}; known: {tuple(TRANSPORTS)}")
    return await transport.fetch(js, run, wv, Path(dest_dir), settings, rehash)
