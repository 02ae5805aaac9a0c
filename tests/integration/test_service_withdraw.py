"""Withdrawn requests against a real nats-server with the per-role users (deploy/permissions.py).

A requester that is cancelled while it waits (rollout.conversation's StaleWatch cutting a simulator
call) withdraws its request (protocol/request.py), and the Service (engines/service.py) stops
computing what nobody reads: the handler of a request being computed is cancelled, a queued one is
never computed, and a computation that a second requester (same payload, same id) joined goes on and
answers it. The engine is a test double that records how each call ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from parley.config.run import load_config
from parley.deploy.credentials import generate_credentials, server_auth_conf
from parley.deploy.natsserver import NatsServer
from parley.deploy.permissions import response_window_s
from parley.engines.service import Service
from parley.protocol import codec, topology
from parley.protocol.connect import connect
from parley.protocol.messages import JudgeReply, SimReply, SimRequest
from parley.protocol.request import request
from parley.services.judge.client import JudgeClient
from parley.services.sim.client import SimClient
from tests.factories import EngineDouble

pytestmark = pytest.mark.integration
RUN = "withdraw"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("withdraw")
    window = response_window_s(load_config(None, []))
    creds = generate_credentials(RUN, d / "auth", response_window=window)
    server = NatsServer(d / "nats", port=0, extra_conf=server_auth_conf(creds, response_window=window))
    server.start()
    yield server, creds
    server.stop()


async def until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def serving(
    secured,
    engine: EngineDouble,
    *,
    subject: str = topology.SIM_SUBJECT,
    service_role: str = "sim",
    requester_role: str = "actor",
    concurrency: int = 4,
):
    """A Service on `subject` over `engine` as `service_role`, and a `requester_role` connection."""
    server, creds = secured
    svc_nc = await connect(server.url, name=service_role, user=creds[service_role][0], password=creds[service_role][1])
    req_nc = await connect(
        server.url, name=requester_role, user=creds[requester_role][0], password=creds[requester_role][1]
    )
    service = Service(svc_nc, {subject: engine.handle}, queue="withdraw-test", concurrency=concurrency)
    await service.start()
    try:
        yield service, req_nc
    finally:
        engine.release.set()
        await service.stop(grace_s=2)
        await svc_nc.close()
        await req_nc.close()


def violations(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage().lower()]


async def test_an_actor_cancelled_mid_request_stops_the_simulator_computation(secured, caplog):
    """The actor's SimClient.ask cancelled while the simulator computes its answer (what StaleWatch
    does to a stale group's simulator call): the handler is cancelled, no answer is computed."""
    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    engine = EngineDouble(reply=lambda data: codec.encode(SimReply(message="never read")))
    async with serving(secured, engine) as (service, actor):
        sim = SimClient(actor, timeout_s=60, wait_s=600)
        asking = asyncio.create_task(sim.ask(SimRequest(prompt="lazy_full", messages=[], seed=1)))
        await until(lambda: engine.started)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        await until(lambda: "cancelled" in engine.ended.values(), timeout=5)  # long before the requester's 60 s wait
        assert "done" not in engine.ended.values()
        assert service.counters["withdrawn"] == 1 and service.counters["cancelled"] == 1
        assert service.counters["served"] == 0 and service.in_flight == 0
    assert violations(caplog) == []


async def test_a_queued_request_withdrawn_is_never_computed(secured, caplog):
    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    engine = EngineDouble()
    async with serving(secured, engine, concurrency=1) as (service, actor):
        first = asyncio.create_task(request(actor, topology.SIM_SUBJECT, b"first", timeout=60))
        await until(lambda: engine.started == [b"first"])
        queued = asyncio.create_task(request(actor, topology.SIM_SUBJECT, b"queued", timeout=60))
        await asyncio.sleep(0.3)  # it reached the service and waits for the one slot
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await until(lambda: service.counters["withdrawn"] == 1)
        engine.release.set()
        assert (await first).data == b"answer to first"
        await asyncio.sleep(0.3)  # the dispatcher has passed the withdrawn one by
        assert engine.started == [b"first"] and "cancelled" not in engine.ended.values()
        assert service.counters["cancelled"] == 0 and service.counters["served"] == 1
    assert violations(caplog) == []


async def test_a_computation_shared_with_a_second_requester_goes_on_and_answers_it(secured):
    engine = EngineDouble()
    async with serving(secured, engine) as (service, actor):
        leaving = asyncio.create_task(request(actor, topology.SIM_SUBJECT, b"q", timeout=60))
        await until(lambda: engine.started)
        staying = asyncio.create_task(request(actor, topology.SIM_SUBJECT, b"q", timeout=60))  # same id: joins
        await until(lambda: service.counters["joined"] == 1)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await until(lambda: service.counters["withdrawn"] == 1)
        await asyncio.sleep(0.2)
        assert "cancelled" not in engine.ended.values()  # still computing, for the second
        engine.release.set()
        assert (await staying).data == b"answer to q"
        assert engine.started == [b"q"] and engine.ended == {b"q": "done"} and service.counters["cancelled"] == 0


@pytest.mark.parametrize(
    ("requester", "service_role", "subject"),
    [
        ("scorer", "judge", topology.judge_subject("extract")),
        ("eval", "services", topology.judge_subject("interactivity")),
        ("eval", "sim", topology.SIM_SUBJECT),
        ("scorer", "reference", topology.reference_subject("tiny")),
    ],
)
async def test_every_requester_may_withdraw_and_every_service_hears_it(
    secured, caplog, requester, service_role, subject
):
    """The permissions of every requesting role and every service role carry the withdrawals."""
    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    engine = EngineDouble(reply=lambda data: codec.encode(JudgeReply(ok=True)))
    async with serving(secured, engine, subject=subject, service_role=service_role, requester_role=requester) as (
        service,
        nc,
    ):
        if service_role == "judge":  # the scorer's own client
            asking = asyncio.create_task(JudgeClient(nc, timeout=60).ask("extract", []))
        else:
            asking = asyncio.create_task(request(nc, subject, b"q", timeout=60))
        await until(lambda: engine.started)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        await until(lambda: "cancelled" in engine.ended.values())
        assert service.counters["cancelled"] == 1
    assert violations(caplog) == []
