"""Publishing with identity and consuming from the shared durable consumers, with dead-lettering.

Roles publish through `publish()` (Nats-Msg-Id from the message, retried on timeout) and consume
through `PullWorker`, which decodes each message with the channel's typed decoder, dead-letters
what cannot be decoded or has failed too often, and hands the rest to the role's handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.js.errors import (
    APIError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)

from parley.errors import ProtocolError
from parley.protocol import codec, topology
from parley.protocol.messages import DeadLetter

log = logging.getLogger(__name__)

# Process-wide counters shown in heartbeats and the live view ("dead.traj.poison": 3, ...).
COUNTERS: Counter[str] = Counter()
# Why a message was dead-lettered, as counted ("dead.<channel>.<cause>"); the full reason is in the letter.
DEAD_CAUSES = ("undecodable", "max_deliver", "poison", "nonfinite", "step_failed")


class Poison(ProtocolError):
    """Raised by a handler for a message that can never succeed: it is dead-lettered, not retried."""


class Retry(ProtocolError):
    """Raised by a handler for a transient failure: the message is nak'ed with `delay` seconds."""

    def __init__(self, reason: str, delay: float = 5.0):
        super().__init__(reason)
        self.delay = delay


# What a publish or a JetStream API call raises while the server is away or re-electing a leader.
PUBLISH_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,  # the stream has no leader for a moment (a cluster node died)
    ServiceUnavailableError,
)
# ... and, for longer operations (an object-store upload), the connection's own states meanwhile.
UNREACHABLE = (
    *PUBLISH_TRANSIENT,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    asyncio.TimeoutError,
)


async def retry_unreachable(
    call: Callable[[], Awaitable], *, what: str, give_up_s: float = 900.0, first_delay_s: float = 1.0
):
    """Await `call()` again while NATS is unreachable (the connection reconnects by itself), with a
    doubling delay up to 30 s; other errors, or an outage longer than `give_up_s`, are raised.
    For compound operations (publish_version) that must not fail a role over a server restart."""
    t0, delay = time.monotonic(), first_delay_s
    while True:
        try:
            return await call()
        except UNREACHABLE as e:
            waited = time.monotonic() - t0
            if waited + delay > give_up_s:
                raise
            log.warning(
                "%s failed (%s: %s); NATS unreachable? retrying in %.0fs (%.0fs so far)",
                what,
                type(e).__name__,
                e,
                delay,
                waited,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)


class Repeated(ProtocolError):
    """A publish asked to be fresh (`fresh=True`) that the server dropped as a repeat: a message with its
    Msg-Id was stored before this call, within the stream's duplicate window, so this one goes nowhere."""


async def publish(
    js,
    run: str,
    key: str,
    msg: msgspec.Struct,
    *,
    attempts: int = 8,
    timeout: float = 10.0,
    sent_before: bool = False,
    fresh: bool = False,
):
    """Store `msg` on channel `key` exactly once (by Msg-Id); retries timeouts and lost connections.

    A PubAck with duplicate=True means the server kept an earlier message with this Msg-Id and dropped
    this one. After an attempt of this call (or of a caller's earlier call: `sent_before`) timed out,
    that earlier message is our own: counted as `duplicate.<key>.retry`, harmless. Otherwise it was
    stored by someone before this call (a role that died after publishing, a redelivered piece of
    work done again, an earlier learner of the run): counted as `duplicate.<key>.earlier`, and raised
    as Repeated when the caller needs its message to go out (`fresh`: the feeder's tasks)."""
    data = codec.encode(msg)
    msg_id = codec.msg_id(msg)
    headers = {"Nats-Msg-Id": msg_id}
    subj = topology.subject(run, key)
    delay = 0.25
    for attempt in range(1, attempts + 1):
        try:
            ack = await js.publish(subj, data, headers=headers, timeout=timeout)
        except PUBLISH_TRANSIENT as e:
            # A timed-out publish may still have been stored; the Msg-Id makes the retry harmless.
            if attempt == attempts:
                raise
            log.warning("publish to %s failed (%s), retry %d/%d", subj, type(e).__name__, attempt, attempts)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        if getattr(ack, "duplicate", False):
            ours = sent_before or attempt > 1
            COUNTERS[f"duplicate.{key}.{'retry' if ours else 'earlier'}"] += 1
            if not ours:
                reason = (
                    f"{subj}: the server dropped message {msg_id!r} as a repeat of {ack.stream} seq {ack.seq}, "
                    "stored before this publish within the stream's duplicate window"
                )
                if fresh:
                    raise Repeated(reason)
                log.info("%s (already there: nothing to do)", reason)
        return ack


# Room left in a dead letter for its subject, reason, consumer and headers beside the payload.
_DEAD_HEADROOM = 16 * 1024


async def dead_letter(
    js,
    run: str,
    *,
    subject: str,
    reason: str,
    consumer: str,
    payload: bytes,
    max_bytes: int | None = None,
    cause: str = "poison",
) -> None:
    """Store the message in DEAD with `reason`; `cause` (one of DEAD_CAUSES) is what the counter says."""
    if cause not in DEAD_CAUSES:
        raise ValueError(f"dead-letter cause {cause!r} is not one of {DEAD_CAUSES}")
    # The original plus our fields must still fit the server's max_payload (and the stream's
    # max_msg_bytes): a just-under-limit message would otherwise be refused again as a dead letter.
    limit = min(getattr(getattr(js, "_nc", None), "max_payload", 0) or 1024**2, max_bytes or 1 << 62) - _DEAD_HEADROOM
    if len(payload) > limit:
        digest = hashlib.sha256(payload).hexdigest()
        reason = f"{reason[:1500]} [payload of {len(payload)} bytes (sha256 {digest}) cut to its first {limit}]"
        payload = payload[:limit]
    dl = DeadLetter(subject=subject, reason=reason[:2000], consumer=consumer, payload=payload, created=time.time())
    await publish(js, run, "dead", dl)
    COUNTERS[f"dead.{subject.rsplit('.', 1)[-1]}.{cause}"] += 1
    log.error("dead-lettered a message from %s: %s", subject, reason[:300])


@contextlib.asynccontextmanager
async def keep_alive(msg, every: float):
    """Tell the server we are still working on `msg` (in_progress) until the block ends."""

    async def beat():
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


Handler = Callable[[object, object], Awaitable[None]]

# How many settled messages a worker remembers (stream sequence and Msg-Id). A restarted nats-server
# delivers again what it had not recorded as settled: the acks and deliveries of its last moments, and
# the acks sent while it was down, which reach it after its first redeliveries. Those copies come
# within seconds of its restart, and a worker settles at most what it holds during the outage.
SETTLED_KEPT = 4096


class Delivery:
    """A message as a PullWorker hands it to its handler: the nats Msg's attributes and methods, and
    its ack and term tell the worker, which so knows a copy delivered again as already settled."""

    __slots__ = ("msg", "_settled")

    def __init__(self, msg, settled: Callable[[object, str], None]):
        self.msg, self._settled = msg, settled

    def __getattr__(self, name):
        return getattr(self.msg, name)

    async def ack(self) -> None:
        self._settled(self.msg, "ack")  # first: the work is stored, so a copy is settled even if this ack is lost
        await self.msg.ack()

    async def term(self) -> None:
        self._settled(self.msg, "term")
        await self.msg.term()


class PullWorker:
    """Runs one role's share of a channel's durable consumer.

    The handler gets (decoded message, the nats Msg as a Delivery) and must ack it when its work is
    stored. It may raise Retry (nak with delay) or Poison (dead-letter); any other exception is
    treated as Retry with a back-off. Messages delivered more than `max_deliver` times are
    dead-lettered with the last error.
    """

    def __init__(
        self,
        js,
        run: str,
        key: str,
        handler: Handler,
        *,
        bus: topology.BusSettings,
        name: str,
        concurrency: int = 1,
        fetch_timeout: float = 2.0,
        dead_retry_s: float = 30.0,
    ):
        channel = topology.CHANNELS[key]
        if channel.durable is None:
            raise ValueError(f"channel {key!r} has no shared consumer")
        self.js, self.run, self.key, self.handler = js, run, key, handler
        self.bus, self.name = bus, name
        self.durable = channel.durable
        self.concurrency = concurrency
        self.fetch_timeout = fetch_timeout
        self.dead_retry_s = dead_retry_s  # a dead letter that could not be stored is tried again after this
        self.subject = topology.subject(run, key)
        self._slots = asyncio.Semaphore(concurrency)
        self._unslotted = 0  # handlers running on messages a fetch brought beyond its slots (run_until)
        self._freed = asyncio.Event()  # a handler gave its slot back
        self._tasks: set[asyncio.Task] = set()
        self._last_error: dict[str, str] = {}
        self.stats: Counter[str] = Counter()
        # Sizes of the latest messages: a fetch asks for as many as fit bus.fetch_max_bytes at the
        # largest of them. Until one has been seen, a message may be as large as the stream allows.
        self._sizes: deque[int] = deque(maxlen=32)
        # Stream sequences this worker's handlers hold, and the redeliveries of each absorbed while
        # held: after a nats-server restart longer than ack_wait the server delivers every held message
        # again however often it was kept alive (its in_progress is not persisted), and that copy is
        # neither handled twice nor counted against max_deliver (tests/integration/test_bus.py).
        # The counts are also kept in the run's held KV (topology.held_bucket), so that the worker that
        # gets a message after its holder died (an actor killed while it waited out the outage) does
        # not count the copies the holder absorbed either (test_bus.py).
        self._held: set[int] = set()
        self._absorbed: Counter[int] = Counter()
        self._held_kv = None  # bound on first use
        self._inherited: set[int] = set()  # held messages whose count another worker left in the KV
        # Messages this worker acked or termed (by stream sequence and Msg-Id), the latest SETTLED_KEPT:
        # a copy the restarted server delivers after its handler was done (the ack, or the delivery,
        # lost with the server) is settled again the same way, not handled twice (test_bus.py).
        self._settled: dict[tuple[int, str | None], str] = {}
        # Set once a fetch came back with fewer messages than it asked for (the consumer had no more
        # waiting), after the handlers of that fetch have had their first turn: every message waiting
        # when the worker started has then been handed to the handler, so a resumed learner reads its
        # backlog before it times anything out. A steady flow below the worker's capacity sets it too.
        self.caught_up = asyncio.Event()

    def batch(self, free: int) -> int:
        """How many messages to fetch with `free` slots: never more than fit fetch_max_bytes at the
        largest recent message size, never fewer than one."""
        largest = max(self._sizes, default=self.bus.max_msg_bytes)
        return max(1, min(free, self.bus.fetch_max_bytes // max(1, largest)))

    async def run_until(self, stop: asyncio.Event) -> None:
        sub = await self.js.pull_subscribe_bind(self.durable, stream=topology.stream_name(self.run, self.key))
        try:
            while not stop.is_set():
                # Fetch only as many as we have free slots: the rest stay available to other replicas.
                # Wait for a slot in short hops so a stop request is seen even when every slot is busy.
                # (wait_for on an event, never on acquire: a cancelled wait_for can swallow an acquired
                # slot on 3.11.) The event wakes us as soon as a handler gives its slot back; a fixed
                # sleep here left freed slots idle and capped a busy worker at `concurrency` per sleep.
                if self._slots.locked():
                    self._freed.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._freed.wait(), timeout=0.05)
                    self._reraise_crashes()
                    continue
                await self._slots.acquire()  # free: returns at once
                free, most = 1, self.batch(self.concurrency)  # by count and by bytes
                while free < most and not self._slots.locked():
                    await self._slots.acquire()
                    free += 1
                answered = True  # the server said what it has (maybe nothing), rather than failing
                try:
                    msgs = await sub.fetch(free, timeout=self.fetch_timeout)
                except TimeoutError:  # nats' TimeoutError, or the bare one fetch raises on its second request
                    msgs = []  # no work right now
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError, APIError) as e:
                    log.warning("%s: fetch failed (%s); retrying", self.name, e)
                    msgs, answered = [], False
                    await asyncio.sleep(1.0)
                for _ in range(free - len(msgs)):
                    self._slots.release()
                # nats.py's fetch also returns what an earlier fetch's request delivered after that fetch
                # had given up waiting (its whole pending queue): more messages than slots taken. Their
                # handlers run (the messages are here) but give back no slot, so `concurrency` holds again
                # once they are done instead of growing by them for good.
                self._unslotted += max(0, len(msgs) - free)
                self._sizes.extend(len(m.data) for m in msgs)
                for m in msgs:
                    t = asyncio.create_task(self._handle(m))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
                if answered and len(msgs) < free and not self.caught_up.is_set():
                    asyncio.get_running_loop().call_soon(self.caught_up.set)  # after those tasks' first step
                self._reraise_crashes()
        finally:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _reraise_crashes(self) -> None:
        for t in list(self._tasks):
            if t.done() and not t.cancelled() and t.exception():
                raise t.exception()

    @staticmethod
    def _identity(m) -> tuple[int, str | None]:
        return m.metadata.sequence.stream, (m.headers or {}).get("Nats-Msg-Id")

    def _record_settled(self, m, how: str) -> None:
        self._settled[self._identity(m)] = how
        while len(self._settled) > SETTLED_KEPT:
            del self._settled[next(iter(self._settled))]

    async def _handle(self, m) -> None:
        seq = m.metadata.sequence.stream
        how = self._settled.get(self._identity(m))
        if how is not None:  # settled here already: the server missed it; settle the copy the same way
            self.stats["settled_again"] += 1
            log.info(
                "%s: %s:%d came back (delivery %d) after it was settled here; %s again",
                self.name,
                m.metadata.stream,
                seq,
                m.metadata.num_delivered,
                how,
            )
            try:
                with contextlib.suppress(Exception):  # lost again: it comes back again, and is settled again
                    await (m.ack() if how == "ack" else m.term())
            finally:
                self._give_back_slot()
            return
        if seq in self._held:  # delivered again while a handler here holds it: that handler acks it
            self._absorbed[seq] += 1
            self.stats["absorbed"] += 1
            self._give_back_slot()
            await self._count_absorbed(seq)
            return
        self._held.add(seq)
        try:
            await self._handle_one(m)
        finally:
            self._held.discard(seq)
            self._give_back_slot()

    def _give_back_slot(self) -> None:
        """A handler is done: its slot back to the fetch loop, unless it ran on a message beyond the
        slots its fetch took (run_until), which took none."""
        if self._unslotted:
            self._unslotted -= 1
            return
        self._slots.release()
        self._freed.set()

    async def _handle_one(self, m) -> None:
        self.stats["delivered"] += 1
        meta = m.metadata
        ident = f"{meta.stream}:{meta.sequence.stream}"
        seq = meta.sequence.stream
        delivered = meta.num_delivered - self._absorbed[seq]  # absorbed copies cost nothing
        try:
            obj = codec.decode(self.key, m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self._dead(m, f"decode error: {e}", "undecodable")
            return
        if delivered > self.bus.max_deliver:  # over the limit here: a holder before us may have absorbed copies
            delivered = meta.num_delivered - max(self._absorbed[seq], await self._absorbed_elsewhere(seq))
        if delivered > self.bus.max_deliver:
            reason = self._last_error.get(ident, "no error recorded in this process")
            # Forgotten only once stored: a dead letter retried after a failed publish keeps the reason.
            if await self._dead(
                m,
                f"delivered {delivered} times (max_deliver={self.bus.max_deliver}); last error: {reason}",
                "max_deliver",
            ):
                self._last_error.pop(ident, None)
                self._forget_absorbed(seq)
            return
        try:
            await self.handler(obj, Delivery(m, self._record_settled))
            self.stats["handled"] += 1
            self._last_error.pop(ident, None)
            self._forget_absorbed(seq)
        except Poison as e:
            if await self._dead(m, str(e)):
                self._forget_absorbed(seq)
        except asyncio.CancelledError:
            raise
        except Retry as e:
            self._last_error[ident] = str(e)
            self.stats["retried"] += 1
            log.warning("%s: will retry %s in %.1fs: %s", self.name, ident, e.delay, e)
            with contextlib.suppress(Exception):
                await m.nak(delay=e.delay)
        except Exception as e:  # noqa: BLE001 - any handler failure is retried, then dead-lettered
            self._last_error[ident] = f"{type(e).__name__}: {e}"
            self.stats["retried"] += 1
            log.exception("%s: handler failed on %s; nak", self.name, ident)
            with contextlib.suppress(Exception):
                await m.nak(delay=min(2.0 * meta.num_delivered, 30.0))

    async def _held_store(self):
        if self._held_kv is None:
            self._held_kv = await self.js.key_value(topology.held_bucket(self.run))
        return self._held_kv

    async def _count_absorbed(self, seq: int) -> None:
        """Add one absorbed copy of `seq` to the held KV (a compare-and-set increment). Not stored (the
        server is away again): a successor counts that copy against max_deliver, as before the KV."""
        key = topology.held_key(self.key, seq)
        try:
            kv = await self._held_store()
            for _ in range(5):
                try:
                    entry = await kv.get(key)
                except NotFoundError:
                    with contextlib.suppress(KeyWrongLastSequenceError, APIError):
                        await kv.create(key, b"1")
                        return
                    continue
                try:
                    await kv.update(key, str(int(entry.value or b"0") + 1).encode(), last=entry.revision)
                    return
                except (KeyWrongLastSequenceError, APIError):
                    continue
        except Exception as e:  # noqa: BLE001 - the count is a courtesy to a successor, never a failure here
            log.warning("%s: could not record an absorbed copy of %s (%s: %s)", self.name, key, type(e).__name__, e)

    async def _absorbed_elsewhere(self, seq: int) -> int:
        """The absorbed copies of `seq` in the held KV (this worker's and its predecessors'); 0 if unknown."""
        try:
            entry = await (await self._held_store()).get(topology.held_key(self.key, seq))
        except NotFoundError:
            return 0
        except Exception as e:  # noqa: BLE001 - unreadable: the server's count stands
            log.warning(
                "%s: could not read absorbed copies of %s:%d (%s: %s)", self.name, self.key, seq, type(e).__name__, e
            )
            return 0
        self._inherited.add(seq)
        return int(entry.value or b"0")

    def _forget_absorbed(self, seq: int) -> None:
        """`seq` is settled: drop its absorbed count here, and in the KV if one was stored."""
        if self._absorbed.pop(seq, 0) or seq in self._inherited:
            self._inherited.discard(seq)
            t = asyncio.create_task(self._purge_absorbed(seq))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _purge_absorbed(self, seq: int) -> None:
        with contextlib.suppress(Exception):  # left behind, it expires with the bucket's ttl
            await (await self._held_store()).purge(topology.held_key(self.key, seq))

    async def _dead(self, m, reason: str, cause: str = "poison") -> bool:
        """Dead-letter `m` and term it; False (and `m` nak'ed to come back) if the dead letter was not stored."""
        try:
            await dead_letter(
                self.js,
                self.run,
                subject=m.subject,
                reason=reason,
                consumer=self.name,
                payload=m.data,
                max_bytes=self.bus.max_msg_bytes,
                cause=cause,
            )
        except Exception as e:  # noqa: BLE001 - not stored as a dead letter: keep the message, try again later
            self.stats["dead_failed"] += 1
            log.error(
                "%s: could not dead-letter a message from %s (%s: %s); it comes back in %.0fs",
                self.name,
                m.subject,
                type(e).__name__,
                e,
                self.dead_retry_s,
            )
            # The consumer has no server-side delivery limit (topology.consumer_config), so this nak (or,
            # if it is lost too, ack_wait) always brings the message back and the dead letter is retried.
            with contextlib.suppress(Exception):
                await m.nak(delay=self.dead_retry_s)
            return False
        self.stats["dead"] += 1
        self._record_settled(m, "term")
        await m.term()
        return True
