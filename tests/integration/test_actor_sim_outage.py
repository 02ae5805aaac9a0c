"""The actor waits out a simulator outage: the real Actor handler on the real TASKS consumer of a
real nats-server, with a test-double policy engine. Nobody serves the simulator subject for longer
than max_deliver x ack_wait_s; then a simulator comes up. The task is delivered once, kept alive
meanwhile, and its trajectory stored; nothing is dead-lettered."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from parley.actors.actor import Actor
from parley.config.run import RunConfig
from parley.protocol import codec, topology
from parley.protocol.bus import PullWorker, publish
from parley.protocol.connect import barrier
from parley.protocol.messages import ChatMessage, SimReply, Task
from tests.unit.test_rollout import EngineDouble

pytestmark = [pytest.mark.integration]

RUN = "outage"
BUS = topology.BusSettings(max_bytes=16 * 1024**2, ack_wait_s=1.0, max_deliver=2)


class PolicyDouble(EngineDouble):
    """EngineDouble plus what the Actor reads of a policy engine besides generate()."""

    version = 0
    settings = types.SimpleNamespace(model="tiny-double")


async def stream_messages(js, key: str) -> int:
    return (await js.stream_info(topology.stream_name(RUN, key))).state.messages


async def test_actor_waits_out_a_simulator_outage_without_spending_deliveries(js, nc, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = RunConfig(bus=BUS)
    cfg.run.name = RUN
    cfg.actor.sim_timeout_s, cfg.actor.sim_wait_s = 0.5, 120.0
    await topology.ensure_topology(js, RUN, BUS)
    actor = Actor(nc, js, cfg, PolicyDouble(tok, ["Happy to help."]), tok, ident="actor-t", weights_dir=tmp_path)
    deliveries = []

    async def handle(task, msg):
        deliveries.append(msg.metadata.num_delivered)
        await actor.handle(task, msg)

    task = Task(task_id=f"{RUN}-g000000", run=RUN, item_id="i", n=1, prefix=[ChatMessage("user", "A toast, please.")])
    await publish(js, RUN, "tasks", task)
    stop = asyncio.Event()
    worker = asyncio.create_task(
        PullWorker(js, RUN, "tasks", handle, bus=BUS, name="actor-t", fetch_timeout=0.5).run_until(stop)
    )
    try:
        # The outage: no responder, for longer than the deliveries the task has (2 x 1 s ack_wait).
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4 * BUS.max_deliver * BUS.ack_wait_s or actor.sim.waits < 3:
            assert not worker.done()
            await asyncio.sleep(0.2)

        async def answer(msg):
            await msg.respond(codec.encode(SimReply(message="Thanks!", done=True)))

        sim = await nc.subscribe(topology.SIM_SUBJECT, cb=answer)
        await barrier(nc)
        while await stream_messages(js, "traj") < 1:
            assert not worker.done()
            await asyncio.sleep(0.2)
        await sim.unsubscribe()
    finally:
        stop.set()
        await asyncio.gather(worker, return_exceptions=True)

    assert deliveries == [1]  # before sim_wait_s: nak'ed after 4 requests and delivered again, then dead
    assert await stream_messages(js, "dead") == 0
    assert actor.counters["tasks"] == 1 and actor.sim.waits >= 3
    info = await js.consumer_info(topology.stream_name(RUN, "tasks"), "actor")
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
