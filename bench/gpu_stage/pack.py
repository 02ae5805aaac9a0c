"""First fit, largest first, for the staging payload (bench/gpu_stage/build_payload.sh; nothing in parley
imports it). Paths (files or folders) go into bins of at most ROOM bytes and MOST paths each: each into
the first bin it fits, a new bin when none has room.

    python pack.py folders SRC DST ROOM          every file of SRC moved into DST/e1, DST/e2, ...
    python pack.py calls ROOM OUT PATH...        OUT: one JSON carry list a line (".gpu/tools" first);
                                                 the smol SHA256SUMS rides with a smol piece, .whl last
"""

from __future__ import annotations

import json
import os
import shutil
import sys


def size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def first_fit(paths: list[str], room: int, most: int) -> list[list[str]]:
    bins: list[list] = []  # [bytes, [paths]]
    for p in sorted(paths, key=lambda p: (-size(p), p)):
        for b in bins:
            if b[0] + size(p) <= room and len(b[1]) < most:
                b[0] += size(p)
                b[1].append(p)
                break
        else:
            bins.append([size(p), [p]])
    return [paths for _, paths in bins]


def folders(src: str, dst: str, room: int) -> None:
    bins = first_fit([os.path.join(src, f) for f in os.listdir(src)], room, most=10**6)
    for i, paths in enumerate(bins, 1):
        os.makedirs(os.path.join(dst, f"e{i}"))
        for p in paths:
            shutil.move(p, os.path.join(dst, f"e{i}", os.path.basename(p)))


def calls(room: int, out: str, units: list[str]) -> None:
    # carry takes 8 paths a call, one of them .gpu/tools
    bins = first_fit(units, room, most=7)
    sums = ".gpu/smol/SHA256SUMS"
    for b in bins:  # with a smol piece where a path is still free, else a call of its own
        if any(p.startswith(".gpu/smol/") for p in b) and len(b) < 7:
            b.append(sums)
            break
    else:
        bins.append([sums])
    bins.append([".whl"])  # with the work: stage.sh installs once everything is in
    with open(out, "w") as f:
        for b in bins:
            f.write(json.dumps([".gpu/tools", *b]) + "\n")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "folders":
        folders(args[0], args[1], int(args[2]))
    elif cmd == "calls":
        calls(int(args[0]), args[1], args[2:])
    else:
        sys.exit(f"usage: python {sys.argv[0]} folders SRC DST ROOM | calls ROOM OUT PATH...")
