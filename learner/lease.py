"""One learner per run: the lease (a key in the run's lease KV, protocol.topology.lease_bucket) that
a learner takes before it loads anything and renews while it runs, and the check that a fresh start
does not inherit an older run's streams. learner.service's `main` calls both.

The key is created only if absent (KV create), so of two learners one wins; the other refuses with
one line naming the holder. A holder renews it (KV update on the revision it holds, so a lost lease
is noticed: the revision is its fencing token) every TTL / 4; one that was killed stops renewing and
the bucket's TTL removes the key, so a --resume after a kill waits at most LEASE_TTL_S; on the host
and in the PID namespace where the killed learner ran (its holder name is host-pid@scope, holder_name)
the key is taken over at once.

The renewals run on a thread of their own, with their own event loop and NATS connection (`connect`):
the learner's loop is held for longer than the TTL by synchronous work (Learner's construction loads
the training split on it), and renewals on that loop expired the key of a learner that was alive.
A killed process renews nothing, so the TTL still frees the lease of a dead learner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

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


def pid_scope() -> str:
    """Where this process's pid means something: the kernel's boot and the PID namespace
    (`<boot id>.<namespace inode>`), "" where /proc does not say. Two containers with one host name (host
    networking, a fixed `hostname:`) have pids of different namespaces; two machines may share a host
    name and even a namespace inode (every root namespace has the same one), never a boot id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ns = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""
    inode = ns[ns.find("[") + 1 : ns.rfind("]")]
    return f"{boot}.{inode}" if boot and inode.isdigit() else ""


def holder_name(pid: int | None = None) -> str:
    """Who holds the lease: this host, the process and where its pid means something
    (`<host>-<pid>@<pid_scope>`; learner.service writes it into the key). pid: another process of
    this host and namespace (tests)."""
    return f"{socket.gethostname()}-{os.getpid() if pid is None else pid}@{pid_scope()}"


def _died_here(holder: str) -> bool:
    """True when `holder` names a process of this host and PID namespace that no longer exists (a
    learner killed here, then resumed here). Another host's or namespace's holder (a container beside
    this one under the same host name), one of a scope nobody could read or of a name from before
    scopes, and one whose process lives, are waited for (the TTL frees a dead one's lease)."""
    name, _, scope = holder.partition("@")
    host, _, pid = name.rpartition("-")
    here = pid_scope()
    if not here or scope != here or host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class Lease:
    """`connect`: opens the renewals' own NATS connection (on their thread; the caller's `js` is bound to
    its loop). Without it the renewals run on the caller's loop, and a loop held longer than the TTL
    loses the lease (tests only)."""

    def __init__(
        self, js, run: str, holder: str, ttl_s: float = LEASE_TTL_S, connect: Callable[[], Awaitable] | None = None
    ):
        self.js, self.run, self.holder, self.ttl_s = js, run, holder, ttl_s
        self.connect = connect
        self.revision = 0  # the fencing token: the key's revision this learner wrote last
        self.renewed = 0.0  # time.monotonic() of the last successful take or renewal (written by the renewal thread)
        self._kv = None

    def holds(self) -> bool:
        """True while the last take or renewal is younger than the TTL less one renewal period: the key
        cannot have expired (and been taken by another learner) meanwhile. learner.intake asks before
        each ledger write. Not a proof: a write that starts just before the answer turns stale may
        still land in the window up to the TTL."""
        return bool(self.revision) and time.monotonic() - self.renewed < self.ttl_s * 3 / 4

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
                self.renewed = time.monotonic()
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

    async def renew(self, kv=None) -> None:
        """Write the key again on the revision held (the TTL counts from here); LeaseLost if another
        learner took it meanwhile. A key that expired with nobody else writing it (a NATS outage longer
        than the TTL: the restarted server drops it; a renewal held up as long) is taken back with
        create, which fails if another learner wrote it first: the revision stays the fence. `kv`: the
        bucket on the renewal thread's connection (the caller's by default)."""
        kv = kv or self._kv
        try:
            self.revision = await kv.update(LEASE_KEY, self.holder.encode(), last=self.revision)
            self.renewed = time.monotonic()
            return
        except (KeyWrongLastSequenceError, KeyNotFoundError) as e:
            lost = e
        try:
            self.revision = await kv.create(LEASE_KEY, self.holder.encode())
            self.renewed = time.monotonic()
            log.warning(
                "run %s: the learner lease had expired unrenewed (%s); nobody else held it: taken back (revision %d)",
                self.run,
                lost,
                self.revision,
            )
            return
        except (KeyWrongLastSequenceError, KeyNotFoundError) as e:
            lost = e
        entry = None
        with contextlib.suppress(Exception):  # who holds it: the line stands without it
            entry = await asyncio.wait_for(kv.get(LEASE_KEY), 5.0)
        if entry is not None and entry.value == self.holder.encode():
            # Our own name: an earlier renewal of ours, stored after we gave up on its answer (sent while
            # cut off from NATS, flushed on the reconnect). Nobody else writes this name, so the key is
            # still ours, a revision on: renew on that one (seen under make faults' nats-server restarts).
            with contextlib.suppress(KeyWrongLastSequenceError, KeyNotFoundError):
                self.revision = await kv.update(LEASE_KEY, self.holder.encode(), last=entry.revision)
                self.renewed = time.monotonic()
                log.warning(
                    "run %s: the learner lease was at revision %d, written by this learner's own renewal after "
                    "its answer was lost (%s); renewed on it (revision %d)",
                    self.run,
                    entry.revision,
                    lost,
                    self.revision,
                )
                return
        held, self.revision = self.revision, 0  # not ours: holds() says so, release() leaves the key alone
        holder = "another learner"
        if entry is not None:  # who took it, for the operator
            holder += f", {(entry.value or b'').decode(errors='replace')},"
        raise LeaseLost(
            f"run {self.run!r}: the learner lease (revision {held}) was lost to {holder} after it went unrenewed "
            f"for its {self.ttl_s:.0f} s TTL (this process paused or cut off from NATS; {lost}); this learner stops "
            "without writing more, leaving the run's books to that one: let it run, or stop it and start this one "
            "again with --resume"
        ) from None

    async def keep(self, halt: asyncio.Event) -> None:
        """Renew every TTL / 4 until `halt` (a background task of the learner: LeaseLost stops it), on
        the renewal thread when `connect` was given. A renewal that fails for a connection outage is
        retried: only a lost lease ends it."""
        if self.connect is None:
            await self._renewing(self._kv, halt.is_set)
            return
        stop = threading.Event()
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def settle(error: BaseException | None) -> None:
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        def thread() -> None:
            error = None
            try:
                asyncio.run(self._on_own_connection(stop))
            except BaseException as e:  # noqa: BLE001 - handed to the learner's loop: LeaseLost ends it there
                error = e
            with contextlib.suppress(RuntimeError):  # the learner's loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(settle, error)

        threading.Thread(target=thread, name=f"lease-{self.run}", daemon=True).start()
        halted = asyncio.create_task(halt.wait())
        try:
            await asyncio.wait({done, halted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.set()
            halted.cancel()
        await done  # the thread's last renewal is over (release() writes on the revision it left)

    async def _on_own_connection(self, stop: threading.Event) -> None:
        """The renewal thread's loop: its own connection (retried while NATS is away), then renewals."""
        nc = None
        while nc is None and not stop.is_set():
            try:
                nc = await self.connect()
            except Exception as e:  # noqa: BLE001 - NATS away: the lease may still be renewed in time
                log.warning("run %s: the learner lease's connection failed (%s); retrying", self.run, e)
                await asyncio.sleep(1.0)
        if nc is None:
            return
        try:
            kv = None
            while kv is None and not stop.is_set():
                try:
                    kv = await nc.jetstream().key_value(topology.lease_bucket(self.run))
                except Exception as e:  # noqa: BLE001 - as a failed renewal: retried, the TTL decides
                    log.warning("run %s: the learner lease's bucket could not be read (%s); retrying", self.run, e)
                    await asyncio.sleep(1.0)
            if kv is not None:
                await self._renewing(kv, stop.is_set)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _renewing(self, kv, stopped: Callable[[], bool]) -> None:
        every, hop = self.ttl_s / 4, min(0.1, self.ttl_s / 40)
        while not stopped():
            due = time.monotonic() + every
            while time.monotonic() < due:
                if stopped():
                    return
                await asyncio.sleep(min(hop, max(due - time.monotonic(), 0)))
            try:
                await self.renew(kv)
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
