"""protocol.bus.PullWorker keeps at most `concurrency` handlers once the messages a fetch brought beyond
its slots are done. nats.py's fetch returns its subscription's whole pending queue: what an earlier
fetch's request delivered after that fetch gave up waiting (a client slow to read its socket) comes
back with the next fetch, more messages than it asked for. Before the fix each of their handlers gave
back a slot it had never taken, and the worker's concurrency grew by them for good."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from parley.protocol import codec, examples, topology
from parley.protocol.bus import PullWorker

RUN = "utest"


def message(seq: int):
    """Test double of a nats Msg: a real encoded trajectory, its stream sequence and an ack."""

    async def ack():
        return None

    return SimpleNamespace(
        data=codec.encode(examples.trajectory(RUN, task_id=f"t-{seq:02d}")),
        headers=None,
        metadata=SimpleNamespace(stream="TRAJ", sequence=SimpleNamespace(stream=seq), num_delivered=1),
        ack=ack,
    )


class LateDeliverySubDouble:
    """Test double of a pull subscription: the first fetch hands back two more messages than it was
    asked for (an earlier request's late deliveries), later fetches what they ask for, then nothing."""

    def __init__(self, total: int):
        self.next, self.total, self.first = 1, total, True
        self.asked: list[int] = []

    async def fetch(self, batch, timeout):
        self.asked.append(batch)
        n = batch + 2 if self.first else batch
        self.first = False
        msgs = [message(s) for s in range(self.next, min(self.total + 1, self.next + n))]
        self.next += len(msgs)
        if not msgs:
            await asyncio.sleep(timeout)
            raise TimeoutError
        return msgs

    async def unsubscribe(self):
        return None


async def test_handlers_on_messages_beyond_the_fetched_slots_give_no_slot_back():
    sub = LateDeliverySubDouble(total=12)

    async def bind(durable, stream):
        return sub

    js = SimpleNamespace(pull_subscribe_bind=bind)
    running, most, done = 0, 0, []
    release = asyncio.Event()

    async def handler(traj, delivery):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        done.append(traj.task_id)

    bus = topology.BusSettings(fetch_max_bytes=1 << 30)
    worker = PullWorker(js, RUN, "traj", handler, bus=bus, name="slots", concurrency=4, fetch_timeout=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run_until(stop))
    await asyncio.sleep(0.2)
    assert running == 6 and sub.asked == [4]  # 4 asked, 6 came: every one handled, none fetched more
    release.set()
    deadline = asyncio.get_running_loop().time() + 5
    while len(done) < 12 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert len(done) == 12
    # after the first fetch's extra two, the worker is back at 4 slots (before the fix: 6)
    assert worker._slots._value == 4 and worker._unslotted == 0
    assert max(sub.asked[1:]) <= 4, sub.asked
