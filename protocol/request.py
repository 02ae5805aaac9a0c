"""Request/reply with the shared services (user simulator, judge, reference): each request carries
how long its requester waits and an id in its headers.

Requesters (rollout.sim.SimClient, rollout.judge.JudgeClient, the eval) send through `request()`;
the service scaffolding (engines/service.py) reads `wait_and_id()` to drop work whose requester
has stopped waiting, and to let a re-sent request join the computation already under way.
"""

from __future__ import annotations

import hashlib
import math

TIMEOUT_HEADER = "Parley-Timeout"  # seconds the requester waits for the reply, counted from when it sends
ID_HEADER = "Parley-Request-Id"  # equal for a request and its re-sends
# on a request sent again because the previous send of the same payload timed out at the requester:
# an answer the service delivered to that send after the requester had stopped waiting is this one's
RESEND_HEADER = "Parley-Resend"

# The wait is a duration, not a time of day: the service counts it on its own clock from the moment
# the request reaches it, so two hosts whose clocks disagree (by any amount) drop nothing that is
# still awaited. The requester's share of the wait spent in transit is not counted, which can only
# make the service keep a request a little longer than its requester waits: never shorter.
MAX_WAIT_S = 86400.0  # a header beyond a day is a bad value, not a wait


def request_id(subject: str, data: bytes) -> str:
    """The id of a request: a digest of its subject and payload. A re-sent request (a retry after a
    timeout, a redelivered task or trajectory asking the same question with the same seed) has the
    same id without the caller keeping any state, and asks for the same answer. The service derives
    it again from what it received, so an id names a payload and nothing else."""
    return hashlib.blake2b(subject.encode() + b"\0" + data, digest_size=16).hexdigest()


async def request(nc, subject: str, data: bytes, *, timeout: float, resend: bool = False):
    """nc.request with the wait (the timeout) and the id in the headers; `resend`: this payload's
    previous send timed out here (the service may answer with what it computed for that one)."""
    headers = {TIMEOUT_HEADER: f"{timeout:.3f}", ID_HEADER: request_id(subject, data)}
    if resend:
        headers[RESEND_HEADER] = "1"
    return await nc.request(subject, data, timeout=timeout, headers=headers)


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
