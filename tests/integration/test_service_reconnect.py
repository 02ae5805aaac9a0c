"""A service request that spans a nats-server restart, under the per-role users (deploy/permissions.py).

A service answers through the permission nats-server grants it when it delivers a request
(allow_responses): a restarted server has no record of requests the old one delivered, and refuses the
answers to them. A requester that sent before the restart would then wait out its whole timeout (a
simulator or judge call: minutes) for an answer that was computed. `protocol.request.request` sends
again, as a re-send, when its connection comes back while it waits: the re-send joins the computation
under way (or gets its remembered answer) and is answered through the new server's permission.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from parley.config.run import load_config
from parley.deploy.credentials import generate_credentials, server_auth_conf
from parley.deploy.natsserver import NatsServer
from parley.deploy.permissions import response_window_s
from parley.engines.service import Service
from parley.protocol import topology
from parley.protocol.connect import connect
from parley.protocol.request import request
from tests.factories import EngineDouble
from tests.integration.test_service_withdraw import until

pytestmark = pytest.mark.integration
RUN = "reconnect"


async def test_a_request_sent_before_a_server_restart_is_answered_after_it_without_waiting_its_timeout(
    tmp_path, caplog
):
    caplog.set_level(logging.INFO)
    window = response_window_s(load_config(None, []))
    creds = generate_credentials(RUN, tmp_path / "auth", response_window=window)
    server = NatsServer(tmp_path / "nats", port=0, extra_conf=server_auth_conf(creds, response_window=window))
    server.start()
    try:
        svc_nc = await connect(server.url, name="sim", user=creds["sim"][0], password=creds["sim"][1])
        actor = await connect(server.url, name="actor", user=creds["actor"][0], password=creds["actor"][1])
        engine = EngineDouble()
        service = Service(svc_nc, {topology.SIM_SUBJECT: engine.handle}, queue="reconnect-test", concurrency=2)
        await service.start()
        try:
            asking = asyncio.create_task(request(actor, topology.SIM_SUBJECT, b"q", timeout=40))
            await until(lambda: engine.started == [b"q"])
            server.restart()  # the computation is under way; the server that delivered it is gone
            await until(lambda: actor.is_connected and svc_nc.is_connected, timeout=20)
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            engine.release.set()  # the answer to the request the old server delivered
            reply = await asyncio.wait_for(asking, timeout=15)  # not the 40 s timeout
            assert reply.data == b"answer to q" and time.monotonic() - t0 < 15
            # the re-send joined the computation under way, or (if it came after it) got its remembered
            # answer: computed once either way
            assert engine.started == [b"q"], engine.started
            assert service.counters["joined"] + service.counters["repeated"] == 1, dict(service.counters)
        finally:
            engine.release.set()
            await service.stop(grace_s=2)
            await svc_nc.close()
            await actor.close()
    finally:
        server.stop()
