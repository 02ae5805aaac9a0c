"""Files that survive a power cut: written beside, fsynced, renamed, their directory fsynced. Used by
the learner's books (the checkpoint, the ledger's neighbours, the run's start records); plain os calls,
nothing of torch or NATS, so both halves of the learner and the runtime may use them."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(d: Path) -> None:
    """Make the directory's entries durable (a rename, a new file): until then a power cut may
    bring back the old names, whatever was fsynced inside the files."""
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable_text(path: Path, text: str) -> Path:
    """Write a small file so that a power cut leaves the old or the new content, never an empty one
    (beside, fsynced, renamed, the directory fsynced): a file a resume reads must be durable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def fsync_tree(root: Path) -> None:
    """Make every file under `root` (a DeepSpeed checkpoint) and every entry of its directories
    durable, and `root`'s own entry in its parent: the ledger may name it only after this."""
    for d, _, files in os.walk(root):
        for name in files:
            fsync_file(Path(d) / name)
        fsync_dir(Path(d))
    fsync_dir(root.parent)
