"""The `shared_dir` weight transport: a version's files hard-linked (or copied) into
<dir>/<run>/<fresh name> on a file system every actor reads, verified in place by the actors.
`dir` is [weights] dir on both sides; an announced location must resolve under it.
Registered in weights.registry.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from parley.protocol import topology
from parley.protocol.messages import WeightVersion
from parley.weights.common import (
    MODEL_FILE,
    VERSION_DIR,
    Transport,
    WeightVerifyError,
    check_extra,
    extra_digests,
    file_digest,
    old_versions,
    plain_name,
    verify_file,
)
from parley.weights.config import SharedDirWeights
from parley.weights.delta import DELTA_FILE


def shared_root(shared_dir: str | Path, run: str) -> Path:
    """The absolute directory that holds run `run`'s shared_dir versions."""
    return Path(shared_dir).expanduser().resolve() / topology.check_run(run)


def resolve_location(wv: WeightVersion, shared_dir: str | Path | None, run: str) -> Path:
    """The directory a shared_dir announcement names, resolved under the configured root; anything
    that resolves elsewhere (an absolute path outside it, `..`, a symlink out) is refused."""
    if not shared_dir:
        raise WeightVerifyError(
            f"version {wv.version} is on the shared_dir transport ({wv.location!r}) but this process has no shared "
            'directory configured; set [weights] kind = "shared_dir" and dir to the directory the '
            "learner publishes into"
        )
    root = shared_root(shared_dir, run)
    where = (root / wv.location).resolve()  # an absolute location replaces root here, and is checked the same
    if where == root or not where.is_relative_to(root):
        raise WeightVerifyError(
            f"version {wv.version}: location {wv.location!r} resolves to {where}, outside the shared directory {root}; "
            "refused (is [weights] dir the same for learner and actors?)"
        )
    return where


def _dir(settings) -> str:
    # Only a shared_dir configuration names a directory that announcements may point into.
    return settings.dir if isinstance(settings, SharedDirWeights) else ""


class SharedDir(Transport):
    kind = "shared_dir"

    async def upload(self, js, run, prefix, state_dir, extras, settings):
        target = shared_root(_dir(settings), run) / prefix
        sha, size = await asyncio.to_thread(file_digest, state_dir / MODEL_FILE)
        await asyncio.to_thread(_place_dir, state_dir, target)
        return str(target), sha, size, extras

    async def upload_delta(self, js, run, prefix, path, settings):
        target = shared_root(_dir(settings), run) / prefix / DELTA_FILE  # upload placed the folder already
        sha, _ = await asyncio.to_thread(file_digest, path)
        await asyncio.to_thread(shutil.copyfile, path, target)
        return str(target), sha

    async def fetch_delta(self, js, run, wv, out, settings):
        """The delta is read in place, like the model: checked here, returned where it lies."""
        src = resolve_location(wv, _dir(settings), run)
        where = Path(wv.delta.location).resolve()
        if where != src / DELTA_FILE:
            raise WeightVerifyError(
                f"version {wv.version}: delta {wv.delta.location!r} is not {src / DELTA_FILE}; refused"
            )
        if not where.is_file():
            raise WeightVerifyError(f"version {wv.version}: {where} is missing (pruned?)")
        sha, size = await asyncio.to_thread(file_digest, where)
        if (sha, size) != (wv.delta.sha256, wv.delta.bytes):
            raise WeightVerifyError(
                f"version {wv.version}: {where} has sha256 {sha[:16]}.. / {size} bytes, "
                f"announced {wv.delta.sha256[:16]}.. / {wv.delta.bytes} bytes"
            )
        return where

    async def fetch_extras(self, js, run, wv, dest, settings):
        src = resolve_location(wv, _dir(settings), run)
        extra_digests(wv)
        for name in (plain_name(wv, f) for f in wv.files):
            await asyncio.to_thread(shutil.copyfile, src / name, dest / name)
            try:
                check_extra(wv, name, (await asyncio.to_thread(file_digest, dest / name))[0], src / name)
            except WeightVerifyError:
                (dest / name).unlink(missing_ok=True)
                raise

    async def prune(self, js, run, settings, keep, current, protect):
        root = shared_root(_dir(settings), run)
        dirs = [d for d in root.iterdir() if d.is_dir()]
        old = old_versions([VERSION_DIR.match(d.name) for d in dirs], keep, current, protect)
        for d in dirs:
            m = VERSION_DIR.match(d.name)
            if m and int(m.group(1)) in old:
                shutil.rmtree(d, ignore_errors=True)

    async def fetch(self, js, run, wv, dest, settings, rehash):
        """Nothing is copied: the version directory, which must resolve under dir/<run>, is hashed in
        place and returned."""
        src = resolve_location(wv, _dir(settings), run)
        for name in [MODEL_FILE, *(plain_name(wv, f) for f in wv.files)]:
            if not (src / name).is_file():
                raise WeightVerifyError(f"version {wv.version}: {src / name} is missing (pruned or not shared?)")
        extra_digests(wv)
        for name in (plain_name(wv, f) for f in wv.files):
            check_extra(wv, name, (await asyncio.to_thread(file_digest, src / name))[0], src / name)
        await asyncio.to_thread(verify_file, src / MODEL_FILE, wv)
        return src


def _place_dir(src: Path, target: Path) -> None:
    """Copy (hard-link when on the same file system) src's files to target, atomically by rename."""
    if src.resolve() == target.resolve():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for p in src.iterdir():
        if p.is_file():
            try:
                os.link(p, tmp / p.name)  # the learner never rewrites a published file, so sharing the inode is safe
            except OSError:
                shutil.copyfile(p, tmp / p.name)
    tmp.rename(target)  # a fresh name (fresh_prefix): nothing there to replace
