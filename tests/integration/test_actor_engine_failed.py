"""An actor whose engine hangs stops, and its task is played by another: the real Actor.run_until on the
real TASKS consumer of a real nats-server, with test-double policy engines. The first actor's engine takes
the task's request and never answers; its watch (PolicyEngine.watch's verdict, played by the double)
fails, the actor stops with EngineFailed instead of holding the task until its group times out, and the
task, never acked, is delivered to a second actor, whose trajectory is stored. Nothing is dead-lettered."""

from __future__ import annotations

import asyncio

import pytest

from parley.actors.actor import Actor
from parley.config.run import RunConfig
from parley.engines.engine import EngineFailed
from parley.protocol import codec, topology
from parley.protocol.bus import publish
from parley.protocol.connect import barrier
from parley.protocol.messages import ChatMessage, SimReply, Task
from tests.integration.test_actor_sim_outage import PolicyDouble

pytestmark = [pytest.mark.integration]

RUN = "hung"
BUS = topology.BusSettings(max_bytes=16 * 1024**2, ack_wait_s=1.0, max_deliver=3)


async def stream_messages(js, key: str) -> int:
    return (await js.stream_info(topology.stream_name(RUN, key))).state.messages


class HungPolicyDouble(PolicyDouble):
    """A policy engine whose requests never return (a hung engine core); its watch fails once one has
    waited `stall_s`, as PolicyEngine.watch does past [actor.engine] stall_timeout_s."""

    stall_s = 0.5

    def __init__(self, tok):
        super().__init__(tok, ["never said"])
        self.waiting = asyncio.Event()

    async def generate(self, *args, **kwargs):
        self.waiting.set()
        await asyncio.Event().wait()

    async def watch(self, stop: asyncio.Event) -> None:
        await self.waiting.wait()
        await asyncio.sleep(self.stall_s)
        raise EngineFailed(f"the engine of {self.settings.model} held 1 requests for {self.stall_s} s without a step")


async def test_an_actor_whose_engine_hangs_stops_and_its_task_is_played_by_another(js, nc, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = RunConfig(bus=BUS)
    cfg.run.name = RUN
    await topology.ensure_topology(js, RUN, BUS)

    async def answer(msg):
        await msg.respond(codec.encode(SimReply(message="Thanks!", done=True)))

    sim = await nc.subscribe(topology.SIM_SUBJECT, cb=answer)
    await barrier(nc)
    task = Task(task_id=f"{RUN}-g000000", run=RUN, item_id="i", n=1, prefix=[ChatMessage("user", "A toast, please.")])
    await publish(js, RUN, "tasks", task)

    hung = Actor(nc, js, cfg, HungPolicyDouble(tok), tok, ident="actor-hung", weights_dir=tmp_path / "a")
    with pytest.raises(EngineFailed, match="without a step"):
        await asyncio.wait_for(hung.run_until(asyncio.Event()), timeout=20)
    assert hung.counters["tasks"] == 0 and await stream_messages(js, "traj") == 0

    good = Actor(
        nc, js, cfg, PolicyDouble(tok, ["Happy to help."]), tok, ident="actor-good", weights_dir=tmp_path / "b"
    )
    stop = asyncio.Event()
    runner = asyncio.create_task(good.run_until(stop))
    try:
        for _ in range(200):
            if await stream_messages(js, "traj") >= 1:
                break
            assert not runner.done(), runner
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(runner, timeout=20)
        await sim.unsubscribe()
    assert good.counters["tasks"] == 1 and await stream_messages(js, "traj") == 1
    assert await stream_messages(js, "dead") == 0
