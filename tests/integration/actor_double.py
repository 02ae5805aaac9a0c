"""A stand-in for `parley actor` whose engine is a test double: it takes tasks from the run's shared
TASKS consumer (the real PullWorker), "plays" each for PLAY_S seconds (the engine double's
generation time), acks it, and sends actor heartbeats, so `parley up`'s actor pool can scale it like
an actor. Run as `python -m tests.integration.actor_double NATS_URL RUN ID PLAY_S`; stops on SIGTERM."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

from parley.protocol import status, topology
from parley.protocol.bus import PullWorker
from parley.protocol.messages import Heartbeat

BUS = topology.BusSettings(max_bytes=16 * 1024**2, ack_wait_s=30.0)


async def main(stop: asyncio.Event, url: str, run: str, ident: str, play_s: float) -> int:
    from parley.protocol.connect import connect

    nc = await connect(url, name=f"parley-{ident}")
    js = nc.jetstream()
    counters: Counter[str] = Counter()
    held = 0

    async def play(task, msg):
        nonlocal held
        held += 1
        try:
            await asyncio.sleep(play_s)  # the engine double "generates"
        finally:
            held -= 1
        await msg.ack()
        counters["tasks"] += 1

    def beat() -> Heartbeat:
        return Heartbeat(
            role="actor",
            id=ident,
            state="busy" if held else "ready",
            counters={"tasks": float(counters["tasks"]), "in_flight": float(held)},
        )

    beats = asyncio.create_task(status.heartbeat_loop(nc, run, beat, stop, every=0.5))
    await PullWorker(js, run, "tasks", play, bus=BUS, name=ident, fetch_timeout=0.5).run_until(stop)
    await beats
    await nc.drain()
    return 0


if __name__ == "__main__":
    from parley.runtime.process import run_async

    url, run, ident, play_s = sys.argv[1:5]
    sys.exit(run_async(main, url, run, ident, float(play_s)))
