"""The safetensors header check, below both its users: export (learner.checkpoint) and the learner's
start (weights.common.checkpoint_elements), which sizes a version from the headers. Reads headers
only; imports nothing heavy."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

# Bytes per element of the safetensors dtypes torch writes; a dtype not named here has its offsets
# checked but not its size.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER = 100_000_000  # the safetensors format's own bound on the JSON header


def check_safetensors(path: str | Path) -> str | None:
    """What is wrong with the safetensors file at `path`, in a few words, or None when its header
    describes it: an 8-byte header length within the file, a JSON object for the header, and tensors
    whose [begin, end) byte ranges hold dtype x shape bytes and tile the data after the header exactly,
    as the safetensors loaders (vLLM's, transformers') require. Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            return f"header length {n} beyond the file's {size} bytes"
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return f"header is not JSON: {type(e).__name__} at byte {getattr(e, 'pos', getattr(e, 'start', '?'))}"
    if not isinstance(header, dict):
        return f"header is a JSON {type(header).__name__}, not an object"
    data, ranges = size - 8 - n, []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = t["data_offsets"]
            shape, dtype = [int(d) for d in t["shape"]], t["dtype"]
        except (TypeError, KeyError, ValueError):
            return f"tensor {name!r} has no dtype, shape and [begin, end] data_offsets"
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            return f"tensor {name!r} has data_offsets {t['data_offsets']}"
        if end > data:
            return f"tensor {name!r} ends at byte {end} of the data, past its end at {data} (cut short?)"
        elements = 1
        for d in shape:
            elements *= d
        if dtype in _DTYPE_BYTES and (end - begin) != elements * _DTYPE_BYTES[dtype]:
            return f"tensor {name!r} ({dtype} {shape}) spans {end - begin} bytes, not {elements * _DTYPE_BYTES[dtype]}"
        ranges.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(ranges):
        if begin != at:
            return f"tensor {name!r} starts at byte {begin} of the data, not at {at} where the one before ends"
        at = end
    if at != data:
        return f"the tensors end at byte {at} of the data, the file holds {data}"
    return None
