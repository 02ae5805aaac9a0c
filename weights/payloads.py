"""The kinds of payload a weight version travels as, one class each with both halves: `publish`
(the learner's rank 0: weights.publish.Weights calls it for every version) and `load` (an actor:
weights.follow.WeightFollower calls it for every announcement it follows). The kind is decided here
and nowhere else: from the run's [weights] and the learner's adapter setting on the publishing side
(`for_config`), from the announcement on the loading side (`for_announcement`).

  Full         whole weights as one file (objstore, shared_dir)
  Delta        Full, and between full-only versions also a delta against the version before
               (weights.delta, built from the written file)
  PackedDelta  Full, the delta built on the learner's GPU in the packed layout (weights.gpu_delta)
  GpuWeights   whole weights in one of the learner's packed GPU buffers (cuda_ipc, nccl)
  Adapter      a LoRA adapter's files, loaded beside the actor's base
  AdapterGpu   a LoRA adapter in the learner's GPU buffer (cuda_ipc)

Which medium carries the bytes is the transport's (weights.registry). A publish half works on the
`Weights` it is given (its source, publisher, feeder, directories); a load half on the follower
(its engine and what it serves), and says True when the engine serves the version now.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from parley.errors import StateError
from parley.protocol import codec
from parley.protocol.bus import COUNTERS, UNREACHABLE, retry_unreachable
from parley.protocol.messages import WeightVersion
from parley.weights import lora, registry
from parley.weights.common import WeightUnavailable, WeightVerifyError

if TYPE_CHECKING:
    from parley.weights.follow import WeightFollower
    from parley.weights.publish import Weights

log = logging.getLogger(__name__)


class WeightsBroken(StateError):
    """A version failed to load and the served weights could not be put back: the actor must stop."""


class Payload(abc.ABC):
    """One kind of payload. `publish`: take `version` now (before the next step changes it) and hand
    its upload and announcement to the publisher; False when it was not published (a GPU buffer
    still held). `load`: load the announced `wv` into the follower's engine."""

    @abc.abstractmethod
    async def publish(self, w: Weights, version: int, write_now: bool) -> bool: ...

    @abc.abstractmethod
    async def load(self, f: WeightFollower, wv: WeightVersion) -> bool: ...

    async def eval_copy(self, w: Weights, version: int) -> Callable[[], object] | None:
        """For a version an eval exports next, where its files can be written behind training: its
        copy taken now (the next step changes the weights), and a call that writes it into the
        weights directory later, in a thread. None: this kind writes them on the step's path
        (`publish`'s write_now), as its upload needs them anyway."""
        return None


def for_config(settings, adapter: bool) -> Payload:
    """The kind the learner publishes every version as: [weights] (`settings`) and whether only a
    LoRA adapter travels ([learner.lora] serve = "adapter"; with serve = "merged" the versions are
    whole weights, the adapter merged in by the trainer's WeightSource). A fresh instance: a publish
    half keeps what the next version needs (the base of its delta)."""
    gpu = registry.of(settings).gpu
    if adapter:
        return AdapterGpu() if gpu else Adapter()
    if gpu:
        return GpuWeights()
    if settings.full_every > 1:  # full_every 1: every version full only, no deltas
        return PackedDelta() if settings.delta_format == "packed" else Delta()
    return Full()


def for_announcement(wv: WeightVersion, settings, engine) -> Payload:
    """The kind an announcement names: its transport (a GPU buffer or files) and whether it is an
    adapter; with [weights] delta_format "packed" (`settings`) and an engine that keeps a packed
    copy, PackedDelta (it falls back to the full file when the packed delta does not apply)."""
    transport = registry.get(wv.transport)
    if transport is not None and transport.gpu:
        return ADAPTER_GPU if wv.adapter is not None else GPU_WEIGHTS
    if wv.adapter is not None:
        return ADAPTER
    if packed_on(settings, engine):
        return PACKED_DELTA
    return DELTA if wv.delta is not None else FULL


def packed_on(settings, engine) -> bool:
    """[weights] delta_format = "packed" here, and an engine that keeps a packed copy."""
    return getattr(settings, "delta_format", "file") == "packed" and hasattr(engine, "load_packed_delta")


# -- files: Full, Delta, PackedDelta, Adapter ---------------------------------------------------


class _Files(Payload):
    """A payload of files: its announcement's sizes are checked, then it is fetched into its own
    directory (by identity, so a re-announced number never overwrites the files being served)."""

    async def load(self, f: WeightFollower, wv: WeightVersion) -> bool:
        problem = announcement_problem(wv)
        if problem:
            return f.refuse(wv, f"announcement refused: {problem}", None)
        return await self.load_into(f, wv, f.dest_root / f"v{wv.version:06d}-{wv.sha256[:12]}")

    @abc.abstractmethod
    async def load_into(self, f: WeightFollower, wv: WeightVersion, dest: Path) -> bool: ...


class Full(_Files):
    def __init__(self) -> None:
        # the version announced last and its directory, the base of the next delta (Delta)
        self.base: tuple = ()
        self.since_full = 0  # versions announced since the last one sent full only

    async def publish(self, w: Weights, version: int, write_now: bool) -> bool:
        """A CPU copy on rank 0 (the source's weights_snapshot; ZeRO-3 gathers first), written to the
        version's directory in the background, or at once with `write_now` (an eval exports it next)."""
        snap = await asyncio.to_thread(w.source.weights_snapshot)
        return await self._submit(w, version, snap, write_now, None)

    async def _submit(self, w: Weights, version: int, snap, write_now: bool, packed) -> bool:
        wdir = w.version_dir(version)
        if write_now:
            await asyncio.to_thread(snap.write, wdir)

        def discard() -> None:  # superseded before its upload began
            shutil.rmtree(wdir, ignore_errors=True)
            if packed is not None:
                packed[1].discard()  # never read: the next pack may overwrite its buffers

        w.submit(version, lambda: self.upload(w, version, snap, wdir, packed), discard=discard)
        return True

    def delta_base(self, w: Weights) -> tuple | None:
        """The version announced before and its directory, when this one also goes as a delta."""
        return None

    async def upload(self, w: Weights, version: int, snap, wdir: Path, packed=None) -> None:
        """In the background: write the file (unless written), upload it (its sha256 is computed once,
        by the transport as it reads the file; objstore with a delta: the delta first, announced early,
        then the full copy), announce it, prune. Admission opens on it at its first announcement.
        `packed` (PackedDelta): its delta is encoded here, beside the next step, then uploaded and
        announced before the file is written from the packed buffer (`snap`, a PackedSnapshot;
        weights.registry.publish_version)."""
        base = None
        pending = None
        if packed is not None:
            table, pending = packed
            try:
                blob, base_version, base_digest = await asyncio.to_thread(pending.encode)
            except BaseException:
                pending.discard()  # cancelled or failed: the buffers are free once no read is under way
                raise
            packed = (table, blob, base_version, base_digest)
        if packed is None:
            await asyncio.to_thread(snap.write, wdir)  # a no-op when written for an eval
            base = self.delta_base(w)
        try:
            wv = await retry_unreachable(
                lambda: registry.publish_version(
                    w.js,
                    w.run_name,
                    version,
                    version,
                    wdir,
                    w.settings,
                    keep=w.keep,
                    protect=w.served.versions(),
                    base=base,
                    # actors can follow from the (early) announcement on
                    on_announced=lambda _: w.feeder.set_version(version),
                    packed=packed,
                    write=None if packed is None else lambda: snap.write(wdir),
                ),
                what=f"publishing weights version {version}",
                give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
            )
        finally:
            if pending is not None:
                pending.discard()  # the file was written from it (or never will be): its buffer is free
        self.base, self.since_full = (wv, wdir), (self.since_full + 1 if wv.delta else 0)
        await asyncio.to_thread(w.prune)
        log.info("published weights version %d (%.1f MB, %s)", version, wv.bytes / 1e6, wv.transport)

    async def load_into(self, f: WeightFollower, wv: WeightVersion, dest: Path) -> bool:
        """Fetch and verify the file (a file delta against the served version is applied instead when
        it has one: weights.registry.fetch_version), then reload the engine from it."""
        try:
            # a delta version is rebuilt from the served files (never written to) when they are its base
            base = (f.serving[1], f.served_dir) if f.served_dir is not None and f.serving[1] else None
            path = await f.fetch(f.js, f.run, wv, dest, settings=f.settings, base=base)
        except WeightVerifyError as e:
            return f.refuse(wv, f"verification failed: {e}", dest)
        except WeightUnavailable as e:  # an early-announced full copy not stored in time: tried again
            log.warning("weights version %d: %s", wv.version, e)
            shutil.rmtree(dest, ignore_errors=True)
            return False
        except Exception as e:  # noqa: BLE001 - a blob we cannot get is refused like a bad one; a newer version may come
            # Store hiccups (timeouts during a reconnect) are worth another try on the next poll.
            if transient(e):
                log.warning("weights version %d: fetch failed (%s); will retry", wv.version, e)
                shutil.rmtree(dest, ignore_errors=True)
                return False
            return f.refuse(wv, f"fetch failed: {type(e).__name__}: {e}", dest)
        old = f.engine.version
        try:
            await f.engine.reload_weights(path, version=wv.version)
        except Exception as e:  # noqa: BLE001 - refused, after putting the served weights back
            await f.restore(wv, e)
            return f.refuse(wv, f"reload failed: {type(e).__name__}: {e}", dest)
        log.info("now serving weights version %d (was %d, step %d)", wv.version, old, wv.step)
        f.served_now(wv)
        f.put_back = f.reload_served_dir
        if (
            packed_on(f.settings, f.engine) and wv.packed
        ):  # the next version's packed delta applies to a copy of this one
            why = await f.engine.keep_packed(codec.encode(wv), path)
            if why:
                log.warning("weights version %d: %s; the next packed delta is not applied here", wv.version, why)
        elif getattr(f.engine, "packed_name", None) is not None:
            await f.engine.drop_packed()  # it holds an older version than the one served now
        # Keep only the served version on disk (a shared_dir version is not ours to delete).
        previous, f.served_dir = f.served_dir, Path(path)
        if previous is not None and previous != f.served_dir and previous.is_relative_to(f.dest_root):
            shutil.rmtree(previous, ignore_errors=True)
        return True


class Delta(Full):
    def delta_base(self, w: Weights) -> tuple | None:
        # one version in full_every goes full only; the base must still be on disk (the learner
        # prunes its weights directories to the newest keep_versions)
        if self.base and registry.wants_delta(w.settings, self.since_full) and self.base[1].is_dir():
            return self.base
        return None


class PackedDelta(Full):
    def __init__(self) -> None:
        super().__init__()
        self.since_packed = 0  # versions packed with a delta since the last one without

    async def publish(self, w: Weights, version: int, write_now: bool) -> bool:
        """Packed on the GPU in place of the host snapshot: the publication takes the delta and the
        full file from the buffers (weights.snapshot.PackedSnapshot). Deltas are counted here, in
        step order (uploads finish later): one version in full_every goes out full only."""
        share = w.settings.delta_max_share if registry.wants_delta(w.settings, self.since_packed) else None
        table, snap = await asyncio.to_thread(w.source.pack_versions, version, share)
        if snap.pending.pack_waited_s > 0.05:  # the version before was still being read from its buffer
            w.publisher.counters["packed_waited"] += 1
            log.info(
                "weights version %d: its pack waited %.2f s for the delta and file copy of the version "
                "packed before (steps faster than the publication's reads)",
                version,
                snap.pending.pack_waited_s,
            )
        self.since_packed = self.since_packed + 1 if snap.pending.base_version is not None else 0
        return await self._submit(w, version, snap, write_now, (table, snap.pending))

    async def load_into(self, f: WeightFollower, wv: WeightVersion, dest: Path) -> bool:
        from_delta = await self._load_delta(f, wv, dest)
        return from_delta if from_delta is not None else await super().load_into(f, wv, dest)

    async def _load_delta(self, f: WeightFollower, wv: WeightVersion, dest: Path) -> bool | None:
        """A version with a packed delta against what the engine's packed copy holds: the delta is
        fetched and the engine applies it to the copy, checks it and loads it (no file of the version
        on this host). None: not this path (no packed delta, another base, or its delta failed
        before), the full version is fetched; False: an early announcement this actor cannot use
        (its full copy comes with the WEIGHTS_KEY announcement), or a fetch that may pass."""
        delta = wv.delta
        if delta is None or delta.format != "packed" or not wv.packed:
            return None
        key = packed_id(wv)
        if getattr(f.engine, "packed_name", None) != delta.base_sha256 or key in f.delta_failed:
            if wv.full_pending:
                log.info(
                    "weights version %d: its packed delta needs a packed copy of version %d, not held here; "
                    "waiting for its full copy",
                    wv.version,
                    delta.base_version,
                )
                return False
            COUNTERS["weights.delta_no_base"] += 1
            return None
        transport = registry.get(wv.transport)
        old = f.engine.version
        path = dest / f".{wv.version}.packed-delta"
        try:
            dest.mkdir(parents=True, exist_ok=True)
            got = await transport.fetch_delta(f.js, f.run, wv, path, f.settings)  # shared_dir: where it lies
            await f.engine.load_packed_delta(codec.encode(wv), got, wv.version)
        except (WeightVerifyError, WeightUnavailable) as e:  # nothing served changed
            COUNTERS["weights.delta_refused"] += 1
            f.delta_failed.add(key)
            log.warning(
                "weights version %d: packed delta not used (%s); %s",
                wv.version,
                e,
                "waiting for its full copy" if wv.full_pending else "fetching the full version",
            )
            shutil.rmtree(dest, ignore_errors=True)
            return False if wv.full_pending else None
        except Exception as e:  # noqa: BLE001 - a fetch that may pass is tried again; a failed load is restored
            shutil.rmtree(dest, ignore_errors=True)
            if f.engine.version == old and transient(e):
                log.warning("weights version %d: packed delta fetch failed (%s); will retry", wv.version, e)
                return False
            try:
                await f.engine.restore_packed(old, revert=True)
            except Exception as e2:
                raise WeightsBroken(
                    f"weights version {wv.version} failed to load from its packed delta ({type(e).__name__}: {e}) "
                    f"and the served weights could not be restored ({e2}); stopping rather than serve a mixed model"
                ) from e2
            return f.refuse(wv, f"reload from its packed delta failed: {type(e).__name__}: {e}", None)
        finally:
            path.unlink(missing_ok=True)
        COUNTERS["weights.delta_applied"] += 1
        log.info(
            "now serving weights version %d (was %d, step %d) from its packed delta (%.2f MB)",
            wv.version,
            old,
            wv.step,
            delta.bytes / 1e6,
        )
        f.served_now(wv)
        # the engine's packed copy still holds it
        f.put_back = lambda: f.engine.restore_packed(f.engine.version)
        return True


class Adapter(_Files):
    async def publish(self, w: Weights, version: int, write_now: bool) -> bool:
        """[learner.lora]: only the adapter travels, written to the version's directory now."""
        snap = await asyncio.to_thread(w.source.adapter_snapshot)
        wdir = w.version_dir(version)
        await asyncio.to_thread(lora.write_adapter, *snap, wdir)
        w.submit(
            version, lambda: self.upload(w, version, wdir), discard=lambda: shutil.rmtree(wdir, ignore_errors=True)
        )
        return True

    async def upload(self, w: Weights, version: int, wdir: Path) -> None:
        """In the background: upload the adapter written to `wdir`, announce it on the base, prune."""
        wv = await retry_unreachable(
            lambda: lora.publish_adapter(
                w.js,
                w.run_name,
                version,
                version,
                wdir,
                w.settings,
                base=w.adapter_base,
                rank=w.adapter_rank,
                keep=w.keep,
                protect=w.served.versions(),
            ),
            what=f"publishing adapter version {version}",
            give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
        )
        await asyncio.to_thread(w.prune)
        w.feeder.set_version(version)
        log.info("published adapter version %d (%.2f MB, %s)", version, wv.bytes / 1e6, wv.transport)

    async def load_into(self, f: WeightFollower, wv: WeightVersion, dest: Path) -> bool:
        """Checked against this engine's base and rank limit, fetched and verified, then loaded beside
        the base under a new adapter id (the base is not reloaded). Adapters of older versions stay
        loaded while conversations use them (the actor drops them)."""
        problem = await asyncio.to_thread(f.adapter_problem, wv)  # the first one hashes the base's files
        if problem:
            return f.refuse(wv, f"adapter refused: {problem}", None)
        try:
            path = await f.fetch(f.js, f.run, wv, dest, settings=f.settings)
            await f.engine.load_adapter(lora.as_vllm_adapter(path), wv.version)
        except WeightVerifyError as e:
            return f.refuse(wv, f"verification failed: {e}", dest)
        except Exception as e:  # noqa: BLE001 - nothing served changed: the base and older adapters still serve
            if transient(e):
                log.warning("adapter version %d: fetch failed (%s); will retry", wv.version, e)
                shutil.rmtree(dest, ignore_errors=True)
                return False
            return f.refuse(wv, f"adapter load failed: {type(e).__name__}: {e}", dest)
        log.info("now serving adapter version %d (step %d)", wv.version, wv.step)
        f.served_now(wv)
        f.adapter_dirs[wv.version] = Path(path)
        return True


# -- GPU buffers: GpuWeights, AdapterGpu --------------------------------------------------------


class _Gpu(Payload):
    """Packed into one of rank 0's GPU buffers; only the announcement is left for the background.
    `submit` packs and hands the announcement to the publisher, False when every buffer is still
    held (then Weights.retry_held calls it again once one may be written)."""

    @abc.abstractmethod
    async def submit(self, w: Weights, version: int, files: asyncio.Future | None = None) -> bool: ...


class GpuWeights(_Gpu):
    async def eval_copy(self, w: Weights, version: int) -> Callable[[], object]:
        """The weights travel in GPU buffers, so a file is written only for the eval (the periodic eval's
        export reads the weights directory, also where no buffer was free for the version): the CPU copy
        now, the file (0.45 s of a SmolLM2 step's end on an H100, 2026-12-07) behind."""
        snap = await asyncio.to_thread(w.source.weights_snapshot)
        return partial(w.write_eval_copy, snap, version)

    async def publish(self, w: Weights, version: int, write_now: bool) -> bool:
        if write_now:  # the eval's copy written now, on the caller's path
            await asyncio.to_thread(await self.eval_copy(w, version))
        w.held = None  # this version's weights replace any skipped one's
        if not await self.submit(w, version):  # every buffer still held: retry_held packs it later
            w.publisher.counters["skipped_held"] += 1
            w.held = version
            return False
        return True

    async def submit(self, w: Weights, version: int, files: asyncio.Future | None = None) -> bool:
        source = await asyncio.to_thread(w.source.pack_weights, version)
        if source is None:
            return False
        w.submit(version, lambda: self.announce(w, version, source))
        return True

    async def announce(self, w: Weights, version: int, source) -> None:
        """Announce where actors get the packed buffer. Actors copy it on their own time; nothing
        here waits for them."""
        wv = await retry_unreachable(
            lambda: registry.publish_gpu_version(w.js, w.run_name, version, version, source),
            what=f"announcing weights version {version}",
            give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
        )
        w.feeder.set_version(version)  # announced: tasks admitted from now on are sampled with it
        log.info("published weights version %d (%.1f MB, %s)", version, wv.bytes / 1e6, wv.transport)

    async def load(self, f: WeightFollower, wv: WeightVersion) -> bool:
        """No blob to fetch: the engine gets the learner's packed GPU buffer, checks its copy and
        loads it. A copy that fails its checksums is refused before any weight changed."""
        source = registry.get(wv.transport).source(wv)
        if source is None:
            return f.refuse(wv, f"verification failed: announced as {wv.transport} without its source", None)
        old = f.engine.version
        try:
            await self.from_buffer(f, wv, wv.version)
        except WeightVerifyError as e:  # a mismatch: refused for good, nothing changed
            return f.refuse(wv, f"verification failed: {e}", None)
        except WeightUnavailable as e:  # it passes, nothing changed: tried again while announced
            return f.gpu_failed(wv, f"unavailable: {e}", passes=True)
        except Exception as e:  # noqa: BLE001 - half-way: loaded again, or the served weights put back
            again = await self.load_once_more(f, wv, e)
            if again is not None:
                await f.restore(wv, e, again=again, hint=HOLD_HINT)
                return f.gpu_failed(wv, f"reload failed: {type(e).__name__}: {e}", passes=passes(e))
        f.failing.pop(wv.version, None)
        log.info("now serving weights version %d (was %d, step %d, %s)", wv.version, old, wv.step, wv.transport)
        f.served_now(wv)
        f.put_back = partial(self.load_again, f, wv)
        return True

    @staticmethod
    async def load_once_more(f: WeightFollower, wv: WeightVersion, error: Exception) -> Exception | None:
        """After a load of `wv` that failed half-way (the engine's weights may be mixed): load `wv` once
        more, from the buffer it was announced in (None: served now), before the served version is put
        back. The learner refills a buffer only after its hold, so `wv`'s is the one most likely still
        to hold it, while the served version's may not: with steps longer than hold_s the learner packs
        each version into the buffer the one before it was served from, whatever max_buffers is
        (IpcPublisher), and putting that one back failed its checksums and stopped the actor. Its
        checksums refuse `wv` too if the buffer changed since; the engine bounds the try by hold_s."""
        log.warning(
            "weights version %d failed half-way (%s: %s); loading it once more before putting version %d back",
            wv.version,
            type(error).__name__,
            error,
            f.engine.version,
        )
        COUNTERS["weights.gpu_load_again"] += 1
        try:
            await GpuWeights.from_buffer(f, wv, wv.version)
        except Exception as e:  # noqa: BLE001 - the caller puts the served version back, or stops
            log.warning("weights version %d failed again (%s: %s)", wv.version, type(e).__name__, e)
            return e
        return None

    @staticmethod
    async def load_again(f: WeightFollower, wv: WeightVersion) -> None:
        """Put back `wv`, served from its buffer: the learner may have overwritten that buffer since,
        then its checksums refuse it."""
        await GpuWeights.from_buffer(f, wv, f.engine.version)

    @staticmethod
    async def from_buffer(f: WeightFollower, wv: WeightVersion, version: int) -> None:
        """Load `wv` from the learner's buffer it was announced in, bounded by that buffer's hold, and
        serve it as `version`."""
        source = registry.get(wv.transport).source(wv)
        await f.engine.load_gpu(codec.encode(wv), hold_s=source.hold_s, version=version)


class AdapterGpu(_Gpu):
    async def publish(self, w: Weights, version: int, write_now: bool) -> bool:
        """The adapter packed now, and its files too (the periodic eval's export, parley export): the
        snapshot is taken after the pack (nothing on the way to serving waits for it) and before the
        next step changes the adapter; the file is written after the announcement, beside the next
        step, unless the eval exports this version next or it was held back (then no announcement
        comes soon)."""
        w.held = None
        files: asyncio.Future = asyncio.get_running_loop().create_future()
        if not await self.submit(w, version, files):
            w.publisher.counters["skipped_held"] += 1
            w.held = version
        write = None
        try:
            snap = await asyncio.to_thread(w.source.adapter_snapshot)
            if write_now or w.held is not None:
                await asyncio.to_thread(w.write_adapter, snap, version)
            else:
                write = partial(w.write_adapter, snap, version)
        finally:  # the announcement job awaits it, also after a failed snapshot (None); done if it was cancelled
            if not files.done():
                files.set_result(write)
        return w.held is None

    async def submit(self, w: Weights, version: int, files: asyncio.Future | None = None) -> bool:
        source, conf = await asyncio.to_thread(w.source.pack_adapter, version)
        if source is None:
            return False
        w.submit(version, lambda: self.announce(w, version, source, conf, files))
        return True

    async def announce(self, w: Weights, version: int, source, adapter_config: dict, files) -> None:
        """Announce the adapter packed in `source` on the base, then write its files (`files`,
        publish's) beside the next step."""
        wv = await retry_unreachable(
            lambda: lora.publish_adapter_gpu(
                w.js,
                w.run_name,
                version,
                version,
                source,
                base=w.adapter_base,
                rank=w.adapter_rank,
                adapter_config=adapter_config,
            ),
            what=f"announcing adapter version {version}",
            give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
        )
        w.feeder.set_version(version)
        log.info("published adapter version %d (%.2f MB, %s)", version, wv.bytes / 1e6, wv.transport)
        write = await files if files is not None else None
        if write is not None:
            await asyncio.to_thread(write)

    async def load(self, f: WeightFollower, wv: WeightVersion) -> bool:
        """Checked against this engine's base and rank limit, then the engine's worker copies its
        tensors out of the buffer once their checksums match and hands them to vLLM beside the base
        (no file, no pause). Nothing served changes when it fails: a mismatch is refused for good, a
        failure that passes is tried again (WeightFollower.gpu_failed)."""
        problem = await asyncio.to_thread(f.adapter_problem, wv)  # the first one hashes the base's files
        if problem:
            return f.refuse(wv, f"adapter refused: {problem}", None)
        source = registry.get(wv.transport).source(wv)
        if source is None or not wv.adapter.config:
            return f.refuse(
                wv,
                f"verification failed: adapter announced as {wv.transport} without its buffer or its peft config",
                None,
            )
        try:
            await f.engine.load_adapter_gpu(codec.encode(wv), wv.version, hold_s=source.hold_s)
        except WeightVerifyError as e:
            return f.refuse(wv, f"verification failed: {e}", None)
        except WeightUnavailable as e:
            return f.gpu_failed(wv, f"unavailable: {e}", passes=True)
        except Exception as e:  # noqa: BLE001 - the base and older adapters still serve
            return f.gpu_failed(wv, f"adapter load failed: {type(e).__name__}: {e}", passes=passes(e))
        f.failing.pop(wv.version, None)
        log.info("now serving adapter version %d (step %d, %s)", wv.version, wv.step, wv.transport)
        f.served_now(wv)
        return True


# what a WeightsBroken after a GPU-buffer load says would have kept the served version at hand
HOLD_HINT = (
    "the learner refills a buffer once [weights] hold_s has passed since its fill, so the served version "
    "survives the next one's load only with max_buffers >= 2 and hold_s above a learner step plus an "
    "actor's load (one more packed model on the learner's GPU; a hold over max_buffers steps skips versions)"
)

# the load halves keep no state of their own: one instance of each serves every follower
FULL, DELTA, PACKED_DELTA, ADAPTER = Full(), Delta(), PackedDelta(), Adapter()
GPU_WEIGHTS, ADAPTER_GPU = GpuWeights(), AdapterGpu()


# -- what the load halves share ------------------------------------------------------------------

# Announcements beyond these are refused unread: 2 TiB holds a 1T-parameter bf16 model.
MAX_WEIGHT_BYTES = 2 * 1024**4
MAX_WEIGHT_FILES = 64
_SHA256 = re.compile(r"[0-9a-f]{64}")


def announcement_problem(wv: WeightVersion) -> str | None:
    """Why an announcement's sizes cannot be honest (None if they can): the learner announces a
    version >= 0, a blob of 1 byte to MAX_WEIGHT_BYTES, and a few small extra files."""
    if not _SHA256.fullmatch(wv.sha256):
        # it also names the local directory (and one that is refused is removed): never a path
        return f"sha256={wv.sha256[:80]!r} is not 64 hex digits"
    if wv.version < 0 or wv.step < 0:
        return f"version={wv.version} / step={wv.step} must be >= 0"
    if not 1 <= wv.bytes <= MAX_WEIGHT_BYTES:
        return f"bytes={wv.bytes} is outside 1..{MAX_WEIGHT_BYTES}"
    if len(wv.files) > MAX_WEIGHT_FILES:
        return f"{len(wv.files)} extra files (at most {MAX_WEIGHT_FILES})"
    if len(wv.file_sha256) > MAX_WEIGHT_FILES:
        return f"{len(wv.file_sha256)} extra file checksums (at most {MAX_WEIGHT_FILES})"
    return None


def packed_id(wv: WeightVersion) -> tuple[int, str] | None:
    """A packed version's identity: (version, its packed table's digest), the same in its early and
    its full announcement; None for a version without a packed table."""
    if not wv.packed:
        return None
    from parley.weights.cuda_ipc import table_digest

    return wv.version, table_digest(wv.packed)


def transient(e: Exception) -> bool:
    return isinstance(e, UNREACHABLE)


def passes(e: Exception) -> bool:
    """A GPU load that failed half-way for a reason that passes: past its hold time (the engine's
    TimeoutError), or out of memory (torch.OutOfMemoryError, also as it comes back from a worker)."""
    return isinstance(e, TimeoutError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
