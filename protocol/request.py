"""Request/reply with the shared services (user simulator, judge): each request carries its deadline
and an id in its headers.

Requesters (rollout.sim.SimClient, rollout.judge.JudgeClient, the eval) send through `request()`;
the service scaffolding (engines/service.py) reads `deadline_and_id()` to drop work whose requester
has stopped waiting, and to let a re-sent request join the computation already under way.
"""

from __future__ import annotations

import hashlib
import math
import time

DEADLINE_HEADER = "Parley-Deadline"  # unix seconds after which the requester no longer waits for the reply
ID_HEADER = "Parley-Request-Id"  # equal for a request and its re-sends

# The deadline is a wall-clock time, so a service on another host trusts the two clocks to agree
# (NTP keeps them within milliseconds); deploy/auth.py's response window leaves room for more.


def request_id(subject: str, data: bytes) -> str:
    """The id of a request: a digest of its subject and payload. A re-sent request (a retry after a
    timeout, a redelivered task or trajectory asking the same question with the same seed) has the
    same id without the caller keeping any state, and asks for the same answer."""
    return hashlib.blake2b(subject.encode() + b"\0" + data, digest_size=16).hexdigest()


async def request(nc, subject: str, data: bytes, *, timeout: float):
    """nc.request with the deadline (now + timeout) and the id in the headers."""
    headers = {DEADLINE_HEADER: f"{time.time() + timeout:.3f}", ID_HEADER: request_id(subject, data)}
    return await nc.request(subject, data, timeout=timeout, headers=headers)


def deadline_and_id(msg) -> tuple[float | None, str]:
    """(deadline in unix seconds or None, id or "") of a received request; headers that are missing
    or do not parse count as absent (an older requester), never as an error."""
    headers = msg.headers or {}
    try:
        deadline = float(headers.get(DEADLINE_HEADER, "nan"))
    except ValueError:
        deadline = math.nan
    return (deadline if math.isfinite(deadline) else None), str(headers.get(ID_HEADER, ""))[:128]
