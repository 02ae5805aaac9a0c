"""Weight publication beside the training loop, on rank 0: the learner takes a version's weights
synchronously after its step (a CPU copy, or a packed GPU buffer) and hands the rest (writing the
file, uploading it, hashing, announcing) to `Publisher`, so the next step starts at once.

Back-pressure: at most one publication runs at a time, and at most one waits behind it. A newer
version supersedes the one waiting (never the one running, so some version always gets through
however fast the steps come): the superseded one is never uploaded nor announced, its `discard`
removes what it had written, and it is counted and logged. Used by learner.service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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
        self.counters: Counter[str] = Counter()  # published, superseded
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
            log.info("weights version %d superseded by version %d before its upload began: never announced",
                     old.version, pub.version)
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
                log.warning("weights version %d abandoned during its upload at stop: never announced",
                            self.running.version)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
