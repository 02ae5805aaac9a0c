"""Keeps an actor's engine on the policy version the learner announces: watches the run's weights
KV key (topology.WEIGHTS_KEY) and its early key (WEIGHTS_EARLY_KEY: a delta version announced
before its full copy is stored), and also polls them, since a watcher can stall for ~20 s after a
server restart. Used by the actor; the engine is reloaded in place, turns started later carry
the new version. How an announcement is loaded is its payload kind's (weights.payloads: full,
delta, packed delta, GPU buffer, adapter, adapter in GPU memory); this loop only follows the key
and keeps what is served, refused and retried.

The engine serves whatever the key names (version and sha256), also when a resumed learner moves
it back to a lower version. A version whose blob fails verification
(weights.common.WeightVerifyError) or does not load is refused: the reason is logged once, the
actor keeps serving what it has, and that version is not fetched again (the next announcement
is). A GPU-transport load (cuda_ipc, nccl) is refused at once only for a mismatch; one that failed
for a reason that passes (weights.common.WeightUnavailable, a timeout, out of memory) is tried again
with back-off while it is announced, any other failure GPU_ATTEMPTS times in all (gpu_failed). If a
failed load cannot be undone, WeightsBroken stops the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from parley.protocol import codec, topology
from parley.protocol.bus import COUNTERS
from parley.protocol.messages import WeightVersion
from parley.weights import lora, payloads, registry
from parley.weights.payloads import WeightsBroken

log = logging.getLogger(__name__)


class WeightFollower:
    """Follows the weights key of `run` for `engine` (anything with `version`,
    `async reload_weights(dir, version=...)` and, for a GPU transport (cuda_ipc, nccl), `async
    load_gpu(announcement, hold_s=..., version=...)`). `settings` is this run's [weights]
    (a shared_dir announcement must point into its dir). `dest_root` holds fetched versions; only the
    one being served is kept. `base_dir` is the checkpoint the engine started from: what is
    reloaded if a new version fails half-way through loading."""

    def __init__(
        self,
        js,
        run: str,
        engine,
        *,
        dest_root: str | Path,
        poll_s: float = 5.0,
        base_dir: str | Path | None = None,
        fetch=None,
        settings=None,
    ):
        self.js, self.run, self.engine = js, run, engine
        self.dest_root = Path(dest_root)
        self.poll_s = poll_s
        self.fetch = fetch or registry.fetch_version
        self.settings = settings
        self.refused: dict[int, str] = {}  # version -> reason, for heartbeats and logs
        self._refused_ids: set[tuple[int, str]] = set()
        self.failing: dict[int, str] = {}  # version -> why its last GPU load failed (tried again: gpu_failed)
        self.failures: dict[tuple[int, str], int] = {}  # (version, sha256) -> GPU loads failed so far
        self.retry_at: dict[tuple[int, str], float] = {}  # (version, sha256) -> loop time of its next try
        self.serving: tuple[int, str] = (engine.version, "")  # (version, sha256) loaded now; "" = the base
        self.loaded: list[int] = []  # versions reloaded, in order
        self._announced = engine.version  # the version the key named when last read (`announced`)
        self._announce = asyncio.Event()  # set (and replaced) when `announced` changes: announcement()
        self.load_s = 0.0  # seconds the last loaded version took: fetch, verify, load
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) when what is served changes or a version is refused
        self.served_dir: Path | None = Path(base_dir) if base_dir else None  # the files loaded now (or last)
        # how to load again what is served now, after a load failed half-way: set by the payload kind
        # that loaded it (weights.payloads); at first, the files the engine started from
        self.put_back: Callable[[], Awaitable[None]] = self.reload_served_dir
        # [weights] delta_format = "packed": (version, table digest) of the packed version served now (its
        # early and full announcements name it by different sha256s), and the versions whose packed
        # delta failed (their full copy is fetched)
        self._serving_packed: tuple[int, str] | None = None
        self.delta_failed: set[tuple[int, str]] = set()
        self._bad_revision = 0
        self._base_dir = Path(base_dir) if base_dir else None  # the base an adapter version must name
        self._base_id: str | None = None  # its weights.lora.base_identity, computed at the first adapter
        self.adapter_dirs: dict[int, Path] = {}  # adapter version -> its fetched directory
        # [up] gpu_share = "phased": the actor's phase schedule (actors.phases.PhaseSchedule), told before
        # and after every load so that a sleeping engine wakes its weights, then the load, then its KV
        self.phases = None

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def announced(self) -> int:
        """The version the weights key named when last read (before its load starts)."""
        return self._announced

    @announced.setter
    def announced(self, version: int) -> None:
        if version != self._announced:
            self._announced = version
            ev, self._announce = self._announce, asyncio.Event()
            ev.set()

    def announcement(self) -> asyncio.Event:
        """An event set when `announced` next changes: what a conversation waits on beside its
        generation, so it is cut the moment its group can no longer be trained (StaleWatch)."""
        return self._announce

    async def reach(self, version: int, timeout_s: float, poll_s: float = 0.25) -> bool:
        """Wait until the engine serves `version` or newer (True), at most `timeout_s` (False: the
        version was refused, is slow to come, or a resumed learner moved the key back). Wakes the
        poll loop first, so an announcement the watcher has not delivered yet is read now."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._wake.set()
        while self.engine.version < version:
            if version in self.refused or loop.time() >= deadline:
                return False
            # woken by the load (or refusal) itself; poll_s only bounds a change made elsewhere
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=max(0.0, min(poll_s, deadline - loop.time())))
        return True

    def served_now(self, wv: WeightVersion) -> None:
        """Record that `wv` is served now, and wake every reach() waiting for a version."""
        self.loaded.append(wv.version)
        self.serving = (wv.version, wv.sha256)
        self._serving_packed = payloads.packed_id(wv)
        self._signal_change()

    def _is_served(self, wv: WeightVersion) -> bool:
        return (wv.version, wv.sha256) == self.serving or (
            bool(wv.packed) and payloads.packed_id(wv) == self._serving_packed
        )

    def _signal_change(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _read(self) -> WeightVersion | None:
        """What to serve now: the announcement on WEIGHTS_KEY, or the one on WEIGHTS_EARLY_KEY (a delta
        version whose full copy is still uploading) when that was created later. A stale early one (a
        resumed learner, a later version sent full only) is older than WEIGHTS_KEY's and ignored."""
        kv = await self.js.key_value(topology.kv_bucket(self.run))
        wv = await self._read_key(kv, topology.WEIGHTS_KEY)
        early = await self._read_key(kv, topology.WEIGHTS_EARLY_KEY)
        if early is not None and early.full_pending and (wv is None or early.created > wv.created):
            return early
        return wv

    async def _read_key(self, kv, key: str) -> WeightVersion | None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return codec.decode("weights", entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if self._bad_revision != entry.revision:  # log and count once per bad value, not every poll
                log.error("weights key %r (revision %d) holds no WeightVersion: %s", key, entry.revision, e)
                COUNTERS["weights.undecodable"] += 1  # shown in the actor's heartbeat
            self._bad_revision = entry.revision
            return None

    async def check(self) -> bool:
        """Read the key once and load what it names unless that is served already or was refused.
        True if a reload happened."""
        async with self._lock:
            wv = await self._read()
            if wv is not None:
                self.announced = wv.version
            # Identity is (version, sha256), not just "newer": a learner resumed from a checkpoint
            # re-announces lower numbers with other weights, and actors must follow it back.
            if wv is None or self._is_served(wv) or (wv.version, wv.sha256) in self._refused_ids:
                return False
            if asyncio.get_running_loop().time() < self.retry_at.get((wv.version, wv.sha256), 0.0):
                return False  # a failed GPU load waits out its backoff (gpu_failed)
            if wv.version < self.engine.version:
                log.warning(
                    "weights key moved back from version %d to %d; following it", self.engine.version, wv.version
                )
            t0 = time.perf_counter()
            loaded = False
            if self.phases is not None:  # an engine asleep ([up] gpu_share = "phased") wakes its weights first
                await self.phases.before_load()
            try:
                loaded = await self._load(wv)
            except BaseException:
                if self.phases is not None:  # ... and its KV cache after; the load's own error is the one
                    with contextlib.suppress(Exception):  # raised (a failed wake is the schedule's failure too)
                        await self.phases.after_load(False)
                raise
            if self.phases is not None:
                await self.phases.after_load(loaded)
            if loaded:
                self.load_s = time.perf_counter() - t0
            return loaded

    async def _load(self, wv: WeightVersion) -> bool:
        """The payload kind the announcement names loads it (weights.payloads)."""
        return await payloads.for_announcement(wv, self.settings, self.engine).load(self, wv)

    def adapter_problem(self, wv: WeightVersion) -> str | None:
        if self._base_id is None:
            self._base_id = lora.base_identity(self._base_dir) if self._base_dir is not None else ""
        return lora.adapter_problem(wv, self._base_id, getattr(self.engine.settings, "max_lora_rank", 0))

    async def restore(
        self, wv: WeightVersion, error: Exception, again: Exception | None = None, hint: str = ""
    ) -> None:
        """Put the served version back after `wv` failed to load half-way (`error`; `again`: its second
        try's, when it had one). A load that failed half-way may have replaced some tensors already:
        serving on without reloading what we had would stamp turns of a mixed model with the old
        version. When that fails too, WeightsBroken names both versions, what failed and `hint`."""
        try:
            await self.put_back()
        except Exception as e:
            second = "" if again is None else f", and again at a second try ({type(again).__name__}: {again})"
            raise WeightsBroken(
                f"weights version {wv.version} failed to load ({type(error).__name__}: {error}){second}; the served "
                f"version {self.engine.version} could not be restored ({e}); stopping rather than serve a mixed "
                f"model" + (f" ({hint})" if hint else "")
            ) from e

    async def reload_served_dir(self) -> None:
        """Reload the served files (the engine's start, or the file version loaded last)."""
        if self.served_dir is None:
            raise RuntimeError("no record of the served weights")
        await self.engine.reload_weights(self.served_dir, version=self.engine.version)

    def gpu_failed(self, wv: WeightVersion, reason: str, passes: bool) -> bool:
        """A GPU-transport load that failed is tried again at the next polls, with back-off (poll_s x 2^k,
        at most RETRY_MAX_S): one that `passes` (weights.common.WeightUnavailable: the buffer did not
        open, the receive broke or timed out; out of memory while the learner steps on the same GPU)
        for as long as the key announces that version (the learner keeps the newest version's buffer),
        any other GPU_ATTEMPTS times in all before it is refused. Refusing a passing failure for good
        left the actor serving an old version while the learner dropped every group it played as
        stale, and published no more. A mismatch (WeightVerifyError) never comes here: refused at once."""
        key = (wv.version, wv.sha256)
        self.failures[key] = self.failures.get(key, 0) + 1
        if not passes and self.failures[key] >= GPU_ATTEMPTS:
            return self.refuse(wv, f"{reason} ({self.failures[key]} attempts)", None)
        self.failing[wv.version] = reason
        wait = min(self.poll_s * 2 ** (self.failures[key] - 1), RETRY_MAX_S)  # the learner's next step may free it
        self.retry_at[key] = asyncio.get_running_loop().time() + wait
        log.warning(
            "weights version %d: %s; attempt %d%s, trying again in %.0f s; still serving version %d",
            wv.version,
            reason,
            self.failures[key],
            "" if passes else f" of {GPU_ATTEMPTS}",
            wait,
            self.engine.version,
        )
        return False

    def refuse(self, wv: WeightVersion, reason: str, dest: Path | None) -> bool:
        self.refused[wv.version] = reason
        self._refused_ids.add((wv.version, wv.sha256))
        self._signal_change()
        log.error("refused weights version %d: %s; still serving version %d", wv.version, reason, self.engine.version)
        if dest is not None and Path(dest) != self.served_dir:
            shutil.rmtree(dest, ignore_errors=True)
        return False

    async def _watch(self, stop: asyncio.Event, key: str) -> None:
        # The put of an announcement only wakes the poll loop early; reading and loading happen in one
        # place. A core subscription to the key's subject, not a KV watcher: a watcher is an ordered
        # push consumer, which no workload role may create (deploy/permissions.py). A put missed while
        # reconnecting is caught by the poll.
        async def wake(_msg) -> None:
            self._wake.set()

        while not stop.is_set():
            try:
                sub = await self.js._nc.subscribe(topology.weights_key_subject(self.run, key), cb=wake)
                try:
                    await stop.wait()
                finally:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the poll loop covers us meanwhile
                log.warning("weights watcher failed (%s); restarting it", e)
                await asyncio.sleep(self.poll_s)

    async def run_until(self, stop: asyncio.Event) -> None:
        watchers = [
            asyncio.create_task(self._watch(stop, key)) for key in (topology.WEIGHTS_KEY, topology.WEIGHTS_EARLY_KEY)
        ]
        try:
            while not stop.is_set():
                self._wake.clear()  # before reading: an announcement during the read wakes us again
                try:
                    await self.check()
                except (asyncio.CancelledError, WeightsBroken):
                    raise
                except Exception as e:  # noqa: BLE001 - a failed read (reconnecting) is retried at the next poll
                    log.warning("reading the weights key failed: %s", e)
                waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())]
                await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
        finally:
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)


GPU_ATTEMPTS = 3  # GPU-transport loads of one version failing for a reason not known to pass, before it is refused
RETRY_MAX_S = 60.0  # the longest back-off between two tries of a version whose load failed (gpu_failed)
