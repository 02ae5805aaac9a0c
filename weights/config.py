"""How the learner's weights reach the actors, as configured: `[weights]`, a tagged union on
`kind` with each transport's own fields. config.learner embeds it; the transports (weights.registry)
read it on both sides.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class _Weights(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    pass


class _Files(_Weights):
    # Delta versions (weights.delta): between full-only versions, a version also goes out as the
    # values changed since the one before, which actors serving that one apply instead of fetching
    # the whole file (a full copy is uploaded every time, for the others). full_every = 1: every
    # version full only (no deltas). A delta larger than delta_max_share of the model is not sent.
    full_every: int = 1
    delta_max_share: float = 0.5
    # "file": the delta is built on the learner's host from the written file and applied to the
    # actor's copy of the served file (weights.delta). "packed": built where the learner's weights
    # are (its GPU) against the version before, in the packed layout (weights.gpu_delta; 2 x the
    # model's bytes on rank 0's device), and applied to a packed copy of the served weights the
    # actor's engine keeps (the model's bytes on the actor's device), with no pass over the model on
    # either host. Learner and actors read the same [weights].
    delta_format: str = "file"

    def __post_init__(self) -> None:
        if self.full_every < 1 or not 0.0 < self.delta_max_share <= 1.0:
            raise ValueError(
                f"full_every={self.full_every} must be >= 1 (1: no deltas) and "
                f"delta_max_share={self.delta_max_share} in (0, 1]"
            )
        if self.delta_format not in ("file", "packed"):
            raise ValueError(
                f"delta_format={self.delta_format!r}: 'file' (built from the written file on the "
                "learner's host) or 'packed' (built on the learner's GPU, applied on the actor's)"
            )


class ObjstoreWeights(_Files, tag="objstore"):
    """The run's NATS object store (the default): no shared disk, actors anywhere."""


class SharedDirWeights(_Files, tag="shared_dir"):
    """A directory every actor can read (one node, or a shared file system)."""

    dir: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.dir:
            raise ValueError("kind='shared_dir' needs dir (a directory every actor can read); set [weights] dir")
        # Once, here: a relative path would otherwise mean another directory in every process's cwd.
        # Actors check every announced location against it (weights.shared_dir.resolve_location).
        self.dir = str(Path(self.dir).expanduser().resolve())


class _Packed(_Weights):
    # A filled packed buffer is left unchanged for hold_s (the actors' deadline for loading it; a
    # version is not published rather than written into a buffer still held); max_buffers of the
    # packed model's size are held on rank 0's GPU.
    hold_s: float = 30.0
    max_buffers: int = 2

    def __post_init__(self) -> None:
        if self.hold_s <= 0 or self.max_buffers < 1:
            raise ValueError(f"hold_s={self.hold_s} must be > 0 and max_buffers={self.max_buffers} >= 1")


class CudaIpcWeights(_Packed, tag="cuda_ipc"):
    """Learner and actors on one host with CUDA: actors open rank 0's packed GPU buffer."""


class NcclWeights(_Packed, tag="nccl"):
    """Actors on other GPUs or hosts: each receives rank 0's packed buffer over its own process group."""

    address: str = ""  # host:port of rank 0's store, as the actors reach it

    def __post_init__(self) -> None:
        super().__post_init__()
        from parley.weights.nccl import parse_address

        parse_address(self.address)  # raises naming the value and the fix


WeightsConfig = ObjstoreWeights | SharedDirWeights | CudaIpcWeights | NcclWeights


def from_gpu_buffer(settings) -> bool:
    """Whether versions travel in the learner's packed GPU buffers (cuda_ipc, nccl), not as files. A
    version served from one cannot be fetched again once the learner has packed a newer one into that
    buffer: IpcPublisher refills the oldest buffer out of its hold, so with steps longer than hold_s
    the next version goes into the served one's buffer whatever max_buffers is."""
    return isinstance(settings, _Packed)


KINDS = tuple(t.__struct_config__.tag for t in (ObjstoreWeights, SharedDirWeights, CudaIpcWeights, NcclWeights))


def check_kind(data: dict) -> None:
    """Refuse an unknown [weights] kind of a whole config file's tables, naming the known ones."""
    table = data.get("weights")
    if isinstance(table, dict) and "kind" in table and table["kind"] not in KINDS:
        raise ValueError(f"[weights] kind={table['kind']!r} not allowed; use one of {KINDS}")
