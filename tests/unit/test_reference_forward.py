"""The reference service computes one forward at a time (services.reference.server.ReferenceModel._lock), and
a forward cannot be stopped once begun: when the request it answers is cancelled (its requester
withdrew it, engines/service.py), the lock must stay held until the forward ends, or the next
request's forward starts beside it on the device (two 4B forwards where the plan has room for one)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from parley.services.reference.server import ReferenceModel


class SlowForwardDouble(ReferenceModel):
    """A ReferenceModel without a model: `logprobs` blocks until released and records how many
    forwards run at once (a test double)."""

    def __init__(self):
        self.model_name, self.chunk, self.vocab_size, self.max_positions = "m", 16, 100, None
        self._lock = asyncio.Lock()
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.running = self.most = 0
        self.count_lock = threading.Lock()

    def logprobs(self, ids: np.ndarray) -> np.ndarray:
        with self.count_lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.started.release()
        self.release.wait(10)
        with self.count_lock:
            self.running -= 1
        return np.zeros(ids.size - 1, dtype=np.float32)


def test_a_cancelled_request_holds_the_device_until_its_forward_ends():
    async def main():
        ref = SlowForwardDouble()
        ids = np.arange(1, 6, dtype=np.int64)
        first = asyncio.create_task(ref.answer("m", 0, ids))
        await asyncio.to_thread(ref.started.acquire)  # the first forward runs
        first.cancel()  # its requester withdrew it
        second = asyncio.create_task(ref.answer("m", 0, ids))
        await asyncio.sleep(0.3)
        assert ref.running == 1 and ref.most == 1, "a second forward started beside the first"
        ref.release.set()  # the first forward ends; only then may the second begin
        reply = await asyncio.wait_for(second, 10)
        assert reply.ok and ref.most == 1
        assert first.cancelled()

    asyncio.run(main())
