"""Role heartbeats on core NATS (not stored): what the live view and `parley up` read.

Every role runs `heartbeat_loop` beside its work; `state()` returns the current Heartbeat fields.
Each heartbeat sent is also handed to OBSERVERS (runtime.metrics: the process's Prometheus metrics).
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
