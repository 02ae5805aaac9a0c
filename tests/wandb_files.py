"""Read a W&B offline run back from its files: the run-<id>.wandb record log that `wandb sync`
uploads. Its framing is the LevelDB log format (a 7-byte ":W&B" header, then 32 KiB blocks of
chunks, each with a 7-byte header: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4); each
record is a wandb.proto Record, decoded with wandb's own protobuf classes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def offline_runs(wandb_dir: Path) -> dict[str, dict]:
    """job_type -> {"run": the run record, "history": [row dicts], "files": run dir} of every offline run."""
    out = {}
    for run_file in sorted(Path(wandb_dir).glob("offline-run-*/run-*.wandb")):
        run, history = None, []
        for r in records(run_file):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run = r.run
            elif kind == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        assert run is not None, f"{run_file} holds no run record"
        out[run.job_type] = {"run": run, "history": history, "files": run_file.parent}
    return out
