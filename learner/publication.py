"""Weight publication beside the training loop, on rank 0: the learner takes a version's weights
synchronously after its step (a CPU copy, or a packed GPU buffer) and hands the rest (writing the
file, uploading it, hashing, announcing) to `Publisher`, so the next step starts at once.

Back-pressure: at most one publication runs at a time, and at most one waits behind it. A newer
version supersedes the one waiting (never the one running, so some version always gets through
however fast the steps come): the superseded one is never uploaded nor announced, its `discard`
removes what it had written, and it is counted and logged.

`Weights` is the learner's side of it: what each version is taken as, where it is uploaded and
announced. learner.service builds both; learner.stepper calls `Weights.publish` after a step, the
service's loop checks, drains and abandons the `Publisher`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from parley.learner import checkpoint as ckpt
from parley.protocol.bus import retry_unreachable
from parley.weights import lora, registry
from parley.weights.common import ServedVersions

log = logging.getLogger("parley.learner")


@dataclass
class Publication:
    version: int
    job: Callable[[], Awaitable[None]]  # upload and announce; returns once the version is announced
    discard: Callable[[], None] | None = None  # remove what a superseded one left (it never ran)


class Publisher:
    def __init__(self) -> None:
        self.running: Publication | None = None
        self.waiting: Publication | None = None
        self.counters: Counter[str] = Counter()  # published, superseded, skipped_held, packed_waited
        self.superseded: list[int] = []  # versions never announced because a newer one came first
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None

    def submit(self, pub: Publication) -> None:
        """Queue `pub` behind the running publication; it replaces an older one still waiting."""
        self.check()
        old, self.waiting = self.waiting, pub
        if old is not None:
            self.superseded.append(old.version)
            self.counters["superseded"] += 1
            log.info(
                "weights version %d superseded by version %d before its upload began: never announced",
                old.version,
                pub.version,
            )
            if old.discard is not None:
                old.discard()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._work(), name="weight-publication")

    async def _work(self) -> None:
        while self.waiting is not None:
            self.running, self.waiting = self.waiting, None
            t0 = time.perf_counter()
            try:
                await self.running.job()
            except Exception as e:  # noqa: BLE001 - kept, and re-raised in the learner's loop (check) and by drain
                self._error = e
                return
            finally:
                done, self.running = self.running, None
            self.counters["published"] += 1
            log.info("weights version %d published beside training in %.1fs", done.version, time.perf_counter() - t0)

    def check(self) -> None:
        """Re-raise a failed publication (the learner's loop calls this every round)."""
        if self._error is not None:
            raise self._error

    def busy(self) -> bool:
        return self.running is not None or self.waiting is not None

    async def drain(self) -> None:
        """Until nothing runs or waits: the newest submitted version is announced (or its error raised)."""
        while self._task is not None and not self._task.done():
            await asyncio.wait({self._task})
        self.check()

    async def abandon(self) -> None:
        """Stop without announcing what is left: the running upload is cancelled (its objects under a
        fresh, never-announced name are pruned by version later), the waiting one discarded."""
        if self.waiting is not None:
            old, self.waiting = self.waiting, None
            log.warning("weights version %d abandoned at stop: never announced", old.version)
            if old.discard is not None:
                old.discard()
        if self._task is not None and not self._task.done():
            if self.running is not None:
                log.warning(
                    "weights version %d abandoned during its upload at stop: never announced", self.running.version
                )
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Weights:
    """Publishes the trainer's weights by version through `publisher`; `served` tracks the versions
    actors serve, which are never pruned. The feeder's version moves once a version is announced."""

    def __init__(
        self, lc, settings, js, nc, run_name: str, run_dir, driver, publisher: Publisher, feeder, adapter_base: str = ""
    ) -> None:
        """`settings`: the run's [weights] (weights.config), the transport every version takes.
        `adapter_base`: [learner.lora] on, the base's identity (weights.lora.base_identity) each adapter
        version names; "" publishes whole weights."""
        self.lc, self.settings, self.js, self.run_name, self.run_dir, self.driver = (
            lc,
            settings,
            js,
            run_name,
            run_dir,
            driver,
        )
        self.publisher, self.feeder = publisher, feeder
        self.served = ServedVersions(nc, run_name)  # what actors serve is never pruned
        # file transports: the version announced last and its directory, the base of the next delta
        self._base: tuple = ()
        self._since_full = 0  # versions announced since the last one sent full only
        self._since_packed = 0  # delta_format "packed": versions packed with a delta since the last one without
        self.base = adapter_base
        # a GPU transport: the newest version not published because every buffer was still held
        # (weights.cuda_ipc.IpcPublisher), published as soon as a buffer may be written (retry_held)
        self.held: int | None = None

    async def publish(self, version: int, write_now: bool = False) -> bool:
        """Take `version`'s weights now, before the next step can change them, and hand their upload and
        announcement to the publisher (learner.publication): the next step does not wait for them.
        objstore / shared_dir: a CPU copy on rank 0 (Trainer.weights_snapshot; ZeRO-3 gathers first),
        written to weights_dir in the background, or at once with `write_now` (an eval exports it
        next). A GPU transport (cuda_ipc, nccl): packed into one of rank 0's GPU buffers (no file,
        unless `write_now`: then also written, write_for_eval); only the announcement is left for the
        background. False when the GPU transport had no buffer
        it may write (the version is not published)."""
        if self.base and registry.of(self.settings).gpu:  # an adapter in GPU memory (cuda_ipc)
            self.held = None
            files: asyncio.Future = asyncio.get_running_loop().create_future()
            if not await self._submit_gpu(version, files):
                self.publisher.counters["skipped_held"] += 1
                self.held = version
            # its files too (the periodic eval's export, parley export): the snapshot is taken now, after
            # the pack (nothing on the way to serving waits for it) and before the next step changes the
            # adapter; the file is written after the announcement, beside the next step, unless the
            # eval exports this version next or it was held back (then no announcement comes soon)
            write = None
            try:
                snap = await asyncio.to_thread(self.driver, "adapter_snapshot")
                if write_now or self.held is not None:
                    await asyncio.to_thread(self._write_adapter, snap, version)
                else:
                    write = partial(self._write_adapter, snap, version)
            finally:  # the announcement job awaits it, also after a failed snapshot (None); done if it was cancelled
                if not files.done():
                    files.set_result(write)
            return self.held is None
        if self.base:  # [learner.lora]: only the adapter travels
            snap = await asyncio.to_thread(self.driver, "adapter_snapshot")
            wdir = ckpt.weights_dir(self.run_dir, version)
            await asyncio.to_thread(lora.write_adapter, *snap, wdir)
            self.publisher.submit(
                Publication(
                    version,
                    lambda: self.upload_adapter(version, wdir),
                    discard=lambda: shutil.rmtree(wdir, ignore_errors=True),
                )
            )
            return True
        if registry.of(self.settings).gpu:
            if write_now:  # the eval's export reads the weights directory: a GPU buffer is no file
                await self.write_for_eval(version)
            self.held = None  # this version's weights replace any skipped one's
            if not await self._submit_gpu(version):  # every buffer still held: retry_held packs it later
                self.publisher.counters["skipped_held"] += 1
                self.held = version
                return False
            return True
        packed = None
        if self.settings.delta_format == "packed" and self.settings.full_every > 1:  # full_every 1: no deltas
            # packed on the GPU in place of the host snapshot: the publication takes the delta and the
            # full file from the buffers (learner.weights_io.PackedSnapshot). Deltas are counted here, in
            # step order (uploads finish later): one version in full_every goes out full only.
            share = self.settings.delta_max_share if registry.wants_delta(self.settings, self._since_packed) else None
            table, snap = await asyncio.to_thread(self.driver, "pack_versions", version, share)
            packed = (table, snap.pending)
            if snap.pending.pack_waited_s > 0.05:  # the version before was still being read from its buffer
                self.publisher.counters["packed_waited"] += 1
                log.info(
                    "weights version %d: its pack waited %.2f s for the delta and file copy of the version "
                    "packed before (steps faster than the publication's reads)",
                    version,
                    snap.pending.pack_waited_s,
                )
            self._since_packed = self._since_packed + 1 if snap.pending.base_version is not None else 0
        else:
            snap = await asyncio.to_thread(self.driver, "weights_snapshot")
        wdir = ckpt.weights_dir(self.run_dir, version)
        if write_now:
            await asyncio.to_thread(snap.write, wdir)

        def discard() -> None:  # superseded before its upload began
            shutil.rmtree(wdir, ignore_errors=True)
            if packed is not None:
                packed[1].discard()  # never read: the next pack may overwrite its buffers

        self.publisher.submit(Publication(version, lambda: self.upload(version, snap, wdir, packed), discard=discard))
        return True

    async def retry_held(self) -> float | None:
        """Publish the version `publish` skipped because every GPU buffer was still held, once one may
        be written (no step has changed the weights since: a step's own publish clears it). The
        learner's loop calls this every round: without it a learner whose admission waits for that
        version (the actors serve an older one, and max_staleness admits no task at it) would wait
        for data that never comes. Returns the seconds until a buffer may be written while a version
        is still held back (the loop waits no longer than that), else None."""
        if self.held is None:
            return None
        wait = await asyncio.to_thread(self.driver, "weights_writable_in")
        if wait > 0:
            return wait
        version, self.held = self.held, None
        if not await self._submit_gpu(
            version
        ):  # a buffer was taken for a send meanwhile (nccl): tried again next round
            self.held = version
            return 0.0
        self.publisher.counters["published_after_held"] += 1
        log.info(
            "weights version %d published once a buffer was free (skipped at its step, every buffer "
            "held; no step came in between)",
            version,
        )
        return None

    async def _submit_gpu(self, version: int, files: asyncio.Future | None = None) -> bool:
        """A GPU transport: pack `version` (whole weights, or the adapter alone under [learner.lora])
        into one of rank 0's buffers and hand its announcement to the publisher; False when no buffer
        may be written (nothing was packed). `files` (an adapter): resolves to what writes the version's
        files after its announcement, or None when they are written already."""
        if self.base:
            source, conf = await asyncio.to_thread(self.driver, "pack_adapter", version)
            if source is None:
                return False
            self.publisher.submit(Publication(version, lambda: self.announce_adapter_gpu(version, source, conf, files)))
            return True
        source = await asyncio.to_thread(self.driver, "pack_weights", version)
        if source is None:
            return False
        self.publisher.submit(Publication(version, lambda: self.announce_gpu(version, source)))
        return True

    async def flush_held(self, timeout_s: float) -> bool:
        """After the last step (or a stop): retry_held until the held-back version is handed to the
        publisher, for at most `timeout_s` (the hold time: by then every buffer has been free once).
        True when nothing is left held back; False, and logged, when the version is given up."""
        deadline = time.monotonic() + timeout_s
        while self.held is not None:
            wait = await self.retry_held()
            if self.held is None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "weights version %d never published: no GPU buffer came free within %.1f s after training ended",
                    self.held,
                    timeout_s,
                )
                return False
            await asyncio.sleep(min(max(wait or 0.0, 0.01), left, 1.0))
        return True

    async def write_for_eval(self, version: int) -> None:
        """A GPU transport: write `version` to its weights directory as the file transports do, for
        the periodic eval's export (evaluation.periodic, learner.checkpoint.export_version), also when
        no buffer was free for it; the oldest are pruned as the file transports' are."""
        snap = await asyncio.to_thread(self.driver, "weights_snapshot")
        await asyncio.to_thread(snap.write, ckpt.weights_dir(self.run_dir, version))
        await asyncio.to_thread(ckpt.prune_weights, self.run_dir, self.lc.keep_versions)

    async def upload(self, version: int, snap, wdir: Path, packed=None) -> None:
        """In the background: write the file (unless written), upload it (its sha256 is computed once,
        by the transport as it reads the file; objstore with a delta: the delta first, announced early,
        then the full copy), announce it, prune. Admission opens on it at its first announcement.
        `packed` (Trainer.pack_versions, delta_format "packed"): its delta is encoded here, beside the
        next step, then uploaded and announced before the file is written from the packed buffer
        (`snap`, a PackedSnapshot; weights.registry.publish_version)."""
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
            if self._base and registry.wants_delta(self.settings, self._since_full) and self._base[1].is_dir():
                base = self._base  # still on disk (prune_weights keeps the newest keep_versions)
        try:
            wv = await retry_unreachable(
                lambda: registry.publish_version(
                    self.js,
                    self.run_name,
                    version,
                    version,
                    wdir,
                    self.settings,
                    keep=self.lc.keep_versions,
                    protect=self.served.versions(),
                    base=base,
                    # actors can follow from the (early) announcement on
                    on_announced=lambda _: self.feeder.set_version(version),
                    packed=packed,
                    write=None if packed is None else lambda: snap.write(wdir),
                ),
                what=f"publishing weights version {version}",
                give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
            )
        finally:
            if pending is not None:
                pending.discard()  # the file was written from it (or never will be): its buffer is free
        self._base, self._since_full = (wv, wdir), (self._since_full + 1 if wv.delta else 0)
        await asyncio.to_thread(ckpt.prune_weights, self.run_dir, self.lc.keep_versions)
        log.info("published weights version %d (%.1f MB, %s)", version, wv.bytes / 1e6, wv.transport)

    async def upload_adapter(self, version: int, wdir: Path) -> None:
        """In the background: upload the adapter written to `wdir`, announce it on the base, prune."""
        wv = await retry_unreachable(
            lambda: lora.publish_adapter(
                self.js,
                self.run_name,
                version,
                version,
                wdir,
                self.settings,
                base=self.base,
                rank=self.lc.lora.rank,
                keep=self.lc.keep_versions,
                protect=self.served.versions(),
            ),
            what=f"publishing adapter version {version}",
            give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
        )
        await asyncio.to_thread(ckpt.prune_weights, self.run_dir, self.lc.keep_versions)
        self.feeder.set_version(version)
        log.info("published adapter version %d (%.2f MB, %s)", version, wv.bytes / 1e6, wv.transport)

    async def announce_adapter_gpu(
        self, version: int, source, adapter_config: dict, files: asyncio.Future | None = None
    ) -> None:
        """[learner.lora] under cuda_ipc: announce the adapter packed in `source` on the base, then
        write its files (`files`, Weights.publish's) beside the next step."""
        wv = await retry_unreachable(
            lambda: lora.publish_adapter_gpu(
                self.js,
                self.run_name,
                version,
                version,
                source,
                base=self.base,
                rank=self.lc.lora.rank,
                adapter_config=adapter_config,
            ),
            what=f"announcing adapter version {version}",
            give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
        )
        self.feeder.set_version(version)
        log.info("published adapter version %d (%.2f MB, %s)", version, wv.bytes / 1e6, wv.transport)
        write = await files if files is not None else None
        if write is not None:
            await asyncio.to_thread(write)

    def _write_adapter(self, snap: tuple[dict, dict], version: int) -> None:
        """An adapter version's files under its weights directory, the oldest pruned (keep_versions)."""
        lora.write_adapter(*snap, ckpt.weights_dir(self.run_dir, version))
        ckpt.prune_weights(self.run_dir, self.lc.keep_versions)

    async def announce_gpu(self, version: int, source) -> None:
        """A GPU transport: announce where actors get the packed buffer. Actors copy it on their own
        time; nothing here waits for them."""
        wv = await retry_unreachable(
            lambda: registry.publish_gpu_version(self.js, self.run_name, version, version, source),
            what=f"announcing weights version {version}",
            give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
        )
        self.feeder.set_version(version)  # announced: tasks admitted from now on are sampled with it
        log.info("published weights version %d (%.1f MB, %s)", version, wv.bytes / 1e6, wv.transport)
