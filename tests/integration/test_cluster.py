"""A 3-node NATS cluster on loopback with R3 streams: SIGKILL the stream leader mid-run, lose nothing.

Trajectories go in through bus.publish while a PullWorker consumes them; one node dies half way.
Every traj_id must be handled at least once and the stream must hold exactly N messages (Msg-Id
dedupe absorbs the publishes retried across the failover).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from nats.js.errors import APIError

from parley.deploy.natsserver import NatsServer, free_port
from parley.protocol import examples, topology
from parley.protocol.bus import PullWorker, publish
from parley.protocol.connect import connect

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(150)]
RUN = "cluster"
N = 300
R3 = topology.BusSettings(replicas=3, ack_wait_s=3.0, max_deliver=10)


@pytest.fixture
def cluster(tmp_path):
    ports = [free_port() for _ in range(3)]
    routes = [f"nats-route://127.0.0.1:{p}" for p in ports]
    nodes = [
        NatsServer(tmp_path / f"n{i}", server_name=f"n{i}", cluster_name="parley-test", cluster_port=p, routes=routes)
        for i, p in enumerate(ports, 1)
    ]
    for node in nodes:
        node.start()
    yield nodes
    for node in nodes:
        node.stop()


async def _until_ready(js, deadline: float) -> None:
    # The JetStream meta group needs a leader (a few seconds after start) before streams can be made.
    while True:
        try:
            await topology.ensure_topology(js, RUN, R3)
            return
        except (TimeoutError, APIError, topology.TopologyError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def test_r3_streams_survive_killing_the_leader(cluster):
    url = ",".join(node.url for node in cluster)
    nc = await connect(url, name="cluster-test", first_timeout=10)
    js = nc.jetstream(timeout=5)
    await _until_ready(js, deadline=time.monotonic() + 40)
    info = await js.stream_info(topology.stream_name(RUN, "traj"))
    assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2

    handled: set[str] = set()
    deliveries = 0
    done = asyncio.Event()

    async def handler(traj, msg):
        nonlocal deliveries
        deliveries += 1
        handled.add(traj.traj_id)
        await msg.ack()
        if len(handled) == N:
            done.set()

    worker = PullWorker(js, RUN, "traj", handler, bus=R3, name="cluster-scorer", concurrency=8, fetch_timeout=1.0)
    consuming = asyncio.create_task(worker.run_until(done))
    killed = None
    for i in range(N):
        if i == N // 2:
            # Kill the node that leads the TRAJ stream, as a crash would, while work is in flight.
            leader = (await js.stream_info(topology.stream_name(RUN, "traj"))).cluster.leader
            killed = next(node for node in cluster if node.server_name == leader)
            killed.kill()
        await publish(js, RUN, "traj", examples.trajectory(RUN, task_id=f"t{i:04d}"))
    await asyncio.wait_for(done.wait(), timeout=60)
    await consuming

    assert handled == {f"t{i:04d}/0" for i in range(N)}
    assert deliveries >= N
    state = (await js.stream_info(topology.stream_name(RUN, "traj"))).state
    assert state.messages == N
    assert (await js.stream_info(topology.stream_name(RUN, "traj"))).cluster.leader != killed.server_name
    with contextlib.suppress(Exception):
        await nc.close()
