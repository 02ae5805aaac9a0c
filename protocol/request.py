"""Request/reply with the shared services (user simulator, judge, reference): each request carries
how long its requester waits and an id in its headers.

Requesters (services.sim.client.SimClient, services.judge.client.JudgeClient, the eval) send through `request()`;
the service scaffolding (engines/service.py) reads `wait_and_id()` to drop work whose requester
has stopped waiting, and to let a re-sent request join the computation already under way.

A request whose connection comes back while it waits (nats-server restarted, or the requester moved to
another node) is sent again at once, as a re-send, for the rest of its wait: a restarted server refuses a
service's answer to a request the old server delivered (the permission to answer, allow_responses, is
granted per delivery and not kept), so the first send's answer would never come and the requester would
wait out its whole timeout. The re-send joins the computation under way, or gets its remembered answer
(engines/service.py); where nothing was lost it costs one duplicate request.

A requester cancelled while it waits (an actor cutting a conversation whose group went stale) stops
waiting before its timeout: `request()` then withdraws the request (`withdraw()`), a core-NATS
message on topology.withdraw_subject(subject) with an empty payload and two headers, the request's
id and its send id (random per send, so a withdrawal names one send among the re-sends and other
requesters that share the id, and cannot be forged from the payload). The service drops the request
if it is still queued, and cancels its computation if nobody else waits for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets

import nats.errors

from parley.protocol.connect import reconnects
from parley.protocol.topology import withdraw_subject

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "Parley-Timeout"  # seconds the requester waits for the reply, counted from when it sends
ID_HEADER = "Parley-Request-Id"  # equal for a request and its re-sends
# on a request sent again because the previous send of the same payload timed out at the requester:
# an answer the service delivered to that send after the requester had stopped waiting is this one's
RESEND_HEADER = "Parley-Resend"
# random per send; on a withdrawal, the send it withdraws
SEND_HEADER = "Parley-Send-Id"

# The wait is a duration, not a time of day: the service counts it on its own clock from the moment
# the request reaches it, so two hosts whose clocks disagree (by any amount) drop nothing that is
# still awaited. The requester's share of the wait spent in transit is not counted, which can only
# make the service keep a request a little longer than its requester waits: never shorter.
MAX_WAIT_S = 86400.0  # a header beyond a day is a bad value, not a wait
# after a reconnect, the pause before asking again a service that is not back yet (times the tries so far)
RESEND_POLL_S = 0.1


def request_id(subject: str, data: bytes) -> str:
    """The id of a request: a digest of its subject and payload. A re-sent request (a retry after a
    timeout, a redelivered task or trajectory asking the same question with the same seed) has the
    same id without the caller keeping any state, and asks for the same answer. The service derives
    it again from what it received, so an id names a payload and nothing else."""
    return hashlib.blake2b(subject.encode() + b"\0" + data, digest_size=16).hexdigest()


async def request(nc, subject: str, data: bytes, *, timeout: float, resend: bool = False):
    """nc.request with the wait (the timeout), the id and a send id in the headers; `resend`: this
    payload's previous send timed out here (the service may answer with what it computed for that one).
    Sent again as a re-send, for the rest of the wait, when the connection reconnects meanwhile (the
    module's docstring); the whole wait stays `timeout`. Cancelled while it waits, it withdraws the
    request, then lets the cancellation go on."""
    loop = asyncio.get_running_loop()
    rid, deadline, watch = request_id(subject, data), loop.time() + timeout, reconnects(nc)
    after_reconnect = 0  # sends since the connection came back while this request waited
    while True:
        left, send = deadline - loop.time(), secrets.token_hex(8)
        if left <= 0:
            raise nats.errors.TimeoutError
        headers = {TIMEOUT_HEADER: f"{left:.3f}", ID_HEADER: rid, SEND_HEADER: send}
        if resend:
            headers[RESEND_HEADER] = "1"
        reply = asyncio.ensure_future(nc.request(subject, data, timeout=left, headers=headers))
        back = watch.next() if watch is not None else None
        try:
            await asyncio.wait([reply] if back is None else [reply, back], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            reply.cancel()
            if back is not None:
                back.cancel()
            await withdraw(nc, subject, rid, send)
            raise
        if back is not None:
            back.cancel()
        if reply.done():
            if (
                after_reconnect
                and not reply.cancelled()
                and isinstance(reply.exception(), nats.errors.NoRespondersError)
            ):
                # the service's own connection is not back yet (its subscription comes with it): ask again
                # shortly, within this request's wait, rather than hand the caller an outage it did not have
                after_reconnect += 1
                await asyncio.sleep(min(RESEND_POLL_S * after_reconnect, max(0.0, deadline - loop.time())))
                continue
            return reply.result()
        reply.cancel()  # its answer may be refused by the server that came back: ask that server
        reply.add_done_callback(_retrieve)
        log.info("request %s on %s: the connection came back while it waited; sent again", rid[:12], subject)
        resend, after_reconnect = True, 1


def _retrieve(fut: asyncio.Future) -> None:
    """Read a dropped send's outcome, so that asyncio does not report it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


async def withdraw(nc, subject: str, rid: str, send: str) -> None:
    """Tell the services of `subject` that send `send` of request `rid` is no longer awaited, so that
    they compute no answer nobody reads. Best effort, and never raises: a withdrawal that is lost
    costs only the computation it would have saved (the service still drops the request once its
    wait has expired). A core-NATS publish only queues the bytes in the client, so a cancelled
    caller is not held up."""
    try:
        await nc.publish(withdraw_subject(subject), b"", headers={ID_HEADER: rid, SEND_HEADER: send})
    except Exception as e:  # noqa: BLE001 - closed, draining, reconnecting with a full buffer: nothing to do
        log.debug("withdrawal of %s on %s not sent: %s: %s", rid, subject, type(e).__name__, e)


def is_resend(msg) -> bool:
    """Whether a received request says it re-sends one that timed out at its requester."""
    return (msg.headers or {}).get(RESEND_HEADER) == "1"


def wait_and_id(msg) -> tuple[float | None, str]:
    """(seconds its requester waits, or None; the id its header claims, or "") of a received request.
    Headers that are missing or do not parse, or a wait that is not a finite number in (0, a day],
    count as absent (an older requester), never as an error."""
    headers = msg.headers or {}
    try:
        wait = float(headers.get(TIMEOUT_HEADER, "nan"))
    except ValueError:
        wait = math.nan
    ok = math.isfinite(wait) and 0.0 < wait <= MAX_WAIT_S
    return (wait if ok else None), str(headers.get(ID_HEADER, ""))[:128]


def send_id(msg) -> str:
    """The send id of a received request, "" for a requester that sends none (it cannot withdraw)."""
    return str((msg.headers or {}).get(SEND_HEADER, ""))[:64]


def withdrawal(msg) -> tuple[str, str]:
    """(request id, send id) a received withdrawal names; "" for a header that is missing."""
    headers = msg.headers or {}
    return str(headers.get(ID_HEADER, ""))[:128], str(headers.get(SEND_HEADER, ""))[:64]
