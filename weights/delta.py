"""Delta versions for the file transports: a version's model.safetensors as the values that changed
since a base version, per tensor, and the file rebuilt from the base plus the delta. The learner
builds one (weights.registry.publish_version), the actor applies it (weights.registry.fetch_version)
and serves the result only if its sha256 is the full version's.

Format (measured on SmolLM2-135M, bench/weight_delta.py, docs/benchmarks.md): per tensor, the
positions of the changed elements as gaps (uint32) and their new raw values, each zlib level 1. At
lr 1e-6 (0.4-0.5% of bf16 values change) that is 1.2-1.7 MB for a 269 MB model, at 1e-5 6.4-10.7 MB;
the XOR of the raw bytes compressed the same way is 3.0-3.6 and 9.3-13.3 MB and slower to build,
since zlib then reads every unchanged byte too.

    b"PARLEYD1" | u64 header length | header (JSON, DeltaHeader) | per tensor: zlib(gaps), zlib(values)

Elements are compared as unsigned integers of the tensor's item size, so any dtype works and the
result is bit for bit. The safetensors header of base and target must be the same bytes (same names,
shapes, dtypes, offsets): otherwise there is no delta and the version goes out full.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import msgspec
import numpy as np

from parley.weights.common import WeightVerifyError, file_digest

MAGIC = b"PARLEYD1"
DELTA_FILE = "model.delta"  # beside model.safetensors in the version's folder (object prefix or directory)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}


class DeltaTensor(msgspec.Struct, array_like=True):
    start: int  # byte offset of the tensor in the file
    itemsize: int
    count: int  # elements in the tensor
    changed: int  # elements changed
    gaps_z: int  # bytes of zlib(gaps) that follow
    values_z: int  # bytes of zlib(values) that follow


class DeltaHeader(msgspec.Struct, kw_only=True):
    base_sha256: str  # the base file this delta applies to
    sha256: str  # the file it rebuilds
    bytes: int
    prefix: int  # bytes of the safetensors header (8 + JSON), the same in base and target
    tensors: list[DeltaTensor]


def _layout(path: Path) -> tuple[int, bytes, list[tuple[int, int, int]]]:
    """(prefix bytes, the prefix itself, [(start, itemsize, count)] by offset) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    prefix = 8 + n
    out = []
    for name, info in json.loads(raw).items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        size = _ITEMSIZE.get(info["dtype"], 1)
        if (end - begin) % size:
            size = 1
        out.append((prefix + begin, size, (end - begin) // size))
    return prefix, struct.pack("<Q", n) + raw, sorted(out)


def build(base: Path, target: Path, out: Path, base_sha256: str, sha256: str) -> int | None:
    """Write the delta that turns `base` into `target` (both model.safetensors) to `out`; its size in
    bytes, or None (nothing written) when the two files' layouts differ."""
    prefix, head, tensors = _layout(target)
    bprefix, bhead, _ = _layout(base)
    if head != bhead or os.path.getsize(base) != os.path.getsize(target):
        return None
    if any(count >= 2**32 for _, _, count in tensors):
        return None  # gaps are uint32
    a = np.memmap(base, dtype=np.uint8, mode="r")
    b = np.memmap(target, dtype=np.uint8, mode="r")
    entries, blobs = [], []
    for start, size, count in tensors:
        x = a[start : start + size * count].view(_UINT[size])
        y = b[start : start + size * count].view(_UINT[size])
        idx = np.flatnonzero(x != y)
        gaps = np.diff(idx, prepend=0).astype(np.uint32)  # the first is the index itself
        gz, vz = zlib.compress(gaps.tobytes(), 1), zlib.compress(y[idx].tobytes(), 1)
        entries.append(DeltaTensor(start, size, count, len(idx), len(gz), len(vz)))
        blobs += [gz, vz]
    header = msgspec.json.encode(
        DeltaHeader(
            base_sha256=base_sha256, sha256=sha256, bytes=os.path.getsize(target), prefix=prefix, tensors=entries
        )
    )
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, out)
    return out.stat().st_size


def apply(base: Path, delta: Path, out: Path, base_sha256: str, sha256: str, size: int) -> None:
    """Rebuild the version of digest `sha256` / `size` bytes at `out` from `base` (left untouched: it
    is copied first) and `delta`. Raises WeightVerifyError, leaving nothing at `out`, when the delta is
    not for this base or this version, is malformed, or the result's sha256 is not `sha256`."""
    part = out.with_name(out.name + ".part")
    try:
        with open(delta, "rb") as f:
            if f.read(8) != MAGIC:
                raise WeightVerifyError(f"{delta} is not a parley delta (bad magic)")
            (n,) = struct.unpack("<Q", f.read(8))
            header = msgspec.json.decode(f.read(n), type=DeltaHeader)
            if (header.base_sha256, header.sha256, header.bytes) != (base_sha256, sha256, size):
                raise WeightVerifyError(
                    f"{delta} turns {header.base_sha256[:16]}.. into {header.sha256[:16]}.. "
                    f"({header.bytes} bytes), announced {base_sha256[:16]}.. -> {sha256[:16]}.. "
                    f"({size} bytes)"
                )
            if os.path.getsize(base) != size:
                raise WeightVerifyError(f"base {base} has {os.path.getsize(base)} bytes, the delta needs {size}")
            shutil.copyfile(base, part)
            mm = np.memmap(part, dtype=np.uint8, mode="r+")
            for t in header.tensors:
                if t.itemsize not in _UINT or t.start < header.prefix or t.start + t.itemsize * t.count > size:
                    raise WeightVerifyError(f"{delta}: tensor at byte {t.start} lies outside the file")
                idx = np.cumsum(np.frombuffer(zlib.decompress(f.read(t.gaps_z)), dtype=np.uint32), dtype=np.int64)
                values = np.frombuffer(zlib.decompress(f.read(t.values_z)), dtype=_UINT[t.itemsize])
                if len(idx) != t.changed or len(values) != t.changed or (len(idx) and idx[-1] >= t.count):
                    raise WeightVerifyError(
                        f"{delta}: tensor at byte {t.start}: {len(idx)} positions, "
                        f"{len(values)} values, {t.changed} announced, {t.count} elements"
                    )
                mm[t.start : t.start + t.itemsize * t.count].view(_UINT[t.itemsize])[idx] = values
            mm.flush()
            del mm
        got, got_size = file_digest(part)
        if (got, got_size) != (sha256, size):
            raise WeightVerifyError(
                f"base + delta gives sha256 {got[:16]}.. / {got_size} bytes, "
                f"the full version is {sha256[:16]}.. / {size} bytes"
            )
    except (zlib.error, msgspec.DecodeError, msgspec.ValidationError, struct.error, ValueError) as e:
        part.unlink(missing_ok=True)
        raise WeightVerifyError(f"{delta} is malformed: {type(e).__name__}: {e}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, out)
