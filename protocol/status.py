"""Role heartbeats on core NATS (not stored): what the live view, `parley up` and the eval fleet read.

Every role runs `heartbeat_loop` beside its work; `state()` returns the current Heartbeat fields.
Each heartbeat sent is also handed to OBSERVERS (runtime.metrics: the process's Prometheus metrics).
A reader keeps each role's latest heartbeat with `keep_latest`; `ready_since` says which said ready when.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from parley.protocol import codec, topology
from parley.protocol.messages import Heartbeat

log = logging.getLogger(__name__)

READY_STATES = ("ready", "busy")  # a role whose heartbeat says one of these has started and works

# Called with (run, heartbeat) for every heartbeat this process sends; runtime.metrics.serve adds its own.
OBSERVERS: list[Callable[[str, Heartbeat], None]] = []


async def send(nc, run: str, hb: Heartbeat) -> None:
    hb.created = time.time()
    for observe in OBSERVERS:
        observe(run, hb)
    with contextlib.suppress(Exception):  # a heartbeat lost during a reconnect is harmless
        await nc.publish(topology.status_subject(run, hb.role, hb.id), codec.encode(hb))


async def heartbeat_loop(nc, run: str, state: Callable[[], Heartbeat], stop: asyncio.Event, every: float = 2.0) -> None:
    while not stop.is_set():
        await send(nc, run, state())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every)


async def keep_latest(nc, run: str, into: dict[str, Heartbeat]):
    """Subscribe to `run`'s heartbeats, keeping the latest of each role in `into` under "<role>/<id>"
    (one that does not decode is skipped); returns the subscription (unsubscribe it when done)."""

    async def on_status(msg) -> None:
        with contextlib.suppress(Exception):
            hb = codec.decode("status", msg.data)
            into[f"{hb.role}/{hb.id}"] = hb

    return await nc.subscribe(topology.status_subject(run, "*", "*"), cb=on_status)


def ready_since(heartbeats) -> dict[str, float]:
    """Role id -> when its latest heartbeat was sent, for those whose latest says ready or busy (what a
    supervisor's `check` takes as `ready`, once the ids are its children's names)."""
    return {hb.id: hb.created for hb in heartbeats if hb.state in READY_STATES}
