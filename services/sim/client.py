"""The user side of a conversation as the conversation loop asks it (`await ask(SimRequest) -> SimReply`):
`SimClient`, the simulator service over NATS request/reply (the service is services/sim/server.py), and
`LocalSim`, a simulator in this process (the eval's small runs). Used by rollout.conversation's
callers: the actor, the eval and the benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import msgspec
import nats.errors

from parley.protocol import codec, topology
from parley.protocol.bus import Poison, Retry
from parley.protocol.messages import SimReply, SimRequest
from parley.protocol.request import request

log = logging.getLogger(__name__)

# What the user "says" when the simulator failed: neutral, so the policy is neither helped nor
# misled; the actor records its position in Trajectory.sim_fallbacks.
FALLBACK_MESSAGE = "Please continue."


class UserSide(Protocol):
    """Who writes the user turns: SimClient, LocalSim, environments.base.LocalUser."""

    async def ask(self, req: SimRequest) -> SimReply: ...


class SimUnreachable(Poison):
    """The simulator service stayed unreachable for the whole of sim_wait_s: the task is given up
    (dead-lettered with this reason, so the learner frees its admission slot at once)."""


class SimClient:
    """Asks the simulator service for the next user message.

    An unreachable service (timeout, no responder, reconnecting) is not the task's fault: the
    conversation waits here, asking again with back-off, for up to `wait_s` seconds; the actor
    meanwhile keeps the task alive (in_progress), so an outage does not spend its deliveries and
    nothing already generated is replayed. After `wait_s` it gives up with SimUnreachable. A reply
    that does not decode is the service's bug, not an outage: after `attempts` of them the task is
    handed back (bus.Retry) rather than continued with an invented user message.
    """

    def __init__(
        self,
        nc,
        *,
        timeout_s: float,
        wait_s: float,
        attempts: int = 4,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ):
        self.nc, self.timeout_s, self.wait_s, self.attempts = nc, timeout_s, wait_s, attempts
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.waits = 0  # requests that found the service unreachable (shown in the actor's heartbeat)

    async def ask(self, req: SimRequest) -> SimReply:
        data = codec.encode(req)
        t0 = time.monotonic()
        delay, bad_replies, outages = self.backoff_s, 0, 0
        timed_out = False  # the last send timed out: the next one says it re-sends (protocol.request)
        while True:
            try:
                # a re-send joins the computation under way, or gets the answer that came too late
                msg = await request(self.nc, topology.SIM_SUBJECT, data, timeout=self.timeout_s, resend=timed_out)
                return codec.decode("sim.reply", msg.data)
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.errors.ConnectionReconnectingError,
            ) as e:
                timed_out = timed_out or isinstance(e, nats.errors.TimeoutError)
                last = (
                    f"{type(e).__name__} after {self.timeout_s:.0f}s"
                    if isinstance(e, nats.errors.TimeoutError)
                    else type(e).__name__
                )
                outages += 1
                self.waits += 1
                waited = time.monotonic() - t0
                if waited + delay > self.wait_s:
                    raise SimUnreachable(
                        f"user simulator unreachable on {topology.SIM_SUBJECT} for {waited:.0f}s "
                        f"(sim_wait_s={self.wait_s:g}, {outages} requests): {last}"
                    ) from None
                if outages == 1 or outages % 10 == 0:
                    log.warning(
                        "user simulator unreachable (%s); waiting for it, %.0fs so far (sim_wait_s=%g)",
                        last,
                        waited,
                        self.wait_s,
                    )
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                timed_out = False  # asked again after an answer: afresh
                bad_replies += 1
                last = f"undecodable reply: {e}"
                if bad_replies >= self.attempts:
                    raise Retry(
                        f"user simulator on {topology.SIM_SUBJECT} sent {bad_replies} undecodable replies: {last}",
                        delay=10.0,
                    ) from None
                log.warning(
                    "user simulator request failed (%s); retry %d/%d in %.0fs",
                    last,
                    bad_replies,
                    self.attempts - 1,
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)


class LocalSim:
    """The user simulator in this process (an services.sim.server.Simulator, or anything with its
    `reply(SimRequest)`), for small runs without NATS."""

    def __init__(self, simulator):
        self.simulator = simulator

    async def ask(self, req: SimRequest) -> SimReply:
        return await self.simulator.reply(req)
