"""Weight publication beside the training loop, on rank 0: the learner takes a version's weights
synchronously after its step (a CPU copy, or a packed GPU buffer) and hands the rest (writing the
file, uploading it, hashing, announcing) to `Publisher`, so the next step starts at once.

Back-pressure: at most one publication runs at a time, and at most one waits behind it. A newer
version supersedes the one waiting (never the one running, so some version always gets through
however fast the steps come): the superseded one is never uploaded nor announced, its `discard`
removes what it had written, and it is counted and logged.

`Weights` is the learner's side of the weight path, one call per version (`publish`): what each
version is taken as and how it travels is its payload kind's (weights.payloads, chosen from the
run's [weights] once). learner.service builds both; learner.stepper calls `Weights.publish` after a step, the service's
loop checks, drains and abandons the `Publisher`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from parley.protocol.messages import CudaIpcBuffer, NcclSource
from parley.weights import lora, payloads, snapshot
from parley.weights.common import ServedVersions
from parley.weights.snapshot import PackedSnapshot, WeightSnapshot

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Where the publication takes a version's weights from: the trainer on rank 0, through
    learner.ranks.Driver (every rank makes the collective call). Each is called in a worker thread;
    the payload kind (weights.payloads) decides which."""

    def weights_snapshot(self) -> WeightSnapshot | None: ...
    def pack_versions(self, version: int, max_share: float | None) -> tuple[list, PackedSnapshot] | None: ...
    def pack_weights(self, version: int) -> CudaIpcBuffer | NcclSource | None: ...
    def adapter_snapshot(self) -> tuple[dict, dict] | None: ...
    def pack_adapter(self, version: int) -> tuple[CudaIpcBuffer | None, dict] | None: ...
    def weights_writable_in(self) -> float: ...


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
        self,
        settings,
        js,
        nc,
        run_name: str,
        source: WeightSource,
        publisher: Publisher,
        feeder,
        *,
        versions_dir: Path,
        keep: int = 3,
        adapter_base: str = "",
        adapter_rank: int = 0,
    ) -> None:
        """`settings`: the run's [weights] (weights.config), the transport every version takes.
        `versions_dir`: where each version's files are written (weights.snapshot.version_dir; kept
        for export), all but the newest `keep` pruned. `adapter_base`: [learner.lora] serve =
        "adapter", the base's identity (weights.lora.base_identity) each adapter version names, and
        `adapter_rank` its rank; "" publishes whole weights (also serve = "merged": the source's
        weights then have the adapter merged in)."""
        self.settings, self.js, self.run_name, self.source = settings, js, run_name, source
        self.publisher, self.feeder = publisher, feeder
        self.versions_dir, self.keep = Path(versions_dir), keep
        self.adapter_base, self.adapter_rank = adapter_base, adapter_rank
        self.served = ServedVersions(nc, run_name)  # what actors serve is never pruned
        self.payload = payloads.for_config(settings, adapter=bool(adapter_base))
        # a GPU payload: the newest version not published because every buffer was still held
        # (weights.cuda_ipc.IpcPublisher), published as soon as a buffer may be written (retry_held)
        self.held: int | None = None

    async def publish(self, version: int, write_now: bool = False) -> bool:
        """Take `version`'s weights now, before the next step can change them, and hand their upload
        and announcement to the publisher: the next step does not wait for them. `write_now`: its
        files are written before this returns (an eval exports it next). False when a GPU payload had
        no buffer it may write (the version is not published; retry_held publishes it later)."""
        return await self.payload.publish(self, version, write_now)

    def submit(self, version: int, job: Callable[[], Awaitable[None]], discard=None) -> None:
        """Hand `version`'s upload and announcement (`job`) to the publisher (a payload's publish)."""
        self.publisher.submit(Publication(version, job, discard=discard))

    async def retry_held(self) -> float | None:
        """Publish the version `publish` skipped because every GPU buffer was still held, once one may
        be written (no step has changed the weights since: a step's own publish clears it). The
        learner's loop calls this every round: without it a learner whose admission waits for that
        version (the actors serve an older one, and max_staleness admits no task at it) would wait
        for data that never comes. Returns the seconds until a buffer may be written while a version
        is still held back (the loop waits no longer than that), else None."""
        if self.held is None:
            return None
        wait = await asyncio.to_thread(self.source.weights_writable_in)
        if wait > 0:
            return wait
        version, self.held = self.held, None
        if not await self.payload.submit(self, version):  # a buffer was taken for a send meanwhile (nccl): next round
            self.held = version
            return 0.0
        self.publisher.counters["published_after_held"] += 1
        log.info(
            "weights version %d published once a buffer was free (skipped at its step, every buffer "
            "held; no step came in between)",
            version,
        )
        return None

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

    async def eval_copy(self, version: int) -> Callable[[], object] | None:
        """`version`'s copy for the eval that exports it next, taken now, with the call that writes its
        files behind training (payloads.Payload.eval_copy); None where `publish(write_now=True)` writes
        them on the step's path instead."""
        return await self.payload.eval_copy(self, version)

    def write_eval_copy(self, snap, version: int) -> None:
        """Write a GPU payload's copy of `version` (a WeightSnapshot) to its weights directory, as the file
        payloads do, for the eval's export (learner.checkpoint.export_version); the oldest are pruned."""
        snap.write(self.version_dir(version))
        self.prune()

    def write_adapter(self, snap: tuple[dict, dict], version: int) -> None:
        """An adapter version's files under its weights directory, the oldest pruned (keep)."""
        lora.write_adapter(*snap, self.version_dir(version))
        self.prune()

    def version_dir(self, version: int) -> Path:
        return snapshot.version_dir(self.versions_dir, version)

    def prune(self) -> None:
        """All but the newest `keep` versions' files removed (what actors serve is in the store)."""
        snapshot.prune_versions(self.versions_dir, self.keep)
