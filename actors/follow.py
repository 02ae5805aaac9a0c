"""Keeps an actor's engine on the policy version the learner announces: watches the run's weights
KV key (topology.WEIGHTS_KEY) and its early key (WEIGHTS_EARLY_KEY: a delta version announced
before its full copy is stored), and also polls them, since a watcher can stall for ~20 s after a
server restart. Used by the actor; the engine is reloaded in place, turns started later carry
the new version.

The engine serves whatever the key names (version and sha256), also when a resumed learner moves
it back to a lower version. A version whose blob fails verification
(weights.common.WeightVerifyError) or does not load is refused: the reason is logged once, the
actor keeps serving what it has, and that version is not fetched again (the next announcement
is). A GPU-transport load (cuda_ipc, nccl) is refused at once only for a mismatch; one that failed
for a reason that passes (weights.common.WeightUnavailable, a timeout, out of memory) is tried again
with back-off while it is announced, any other failure GPU_ATTEMPTS times in all (_gpu_failed). If a
failed load cannot be undone, WeightsBroken stops the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import time
from pathlib import Path

import msgspec

from parley.protocol import codec, topology
from parley.protocol.bus import COUNTERS, UNREACHABLE
from parley.protocol.messages import WeightVersion
from parley.weights import lora, registry
from parley.weights.common import WeightUnavailable, WeightVerifyError

log = logging.getLogger("parley.follow")


class WeightsBroken(RuntimeError):
    """A version failed to load and the served weights could not be put back: the actor must stop."""


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
        self._fetch = fetch or registry.fetch_version
        self.settings = settings
        self.refused: dict[int, str] = {}  # version -> reason, for heartbeats and logs
        self._refused_ids: set[tuple[int, str]] = set()
        self.failing: dict[int, str] = {}  # version -> why its last GPU load failed (tried again: _gpu_failed)
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
        self._served: Path | None = Path(base_dir) if base_dir else None  # the weights loaded now
        self._served_gpu: WeightVersion | None = None  # ... or the GPU-transport version loaded now
        # [weights] delta_format = "packed": (version, table digest) of the packed version served now (its
        # early and full announcements name it by different sha256s), whether the engine's packed copy
        # is what it serves from, and the versions whose packed delta failed (their full copy is fetched)
        self._serving_packed: tuple[int, str] | None = None
        self._served_packed = False
        self._delta_failed: set[tuple[int, str]] = set()
        self._bad_revision = 0
        self._base_dir = Path(base_dir) if base_dir else None  # the base an adapter version must name
        self._base_id: str | None = None  # its weights.lora.base_identity, computed at the first adapter
        self.adapter_dirs: dict[int, Path] = {}  # adapter version -> its fetched directory

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

    def _served_now(self, wv: WeightVersion) -> None:
        """Record that `wv` is served now, and wake every reach() waiting for a version."""
        self.loaded.append(wv.version)
        self.serving = (wv.version, wv.sha256)
        self._serving_packed = _packed_id(wv)
        self._signal_change()

    def _is_served(self, wv: WeightVersion) -> bool:
        return (wv.version, wv.sha256) == self.serving or (bool(wv.packed) and _packed_id(wv) == self._serving_packed)

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
                return False  # a failed GPU load waits out its backoff (_gpu_failed)
            if wv.version < self.engine.version:
                log.warning(
                    "weights key moved back from version %d to %d; following it", self.engine.version, wv.version
                )
            t0 = time.perf_counter()
            loaded = await self._load(wv)
            if loaded:
                self.load_s = time.perf_counter() - t0
            return loaded

    async def _load(self, wv: WeightVersion) -> bool:
        transport = registry.get(wv.transport)
        if transport is not None and transport.gpu:
            if wv.adapter is not None:
                return await self._load_adapter_gpu(wv, transport)
            return await self._load_gpu(wv, transport)
        # by identity, so a re-announced number never overwrites the files being served
        problem = announcement_problem(wv)
        if problem:
            return self._refuse(wv, f"announcement refused: {problem}", None)
        dest = self.dest_root / f"v{wv.version:06d}-{wv.sha256[:12]}"
        if wv.adapter is not None:
            return await self._load_adapter(wv, dest)
        if self._packed_on():
            from_delta = await self._load_packed(wv, transport, dest)
            if from_delta is not None:
                return from_delta
        try:
            # a delta version is rebuilt from the served files (never written to) when they are its base
            base = (self.serving[1], self._served) if self._served is not None and self.serving[1] else None
            path = await self._fetch(self.js, self.run, wv, dest, settings=self.settings, base=base)
        except WeightVerifyError as e:
            return self._refuse(wv, f"verification failed: {e}", dest)
        except WeightUnavailable as e:  # an early-announced full copy not stored in time: tried again
            log.warning("weights version %d: %s", wv.version, e)
            shutil.rmtree(dest, ignore_errors=True)
            return False
        except Exception as e:  # noqa: BLE001 - a blob we cannot get is refused like a bad one; a newer version may come
            # Store hiccups (timeouts during a reconnect) are worth another try on the next poll.
            if _transient(e):
                log.warning("weights version %d: fetch failed (%s); will retry", wv.version, e)
                shutil.rmtree(dest, ignore_errors=True)
                return False
            return self._refuse(wv, f"fetch failed: {type(e).__name__}: {e}", dest)
        old = self.engine.version
        try:
            await self.engine.reload_weights(path, version=wv.version)
        except Exception as e:  # noqa: BLE001 - refused, after putting the served weights back
            await self._restore(wv, e)
            return self._refuse(wv, f"reload failed: {type(e).__name__}: {e}", dest)
        log.info("now serving weights version %d (was %d, step %d)", wv.version, old, wv.step)
        self._served_now(wv)
        self._served_gpu = None
        self._served_packed = False
        if self._packed_on() and wv.packed:  # the next version's packed delta applies to a copy of this one
            why = await self.engine.keep_packed(codec.encode(wv), path)
            if why:
                log.warning("weights version %d: %s; the next packed delta is not applied here", wv.version, why)
        elif getattr(self.engine, "packed_name", None) is not None:
            await self.engine.drop_packed()  # it holds an older version than the one served now
        # Keep only the served version on disk (a shared_dir version is not ours to delete).
        previous, self._served = self._served, Path(path)
        if previous is not None and previous != self._served and previous.is_relative_to(self.dest_root):
            shutil.rmtree(previous, ignore_errors=True)
        return True

    def _packed_on(self) -> bool:
        """[weights] delta_format = "packed" here, and an engine that keeps a packed copy."""
        return getattr(self.settings, "delta_format", "file") == "packed" and hasattr(self.engine, "load_packed_delta")

    async def _load_packed(self, wv: WeightVersion, transport, dest: Path) -> bool | None:
        """A version with a packed delta against what the engine's packed copy holds: the delta is
        fetched and the engine applies it to the copy, checks it and loads it (no file of the version
        on this host). None: not this path (no packed delta, another base, or its delta failed
        before), the full version is fetched; False: an early announcement this actor cannot use
        (its full copy comes with the WEIGHTS_KEY announcement), or a fetch that may pass."""
        delta = wv.delta
        if delta is None or delta.format != "packed" or not wv.packed:
            return None
        key = _packed_id(wv)
        if getattr(self.engine, "packed_name", None) != delta.base_sha256 or key in self._delta_failed:
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
        old = self.engine.version
        path = dest / f".{wv.version}.packed-delta"
        try:
            dest.mkdir(parents=True, exist_ok=True)
            got = await transport.fetch_delta(self.js, self.run, wv, path, self.settings)  # shared_dir: where it lies
            await self.engine.load_packed_delta(codec.encode(wv), got, wv.version)
        except (WeightVerifyError, WeightUnavailable) as e:  # nothing served changed
            COUNTERS["weights.delta_refused"] += 1
            self._delta_failed.add(key)
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
            if self.engine.version == old and _transient(e):
                log.warning("weights version %d: packed delta fetch failed (%s); will retry", wv.version, e)
                return False
            try:
                await self.engine.restore_packed(old, revert=True)
            except Exception as e2:
                raise WeightsBroken(
                    f"weights version {wv.version} failed to load from its packed delta ({type(e).__name__}: {e}) "
                    f"and the served weights could not be restored ({e2}); stopping rather than serve a mixed model"
                ) from e2
            return self._refuse(wv, f"reload from its packed delta failed: {type(e).__name__}: {e}", None)
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
        self._served_now(wv)
        self._served_gpu = None
        self._served_packed = True
        return True

    async def _load_adapter(self, wv: WeightVersion, dest: Path) -> bool:
        """A LoRA adapter version: checked against this engine's base and rank limit, fetched and
        verified, then loaded beside the base under a new adapter id (the base is not reloaded).
        Adapters of older versions stay loaded while conversations use them (the actor drops them)."""
        problem = self._adapter_problem(wv)
        if problem:
            return self._refuse(wv, f"adapter refused: {problem}", None)
        try:
            path = await self._fetch(self.js, self.run, wv, dest, settings=self.settings)
            await self.engine.load_adapter(lora.as_vllm_adapter(path), wv.version)
        except WeightVerifyError as e:
            return self._refuse(wv, f"verification failed: {e}", dest)
        except Exception as e:  # noqa: BLE001 - nothing served changed: the base and older adapters still serve
            if _transient(e):
                log.warning("adapter version %d: fetch failed (%s); will retry", wv.version, e)
                shutil.rmtree(dest, ignore_errors=True)
                return False
            return self._refuse(wv, f"adapter load failed: {type(e).__name__}: {e}", dest)
        log.info("now serving adapter version %d (step %d)", wv.version, wv.step)
        self._served_now(wv)
        self.adapter_dirs[wv.version] = Path(path)
        return True

    def _adapter_problem(self, wv: WeightVersion) -> str | None:
        if self._base_id is None:
            self._base_id = lora.base_identity(self._base_dir) if self._base_dir is not None else ""
        return lora.adapter_problem(wv, self._base_id, getattr(self.engine.settings, "max_lora_rank", 0))

    async def _load_adapter_gpu(self, wv: WeightVersion, transport) -> bool:
        """A LoRA adapter in the learner's GPU buffer (cuda_ipc): checked against this engine's base and
        rank limit, then the engine's worker copies its tensors out of the buffer once their checksums
        match and hands them to vLLM beside the base (no file, no pause). Nothing served changes when
        it fails: a mismatch is refused for good, a failure that passes is tried again (_gpu_failed)."""
        problem = self._adapter_problem(wv)
        if problem:
            return self._refuse(wv, f"adapter refused: {problem}", None)
        source = transport.source(wv)
        if source is None or not wv.adapter.config:
            return self._refuse(
                wv,
                f"verification failed: adapter announced as {wv.transport} without its buffer or its peft config",
                None,
            )
        try:
            await self.engine.load_adapter_gpu(codec.encode(wv), wv.version, hold_s=source.hold_s)
        except WeightVerifyError as e:
            return self._refuse(wv, f"verification failed: {e}", None)
        except WeightUnavailable as e:
            return self._gpu_failed(wv, f"unavailable: {e}", passes=True)
        except Exception as e:  # noqa: BLE001 - the base and older adapters still serve
            return self._gpu_failed(wv, f"adapter load failed: {type(e).__name__}: {e}", passes=_passes(e))
        self.failing.pop(wv.version, None)
        log.info("now serving adapter version %d (step %d, %s)", wv.version, wv.step, wv.transport)
        self._served_now(wv)
        return True

    async def _load_gpu(self, wv: WeightVersion, transport) -> bool:
        """A GPU transport: no blob to fetch; the engine gets the learner's packed GPU buffer,
        checks its copy and loads it. A copy that fails its checksums is refused before any
        weight changed."""
        source = transport.source(wv)
        if source is None:
            return self._refuse(wv, f"verification failed: announced as {wv.transport} without its source", None)
        old = self.engine.version
        try:
            await self.engine.load_gpu(codec.encode(wv), hold_s=source.hold_s, version=wv.version)
        except WeightVerifyError as e:  # a mismatch: refused for good, nothing changed
            return self._refuse(wv, f"verification failed: {e}", None)
        except WeightUnavailable as e:  # it passes, nothing changed: tried again while announced
            return self._gpu_failed(wv, f"unavailable: {e}", passes=True)
        except Exception as e:  # noqa: BLE001 - tried again, after putting the served weights back
            await self._restore(wv, e)
            return self._gpu_failed(wv, f"reload failed: {type(e).__name__}: {e}", passes=_passes(e))
        self.failing.pop(wv.version, None)
        log.info("now serving weights version %d (was %d, step %d, %s)", wv.version, old, wv.step, wv.transport)
        self._served_now(wv)
        self._served_gpu = wv
        return True

    async def _restore(self, wv: WeightVersion, error: Exception) -> None:
        # A load that failed half-way may have replaced some tensors already: serving on
        # without reloading what we had would stamp turns of a mixed model with the old version.
        try:
            if self._served_packed:  # served from the engine's packed copy, which still holds it
                await self.engine.restore_packed(self.engine.version)
                return
            if self._served_gpu is not None:
                # the learner may have overwritten that buffer since: then its checksums refuse it
                served = self._served_gpu
                source = registry.get(served.transport).source(served)
                await self.engine.load_gpu(codec.encode(served), hold_s=source.hold_s, version=self.engine.version)
                return
            if self._served is None:
                raise RuntimeError("no record of the served weights")
            await self.engine.reload_weights(self._served, version=self.engine.version)
        except Exception as e:
            raise WeightsBroken(
                f"weights version {wv.version} failed to load ({type(error).__name__}: {error}) and the served "
                f"weights could not be restored ({e}); stopping rather than serve a mixed model"
            ) from e

    def _gpu_failed(self, wv: WeightVersion, reason: str, passes: bool) -> bool:
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
            return self._refuse(wv, f"{reason} ({self.failures[key]} attempts)", None)
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

    def _refuse(self, wv: WeightVersion, reason: str, dest: Path | None) -> bool:
        self.refused[wv.version] = reason
        self._refused_ids.add((wv.version, wv.sha256))
        self._signal_change()
        log.error("refused weights version %d: %s; still serving version %d", wv.version, reason, self.engine.version)
        if dest is not None and Path(dest) != self._served:
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
RETRY_MAX_S = 60.0  # the longest back-off between two tries of a version whose load failed (_gpu_failed)

# Announcements beyond these are refused unread: 2 TiB holds a 1T-parameter bf16 model.
MAX_WEIGHT_BYTES = 2 * 1024**4
MAX_WEIGHT_FILES = 64
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _packed_id(wv: WeightVersion) -> tuple[int, str] | None:
    """A packed version's identity: (version, its packed table's digest), the same in its early and
    its full announcement; None for a version without a packed table."""
    if not wv.packed:
        return None
    from parley.weights.cuda_ipc import table_digest

    return wv.version, table_digest(wv.packed)


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
    return None


def _transient(e: Exception) -> bool:
    return isinstance(e, UNREACHABLE)


def _passes(e: Exception) -> bool:
    """A GPU load that failed half-way for a reason that passes: past its hold time (the engine's
    TimeoutError), or out of memory (torch.OutOfMemoryError, also as it comes back from a worker)."""
    return isinstance(e, TimeoutError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
