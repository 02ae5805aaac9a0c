"""One learner per run: the lease (a key in the run's lease KV, protocol.topology.lease_bucket) that
a learner takes before it loads anything and renews while it runs, and the check that a fresh start
does not inherit an older run's streams. learner.service's `main` calls both.

The key is created only if absent (KV create), so of two learners one wins; the other refuses with
one line naming the holder. A holder renews it (KV update on the revision it holds, so a lost lease
is noticed: the revision is its fencing token) every TTL / 4; one that was killed stops renewing and
the bucket's TTL removes the key, so a --resume after a kill waits at most LEASE_TTL_S; on the host
where the killed learner ran (its holder name is host-pid) the key is taken over at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from parley.errors import StateError
from parley.protocol import topology
from parley.protocol.topology import LEASE_KEY, LEASE_TTL_S

log = logging.getLogger(__name__)


class LeaseError(StateError):
    """The learner may not start on this run (learner.service.main exits 2 with its one line)."""


class LeaseHeld(LeaseError):
    """Another learner holds (and renews) the run's lease, or the run's streams are an older learner's."""


class LeaseLost(StateError):
    """The lease this learner held was taken by another (it could not renew for a whole TTL)."""


def holder_name() -> str:
    """Who holds the lease: this host and process (learner.service writes it into the key)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _died_here(holder: str) -> bool:
    """True when `holder` names a process of this host that no longer exists (a learner killed here,
    then resumed here). Another host's holder, or one whose process lives, is waited for."""
    host, _, pid = holder.rpartition("-")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class Lease:
    def __init__(self, js, run: str, holder: str, ttl_s: float = LEASE_TTL_S):
        self.js, self.run, self.holder, self.ttl_s = js, run, holder, ttl_s
        self.revision = 0  # the fencing token: the key's revision this learner wrote last
        self._kv = None

    async def acquire(self) -> int:
        """Take the lease, waiting out a holder that stopped renewing (killed: its key expires within
        the TTL); LeaseHeld at once when the holder renews meanwhile. Returns the revision."""
        from nats.js.errors import BucketNotFoundError

        try:
            self._kv = await self.js.key_value(topology.lease_bucket(self.run))
        except BucketNotFoundError:
            raise LeaseError(
                f"KV bucket {topology.lease_bucket(self.run)} (the learner lease) does not exist: create the run's "
                "topology with this version (`parley up`, the topology job, or a learner allowed to create it)"
            ) from None
        deadline = time.monotonic() + self.ttl_s + 2.0
        seen = None
        while True:
            try:
                self.revision = await self._kv.create(LEASE_KEY, self.holder.encode())
                log.info("learner lease of run %s taken (revision %d)", self.run, self.revision)
                return self.revision
            except KeyWrongLastSequenceError:
                pass
            try:
                entry = await self._kv.get(LEASE_KEY)
            except (KeyNotFoundError, NotFoundError):
                continue  # expired or released between the two calls
            holder = (entry.value or b"").decode(errors="replace")
            if _died_here(holder):
                # its process is gone from this host: take the key over now (delete on the revision seen,
                # so a renewal that raced in wins) rather than wait out the TTL
                try:
                    await self._kv.delete(LEASE_KEY, last=entry.revision)
                    log.warning("run %s: learner %s no longer runs on this host; taking its lease", self.run, holder)
                except KeyWrongLastSequenceError:
                    pass
                continue
            if seen is None:
                seen = entry.revision
                log.warning(
                    "run %s: learner %s holds the lease; waiting up to %.0f s for it to expire (a learner "
                    "that was killed stops renewing it)",
                    self.run,
                    holder,
                    self.ttl_s,
                )
            elif entry.revision != seen or time.monotonic() > deadline:
                raise LeaseHeld(
                    f"run {self.run!r} already has a learner ({holder}, renewing its lease): stop it first, or "
                    "start this one under another run name"
                )
            await asyncio.sleep(min(1.0, self.ttl_s / 8))

    async def renew(self) -> None:
        """Write the key again on the revision held (the TTL counts from here); LeaseLost if another
        learner took it meanwhile. A key that expired with nobody else writing it (a NATS outage longer
        than the TTL: the restarted server drops it; a renewal held up as long) is taken back with
        create, which fails if another learner wrote it first: the revision stays the fence."""
        try:
            self.revision = await self._kv.update(LEASE_KEY, self.holder.encode(), last=self.revision)
            return
        except (KeyWrongLastSequenceError, KeyNotFoundError) as e:
            lost = e
        try:
            self.revision = await self._kv.create(LEASE_KEY, self.holder.encode())
            log.warning(
                "run %s: the learner lease had expired unrenewed (%s); nobody else held it: taken back (revision %d)",
                self.run,
                lost,
                self.revision,
            )
            return
        except (KeyWrongLastSequenceError, KeyNotFoundError) as e:
            raise LeaseLost(
                f"run {self.run!r}: the learner lease (revision {self.revision}) was lost ({e}); another learner "
                "may run now, so this one stops without writing more"
            ) from None

    async def keep(self, halt: asyncio.Event) -> None:
        """Renew every TTL / 4 until `halt` (a background task of the learner: LeaseLost stops it).
        A renewal that fails for a connection outage is retried: only a lost lease ends it."""
        every = self.ttl_s / 4
        while not halt.is_set():
            try:
                await asyncio.wait_for(halt.wait(), timeout=every)
                return
            except TimeoutError:
                pass
            try:
                await self.renew()
            except LeaseLost:
                raise
            except Exception as e:  # noqa: BLE001 - an outage: the next round tries again
                log.warning("run %s: renewing the learner lease failed (%s); retrying", self.run, e)

    async def release(self) -> None:
        """Delete the key if it is still ours, so a next learner need not wait for the TTL."""
        if self._kv is None or not self.revision:
            return
        try:
            await self._kv.delete(LEASE_KEY, last=self.revision)
        except Exception as e:  # noqa: BLE001 - it expires by itself within the TTL
            log.info(
                "run %s: the learner lease was not released (%s); it expires within %.0f s", self.run, e, self.ttl_s
            )
        self.revision = 0


async def check_fresh_streams(js, run: str, reset: bool) -> None:
    """A fresh start (not --resume) refuses a run whose TASKS or DEAD streams hold messages, or whose
    weights are announced: an older learner's work would leak into the new run (tasks republished in
    the dedupe window dropped but counted in flight, old dead letters abandoning new tasks of the same
    id, old unacked Scored joining new groups). `reset` (--reset-streams) purges every stream of the
    run and the weights KV instead."""
    from nats.js.errors import BucketNotFoundError

    names = {key: topology.stream_name(run, key) for key in topology.CHANNELS}
    if reset:
        for name in names.values():
            await js.purge_stream(name)
        try:
            kv = await js.key_value(topology.kv_bucket(run))
            await kv.purge(topology.WEIGHTS_KEY)
            await kv.purge(topology.WEIGHTS_EARLY_KEY)
        except BucketNotFoundError:
            pass
        log.warning("run %s: --reset-streams purged the streams %s and the weights key", run, sorted(names.values()))
        return
    found = []
    for key in ("tasks", "dead"):
        state = (await js.stream_info(names[key])).state
        if state.messages:
            found.append(f"{names[key]} holds {state.messages} messages")
    try:
        kv = await js.key_value(topology.kv_bucket(run))
        entry = await kv.get(topology.WEIGHTS_KEY)
        if entry.value:
            found.append(f"weights are announced ({topology.kv_bucket(run)}/{topology.WEIGHTS_KEY})")
    except (BucketNotFoundError, KeyNotFoundError, NotFoundError):
        pass
    if found:
        raise LeaseHeld(
            f"run {run!r} has an older learner's streams ({'; '.join(found)}): pass --resume to continue it, "
            "--reset-streams to purge them and start over, or use another run name"
        )
