"""A generic NATS request/reply service: the runner behind `parley sim` and `parley judge`.

API:
    service = Service(nc, {subject: handler, ...}, queue=..., concurrency=8, on_error=..., name=...)
    await service.start()              # subscribed (queue group) and flushed: requests are served
    await service.stop(grace_s=30)     # stop taking requests, let in-flight ones finish, return
    await service.run_until(stop, run=..., role=..., ident=...)   # start + heartbeats + stop

A handler is `async def handler(data: bytes) -> bytes` returning the encoded reply; it should turn
bad input into an error reply itself. If it raises anyway, `on_error(subject, data, exc) -> bytes`
builds the reply, so a requester never waits for a timeout because of a bug. An exception for
which `fatal(exc)` is true (the backend is gone, e.g. backend.is_fatal) gets no reply; the service
stops taking requests and run_until raises, so the process exits non-zero and is restarted while
requesters retry elsewhere. Each request runs in its own task; at most `concurrency` run at once
(the rest wait in the subscription's queue). Replicas share the load through the queue group.

Overload never turns into repeated work: a request that waited here longer than its requester waits
(protocol/request.py; counted on this process's clock from the moment it arrived) is dropped
unanswered; one that comes again with the payload of a request being computed joins that
computation, and one whose answer was computed too late for its requester (within ANSWER_TTL_S)
gets that answer; so does a re-send that says its previous send timed out at the requester
(protocol.request's resend header), whose answer this clock may have seen as in time. The key of
both is the id derived again from the payload received, never the id a header claims: a requester
that knows another's id cannot get another's answer ("id_mismatch" counts such headers). The
counters "expired", "joined", "repeated", "late" (computed, but its requesters had stopped waiting)
and "shed" (arrived while the queue held QUEUE_BYTES) say how often.

A requester that stops waiting before its timeout withdraws its request (protocol/request.py): each
replica hears the withdrawals of its subjects (no queue group) and looks up the send they name. A
withdrawn request still queued is dropped, never computed; one being computed is left out of the
answer, and the computation is cancelled (the handler's task, so a vLLM engine aborts the request)
once none of its requests is still awaited (all withdrawn or expired); while a joined re-send still
waits, it goes on for that one. "withdrawn" counts the requests withdrawn here, "cancelled" the
computations cut. A withdrawal of a send not (yet) received is kept for a while (EARLY_WITHDRAWALS_*),
since it may be read before its request, and then forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable

from parley.errors import ConfigError
from parley.protocol import status
from parley.protocol.connect import barrier
from parley.protocol.messages import Heartbeat
from parley.protocol.request import is_resend, request_id, send_id, wait_and_id, withdrawal
from parley.protocol.topology import withdraw_subject

log = logging.getLogger(__name__)

Handler = Callable[[bytes], Awaitable[bytes]]
OnError = Callable[[str, bytes, BaseException], bytes]


async def _flush(nc, attempts: int = 15) -> None:
    """Flush, waiting out a reconnect: the server may have restarted while a local backend was
    loading (which blocks the loop), and the subscriptions are re-sent once the client is back."""
    import nats.errors

    for attempt in range(1, attempts + 1):
        try:
            await barrier(nc, timeout=5)
            return
        except (nats.errors.FlushTimeoutError, nats.errors.ConnectionReconnectingError) as e:
            if attempt == attempts:
                raise
            log.warning("flush failed (%s); NATS reconnecting? retry %d/%d", type(e).__name__, attempt, attempts - 1)
            await asyncio.sleep(1.0)


# Answers kept for re-sent requests: a computation that finished after its requester's deadline is
# answered from here when the request comes again (within ANSWER_TTL_S), instead of computed again.
# Bounded by bytes as well as by count: a reference reply is 4 bytes a token, so 4096 answers of long
# conversations would otherwise hold gigabytes.
ANSWERS_KEPT = 4096
ANSWER_BYTES_KEPT = 64 * 1024**2
ANSWER_TTL_S = 900.0
# Requests that arrived and wait for a slot are held by this process (stamped on arrival, so the
# wait is counted from then), up to this many bytes of payload; beyond it a request is shed
# unanswered and its requester retries (another replica, or this one once the queue has drained).
QUEUE_BYTES = 64 * 1024**2
# Withdrawals of sends this process has not received: nats-py hands each subscription's messages to a
# callback task of its own, so a withdrawal can be read before the request it withdraws; and every
# replica hears every withdrawal of its subjects, mostly of requests another replica holds. Kept (to
# drop the request if it comes) for a few seconds at most, and at most this many.
EARLY_WITHDRAWALS_KEPT = 4096
EARLY_WITHDRAWAL_TTL_S = 30.0


def _expired(deadline: float | None) -> bool:
    """deadline: time.monotonic() after which the requester no longer waits (None = no deadline)."""
    return deadline is not None and time.monotonic() > deadline


class _Request:
    """A received request: the message, when (time.monotonic()) its requester stops waiting, its send
    id ("": it cannot be withdrawn), whether it was withdrawn, and the computation that answers it."""

    __slots__ = ("msg", "deadline", "send", "withdrawn", "computation")

    def __init__(self, msg, deadline: float | None, send: str = ""):
        self.msg, self.deadline, self.send = msg, deadline, send
        self.withdrawn = False
        self.computation: _Computation | None = None

    def awaited(self) -> bool:
        return not self.withdrawn and not _expired(self.deadline)


class _Computation:
    """One handler call and the requests it answers: the first, and the re-sends that joined it.
    `work` is the handler's task once started; `cut`: cancelled because nobody awaits it any more."""

    __slots__ = ("requests", "work", "cut")

    def __init__(self, req: _Request):
        self.requests = [req]
        self.work: asyncio.Future | None = None
        self.cut = False
        req.computation = self


# Every requester's reply subject is an inbox (protocol.connect.inbox_prefix: `_INBOX_<user>.` or
# nats.py's `_INBOX.`). A request whose reply names anything else asks the service to publish its
# answer there on the requester's behalf (allow_responses lets a service answer any reply subject
# once): into a run's SCORED or DEAD, another run's inbox. It is answered nowhere.
_INBOX = "_INBOX"


async def _respond(msg, reply: bytes) -> None:
    if msg.reply:
        if not msg.reply.startswith(_INBOX):
            log.warning("request on %s asks for its answer on %s, not an inbox: not answered", msg.subject, msg.reply)
            return
        with contextlib.suppress(Exception):  # the requester may have gone; nothing to do
            await msg.respond(reply)


class Service:
    def __init__(
        self,
        nc,
        routes: dict[str, Handler],
        *,
        queue: str,
        concurrency: int = 8,
        on_error: OnError | None = None,
        name: str = "service",
        counters: Counter | None = None,
        fatal: Callable[[BaseException], bool] | None = None,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} must be >= 1")
        self.nc, self.routes, self.queue = nc, dict(routes), queue
        self.concurrency = concurrency
        self.on_error = on_error
        self.fatal = fatal
        self.failure: BaseException | None = None
        self._failed = asyncio.Event()
        self.name = name
        # "served", "errors", plus whatever the handlers count ("fallback", ...); shown in heartbeats
        self.counters: Counter = counters if counters is not None else Counter()
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._subs = []
        self.latency_s = 0.0  # moving average, for the heartbeat
        # the backend's call accounting (engines.backend.OpenAIBackend.usage), set by serve_backend
        self.usage: Counter | None = None
        # By (subject, request id): the computations under way, and recent answers.
        self._joining: dict[tuple[str, str], _Computation] = {}
        # By (subject, send id): the requests received and not yet answered or dropped, which a
        # withdrawal may name; and withdrawals read before their request: (when, request id).
        self._sends: dict[tuple[str, str], _Request] = {}
        self._early: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        # answers by key: (when, reply, whether a requester of it was late by this clock)
        self._answered: OrderedDict[tuple[str, str], tuple[float, bytes, bool]] = OrderedDict()
        self._answered_bytes = 0
        self._queued_bytes = 0
        self._dispatchers: list[asyncio.Task] = []

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        for subject, handler in self.routes.items():
            queue: asyncio.Queue = asyncio.Queue()
            # withdrawals first, so none of a request this replica receives is missed; no queue group:
            # only the replica that holds the request knows it
            self._subs.append(await self.nc.subscribe(withdraw_subject(subject), cb=self._withdrawal(subject)))
            sub = await self.nc.subscribe(subject, queue=self.queue, cb=self._arrival(subject, queue))
            self._subs.append(sub)
            d = asyncio.create_task(self._dispatch(subject, handler, queue))
            d.add_done_callback(self._dispatcher_ended)
            self._dispatchers.append(d)
        await _flush(self.nc)  # the server has the subscriptions before anyone is told we serve
        log.info(
            "%s: serving %s (queue %s, concurrency %d)", self.name, sorted(self.routes), self.queue, self.concurrency
        )

    def _arrival(self, subject: str, queue: asyncio.Queue):
        async def arrive(msg) -> None:
            # nats-py calls this one message at a time, after the message waited in the client's
            # own queue: it only stamps the arrival and hands on, so that wait is (almost) nil and
            # the requester's wait is counted from here, on this clock.
            wait, claimed = wait_and_id(msg)
            send = send_id(msg)
            early = self._early.pop((subject, send), None) if send else None
            if early is not None and early[1] == claimed:  # withdrawn before it got here
                self.counters["withdrawn"] += 1
                return
            size = len(msg.data)
            if self._queued_bytes + size > QUEUE_BYTES and not queue.empty():
                self.counters["shed"] += 1
                return
            self._queued_bytes += size
            req = _Request(msg, None if wait is None else time.monotonic() + wait, send)
            if send:
                self._sends[(subject, send)] = req
            queue.put_nowait(req)

        return arrive

    def _withdrawal(self, subject: str):
        async def withdraw(msg) -> None:
            rid, send = withdrawal(msg)
            if not send:
                return
            req = self._sends.get((subject, send))
            if req is None:  # not here (yet): another replica's, already answered, or read before its request
                self._keep_early((subject, send), rid)
                return
            if req.withdrawn or wait_and_id(req.msg)[1] != rid:
                return
            req.withdrawn = True
            self.counters["withdrawn"] += 1
            c = req.computation
            if c is not None and c.work is not None and not c.work.done() and not any(r.awaited() for r in c.requests):
                c.cut = True  # nobody reads its answer: stop computing it (a queued one is dropped at dispatch)
                c.work.cancel()

        return withdraw

    def _keep_early(self, key: tuple[str, str], rid: str) -> None:
        now = time.monotonic()
        self._early[key] = (now, rid)
        self._early.move_to_end(key)
        while self._early and (
            len(self._early) > EARLY_WITHDRAWALS_KEPT
            or next(iter(self._early.values()))[0] < now - EARLY_WITHDRAWAL_TTL_S
        ):
            self._early.popitem(last=False)

    def _done(self, subject: str, req: _Request) -> None:
        """`req` is answered or dropped: a withdrawal of it has nothing left to stop."""
        if req.send and self._sends.get((subject, req.send)) is req:
            del self._sends[(subject, req.send)]
        req.computation = None

    async def _dispatch(self, subject: str, handler: Handler, queue: asyncio.Queue) -> None:
        # One request at a time, in arrival order: waiting for a slot here is the back-pressure.
        while True:
            req: _Request = await queue.get()
            self._queued_bytes -= len(req.msg.data)
            if req.withdrawn:  # its requester withdrew it while it queued (counted then)
                self._done(subject, req)
                continue
            if _expired(req.deadline):  # it queued here longer than its requester waits: computing it helps no one
                self.counters["expired"] += 1
                self._done(subject, req)
                continue
            key = self._key(subject, req.msg)
            answered = self._answered.get(key) if key else None
            if answered and answered[0] > time.monotonic() - ANSWER_TTL_S and (answered[2] or is_resend(req.msg)):
                # a re-send of a request answered after its first requester gave up: late by this clock,
                # or delivered in time by this clock while the requester's own wait (which began before
                # the request reached us) had run out, as its re-send says
                self.counters["repeated"] += 1
                self._done(subject, req)
                await _respond(req.msg, answered[1])
                continue
            under_way = self._joining.get(key) if key else None
            if under_way is not None and not under_way.cut:
                # a re-send while the first is being computed: one computation, both answered
                under_way.requests.append(req)
                req.computation = under_way
                self.counters["joined"] += 1
                continue
            c = _Computation(req)
            if key is not None:
                self._joining[key] = c  # (replacing a cut one, which ends without answering)
            await self._slots.acquire()
            t = asyncio.create_task(self._serve(subject, handler, c, key))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def _dispatcher_ended(self, task: asyncio.Task) -> None:
        # A dispatcher ends only when stopped; one that failed would leave its route deaf: stop serving.
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: request dispatch failed: %r", self.name, task.exception())
            self.failure = self.failure or task.exception()
            self._failed.set()

    def _key(self, subject: str, msg) -> tuple[str, str] | None:
        """The key of joins and remembered answers: the id of the payload received. A request without
        an id header (an older requester) is served alone; one whose header names another payload is
        served alone too, and counted."""
        _, claimed = wait_and_id(msg)
        if not claimed:
            return None
        rid = request_id(subject, msg.data)
        if claimed != rid:
            self.counters["id_mismatch"] += 1
            return None
        return (subject, rid)

    async def _serve(self, subject: str, handler: Handler, c: _Computation, key: tuple[str, str] | None) -> None:
        t0 = time.perf_counter()
        msg = c.requests[0].msg  # the joined ones carry the same payload
        try:
            if not any(r.awaited() for r in c.requests):  # expired or withdrawn while waiting for a slot
                if not all(r.withdrawn for r in c.requests):  # (the withdrawn are counted already)
                    self.counters["expired"] += 1
                return
            keep = True
            c.work = asyncio.ensure_future(handler(msg.data))
            try:
                reply = await c.work
            except asyncio.CancelledError:
                if c.cut and c.work.cancelled() and not asyncio.current_task().cancelling():
                    # every requester withdrew (_withdrawal): nobody reads an answer. A cancellation
                    # of this task itself (stop()) goes on as ever.
                    self.counters["cancelled"] += 1
                    return
                raise
            except Exception as e:  # noqa: BLE001 - a bug must still answer the requester
                self.counters["errors"] += 1
                if self.fatal is not None and self.fatal(e):
                    if self.failure is None:
                        log.error("%s: backend failed for good (%s: %s); stopping", self.name, type(e).__name__, e)
                    self.failure = self.failure or e
                    self._failed.set()
                    return
                log.exception("%s: handler for %s failed", self.name, subject)
                if self.on_error is None:
                    return
                reply, keep = self.on_error(subject, msg.data, e), False  # a re-send should try again
            if key is not None and self._joining.get(key) is c:
                del self._joining[key]  # from here a re-send is answered from memory or computed afresh
            waiting = [r for r in c.requests if not r.withdrawn]
            late = [r for r in waiting if _expired(r.deadline)]
            # Nobody waits on a late one's inbox any more (and its response permission may be gone).
            self.counters["late"] += len(late)
            if key is not None and keep:
                # A late one (it reached nobody or not everybody) goes to whatever re-sends its payload;
                # one delivered in time only to a request that says it re-sends after a timeout (it may
                # have reached a requester that had stopped waiting). Asking again after an answer (a
                # retry after ok=False) asks afresh.
                self._remember(key, reply, late=bool(late))
            for r in waiting:
                if not any(r is gone for gone in late):
                    await _respond(r.msg, reply)
            self.counters["served"] += 1
            dt = time.perf_counter() - t0
            self.latency_s = dt if not self.latency_s else 0.9 * self.latency_s + 0.1 * dt
        finally:
            if key is not None and self._joining.get(key) is c:
                del self._joining[key]
            for r in c.requests:
                self._done(subject, r)
            self._slots.release()

    def _remember(self, key: tuple[str, str], reply: bytes, late: bool) -> None:
        now = time.monotonic()
        if key in self._answered:
            self._answered_bytes -= len(self._answered.pop(key)[1])
        self._answered[key] = (now, reply, late)
        self._answered_bytes += len(reply)
        while self._answered and (
            len(self._answered) > ANSWERS_KEPT
            or self._answered_bytes > ANSWER_BYTES_KEPT
            or next(iter(self._answered.values()))[0] < now - ANSWER_TTL_S
        ):
            self._answered_bytes -= len(self._answered.popitem(last=False)[1][1])

    async def stop(self, grace_s: float = 30.0) -> None:
        """Unsubscribe (queued requests go unanswered and the requesters retry elsewhere), then
        wait up to grace_s for the requests in flight."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        for d in self._dispatchers:  # what still waits for a slot goes unanswered, like the unsubscribed
            d.cancel()
        await asyncio.gather(*self._dispatchers, return_exceptions=True)
        self._dispatchers = []
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._sends.clear()  # what still queued goes unanswered: nothing left to withdraw
        self._early.clear()

    def heartbeat(self, role: str, ident: str, state: str = "ready") -> Heartbeat:
        counters = {k: float(v) for k, v in self.counters.items()}
        counters.update(in_flight=float(self.in_flight), latency_s=round(self.latency_s, 3))
        counters.update({f"backend.{k}": float(v) for k, v in (self.usage or {}).items()})
        return Heartbeat(role=role, id=ident, state=("busy" if self.in_flight else state), counters=counters)

    async def run_until(
        self, stop: asyncio.Event, *, run: str, role: str, ident: str, grace_s: float = 30.0, heartbeat_s: float = 2.0
    ) -> None:
        """Serve until `stop` is set, sending heartbeats on the run's status subject."""
        await self.start()
        beats = asyncio.create_task(
            status.heartbeat_loop(self.nc, run, lambda: self.heartbeat(role, ident), stop, every=heartbeat_s)
        )
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._failed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await status.send(self.nc, run, Heartbeat(role=role, id=ident, state="stopping"))
            await self.stop(grace_s)
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        if self.failure is not None:
            raise RuntimeError(
                f"{self.name}: backend failed: {type(self.failure).__name__}: {self.failure}"
            ) from self.failure


class BadServiceConfig(ConfigError):
    """Raised by a `serve_backend` builder when the backend cannot serve the configured work."""


# What a builder returns, per service: (the Service, its role, its heartbeat id, stop grace in s).
Served = tuple[Service, str, str, float]


async def serve_backend(
    stop: asyncio.Event,
    cfg,
    *,
    ident: str,
    roles: list[tuple[str, str]],
    backend_cfg,
    build: Callable[[object, object], list[Served]],
    make: Callable[[], object] | None = None,
) -> int:
    """The process around one backend, shared by `parley sim`, `parley judge`, `parley services`
    and `parley reference`: connect, announce every (role, id) as starting, load the backend (a
    local engine blocks here while it loads), serve what `build(nc, backend)` returns until `stop`,
    close the backend. The backend is make_backend(backend_cfg), or `make()` for one that is not an
    LLM engine (the reference model). One service failing (its engine died), or the local engine found
    dead or stalled (its `watch`), stops the others and is raised: the process exits non-zero. A
    BadServiceConfig from `build` is logged and gives exit code 2."""
    from parley.engines.backend import make_backend
    from parley.runtime.role import role_connection

    hello = [Heartbeat(role=role, id=rid, state="starting") for role, rid in roles]
    async with role_connection(cfg.nats, name=f"parley-{ident}", run=cfg.run.name, hello=hello) as (nc, _):
        t0 = time.perf_counter()
        backend = make_backend(backend_cfg) if make is None else make()
        kind = backend_cfg.backend if make is None else type(backend).__name__
        log.info("%s: backend %s (%s) ready in %.1fs", ident, backend.model_name, kind, time.perf_counter() - t0)
        try:
            try:
                served = build(nc, backend)
            except BadServiceConfig as e:
                log.error("bad configuration: %s", e)
                return 2
            for svc, *_ in served:
                svc.usage = getattr(backend, "usage", None)
            tasks = [
                asyncio.create_task(svc.run_until(stop, run=cfg.run.name, role=role, ident=rid, grace_s=grace))
                for svc, role, rid, grace in served
            ]
            watch = getattr(backend, "watch", None)  # a local engine that dies or stalls stops the services
            if watch is not None:
                tasks.append(asyncio.create_task(watch(stop)))
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in done:
                if t.exception():
                    raise t.exception()
        finally:
            await backend.close()
    return 0
