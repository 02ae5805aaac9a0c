"""How the learner's weights reach the actors, as configured: `[learner.weights]`, a tagged union on
`kind` with each transport's own fields. config.learner embeds it; the transports (weights.registry)
read it on both sides. `upgrade_learner` turns the old flat keys of `[learner]` into this table.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class _Weights(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    pass


class ObjstoreWeights(_Weights, tag="objstore"):
    """The run's NATS object store (the default): no shared disk, actors anywhere."""


class SharedDirWeights(_Weights, tag="shared_dir"):
    """A directory every actor can read (one node, or a shared file system)."""

    dir: str = ""

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("kind='shared_dir' needs dir (a directory every actor can read); "
                             "set [learner.weights] dir")
        # Once, here: a relative path would otherwise mean another directory in every process's cwd.
        # Actors check every announced location against it (weights.shared_dir.resolve_location).
        self.dir = str(Path(self.dir).expanduser().resolve())


class _Packed(_Weights):
    # A superseded packed buffer is kept unchanged at least hold_s (the actors' deadline for copying
    # it); max_buffers of the packed model's size are held on rank 0's GPU.
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
        from weights.nccl import parse_address

        parse_address(self.address)  # raises naming the value and the fix


WeightsConfig = ObjstoreWeights | SharedDirWeights | CudaIpcWeights | NcclWeights
KINDS = tuple(t.__struct_config__.tag for t in (ObjstoreWeights, SharedDirWeights, CudaIpcWeights, NcclWeights))

# The flat [learner] keys of older config files and the [learner.weights] field each became.
LEGACY_KEYS = {"shared_dir": "dir", "ipc_hold_s": "hold_s", "ipc_buffers": "max_buffers", "nccl_address": "address"}
_FIELDS = {t.__struct_config__.tag: set(t.__struct_fields__)
           for t in (ObjstoreWeights, SharedDirWeights, CudaIpcWeights, NcclWeights)}


def upgrade_learner(section: dict) -> dict:
    """The [learner] table of a config file with its old flat weight keys (`transport`, `shared_dir`,
    `ipc_hold_s`, `ipc_buffers`, `nccl_address`) moved into [learner.weights] under their new names.
    An old key the chosen kind has no field for had no effect and is dropped. Given both forms, it
    refuses naming the new key. An unknown kind is refused with the known ones."""
    table = section.get("weights")
    if isinstance(table, dict) and "kind" in table and table["kind"] not in KINDS:
        raise ValueError(f"[learner.weights] kind={table['kind']!r} not allowed; use one of {KINDS}")
    old = [k for k in ("transport", *LEGACY_KEYS) if k in section]
    if not old:
        return section
    if "weights" in section:
        raise ValueError(f"[learner] sets both {', '.join(old)} (the old form) and [learner.weights]; "
                         f"move them into [learner.weights] (transport -> kind, "
                         + ", ".join(f"{k} -> {v}" for k, v in LEGACY_KEYS.items()) + ")")
    out = {k: v for k, v in section.items() if k not in old}
    kind = section.get("transport", "objstore")
    if kind not in KINDS:
        raise ValueError(f"transport={kind!r} not allowed; use one of {KINDS} (now [learner.weights] kind)")
    table = {"kind": kind}
    for k, new in LEGACY_KEYS.items():
        if k in section and new in _FIELDS[kind]:
            table[new] = section[k]
    out["weights"] = table
    return out
