"""The request/reply services under overload, against a real nats-server with the per-role users.

A Service (engines/service.py) with a slow test-double backend is driven by the actor's real
SimClient at about 3x what the backend can answer within the requests' timeout. Requests that
expire while queued are dropped, re-sent requests join the computation under way or get its
answer: every request is answered at most once, nothing is computed twice, no reply is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

import nats.errors
import pytest

from parley.config.run import load_config
from parley.deploy.credentials import generate_credentials, server_auth_conf
from parley.deploy.natsserver import NatsServer
from parley.deploy.permissions import response_window_s
from parley.engines.service import Service
from parley.protocol import codec, topology
from parley.protocol.bus import Retry
from parley.protocol.connect import barrier, connect, inbox_prefix
from parley.protocol.messages import SimReply, SimRequest
from parley.services.sim.client import SimClient, SimUnreachable

pytestmark = pytest.mark.integration
RUN = "overload"
TIMEOUT_S = 1.0  # what a requester waits for one answer
WORK_S = 0.25  # what the backend takes for one
SLOTS = 2  # at once: 8 answers/s, so 8 per timeout
OFFERED = 3 * SLOTS / WORK_S  # requests per second
DISTINCT = 60  # requests (each then re-sent by the client while unanswered)


@pytest.fixture
def secured(tmp_path):
    cfg = load_config(None, [f"actor.sim_timeout_s={TIMEOUT_S}", f"scorer.judge_timeout_s={TIMEOUT_S}"])
    creds = generate_credentials(RUN, tmp_path / "auth", response_window=response_window_s(cfg))
    server = NatsServer(
        tmp_path / "nats", port=0, extra_conf=server_auth_conf(creds, response_window=response_window_s(cfg))
    )
    server.start()
    yield server, creds
    server.stop()


async def test_services_at_three_times_their_capacity_never_compute_twice(secured, caplog):
    server, creds = secured
    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    conns = {
        role: await connect(server.url, name=role, user=creds[role][0], password=creds[role][1])
        for role in ("sim", "actor", "admin")
    }
    computed: Counter[int] = Counter()

    async def slow_backend_double(data: bytes) -> bytes:  # test double of an engine that falls behind
        req = codec.decode("sim.request", data)
        computed[req.seed] += 1
        await asyncio.sleep(WORK_S)
        return codec.encode(SimReply(message=f"answer {req.seed}"))

    # Every reply published to the actor's inbox, seen by the admin (who may read everything).
    replies: Counter[str] = Counter()

    async def spy(msg):
        replies[msg.subject] += 1

    await conns["admin"].subscribe(f"{inbox_prefix(creds['actor'][0])}.>", cb=spy)
    await barrier(conns["admin"])
    service = Service(
        conns["sim"],
        {topology.SIM_SUBJECT: slow_backend_double},
        queue=topology.SIM_QUEUE,
        concurrency=SLOTS,
        name="sim-overload",
    )
    await service.start()
    # Requesters give up after about four timed-out requests (sim_wait_s), as before the actor waited outages out.
    client = SimClient(conns["actor"], timeout_s=TIMEOUT_S, wait_s=4 * TIMEOUT_S, attempts=4, backoff_s=0.2)
    try:
        asks = []
        for seed in range(DISTINCT):
            asks.append(asyncio.create_task(client.ask(SimRequest(prompt="lazy_full", messages=[], seed=seed))))
            await asyncio.sleep(1.0 / OFFERED)
        results = await asyncio.gather(*asks, return_exceptions=True)
        await service.stop(grace_s=10)
        await barrier(conns["admin"])
    finally:
        for nc in conns.values():
            await nc.close()

    answered = {seed: r for seed, r in enumerate(results) if isinstance(r, SimReply)}
    given_up = [r for r in results if not isinstance(r, SimReply)]
    assert all(isinstance(r, (Retry, SimUnreachable)) for r in given_up), given_up
    assert all(r.message == f"answer {seed}" for seed, r in answered.items())
    assert computed and max(computed.values()) == 1, f"computed twice: {[s for s, n in computed.items() if n > 1]}"
    assert replies and max(replies.values()) == 1  # each request (reply inbox) answered at most once
    assert [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage().lower()] == []
    # It was overloaded: work was dropped or joined rather than done again.
    c = service.counters
    assert c["expired"] + c["joined"] + c["repeated"] > 0, dict(c)
    print(f"answered {len(answered)}/{DISTINCT}, computed {sum(computed.values())}, counters {dict(c)}")


@contextlib.asynccontextmanager
async def sim_service(secured, backend, *, concurrency: int):
    """A Service on the sim subject over `backend` as the sim user, and an actor connection to ask it."""
    server, creds = secured
    sim = await connect(server.url, name="sim", user=creds["sim"][0], password=creds["sim"][1])
    actor = await connect(server.url, name="actor", user=creds["actor"][0], password=creds["actor"][1])
    service = Service(sim, {topology.SIM_SUBJECT: backend}, queue=topology.SIM_QUEUE, concurrency=concurrency)
    await service.start()
    try:
        yield service, actor
    finally:
        await service.stop()
        await sim.close()
        await actor.close()


async def test_a_resent_request_joins_the_computation_under_way(secured):
    from parley.protocol.request import request

    computed, started = Counter(), asyncio.Event()

    async def slow_backend_double(data: bytes) -> bytes:
        computed[data] += 1
        started.set()
        await asyncio.sleep(0.5)
        return b"the answer to " + data

    async with sim_service(secured, slow_backend_double, concurrency=4) as (service, actor):
        first = asyncio.create_task(request(actor, topology.SIM_SUBJECT, b"q", timeout=5))
        await started.wait()  # the first is being computed: the re-send (same id) must not start another
        second = await request(actor, topology.SIM_SUBJECT, b"q", timeout=5)
        assert (await first).data == second.data == b"the answer to q"
        assert computed == {b"q": 1} and service.counters["joined"] == 1


async def test_an_answer_that_came_after_its_requester_stopped_waiting_goes_to_its_resend(secured):
    """The service counts a request's wait from its arrival, so it can answer in time by its clock
    after the requester, whose wait began at the send, has given up (seen in CI under load: one
    request computed twice). The re-send says so (protocol.request's resend header) and gets that
    answer without a second computation; asking the same again without the header asks afresh."""
    from parley.protocol.request import ID_HEADER, TIMEOUT_HEADER, request, request_id

    computed: list[int] = []

    async def backend_double(data: bytes) -> bytes:  # test double of an engine
        computed.append(1)
        await asyncio.sleep(0.5)
        return codec.encode(SimReply(message=f"answer {len(computed)}"))

    async with sim_service(secured, backend_double, concurrency=2) as (service, actor):
        data = codec.encode(SimRequest(prompt="lazy_full", messages=[], seed=7))
        # the service is told 5 s, the requester waits 0.2 s: its wait ran out before the answer
        headers = {TIMEOUT_HEADER: "5.000", ID_HEADER: request_id(topology.SIM_SUBJECT, data)}
        with pytest.raises(nats.errors.TimeoutError):
            await actor.request(topology.SIM_SUBJECT, data, timeout=0.2, headers=headers)
        await asyncio.sleep(0.8)  # answered by now, delivered to an inbox nobody reads
        again = await request(actor, topology.SIM_SUBJECT, data, timeout=2.0, resend=True)
        assert codec.decode("sim.reply", again.data).message == "answer 1" and len(computed) == 1
        assert service.counters["repeated"] == 1
        fresh = await request(actor, topology.SIM_SUBJECT, data, timeout=2.0)
        assert codec.decode("sim.reply", fresh.data).message == "answer 2" and len(computed) == 2


async def test_a_request_naming_another_requests_id_does_not_get_its_answer(secured):
    """A requester that knows another's request id (it travels in a header) and sends its own payload
    under it is computed on its own payload: the key of joins and kept answers is derived again from
    what the service received."""
    from parley.protocol.request import ID_HEADER, request, request_id

    started = asyncio.Event()

    async def slow_backend_double(data: bytes) -> bytes:
        started.set()
        await asyncio.sleep(0.5)
        return b"the answer to " + data

    async with sim_service(secured, slow_backend_double, concurrency=4) as (service, actor):
        secret = asyncio.create_task(request(actor, topology.SIM_SUBJECT, b"private question", timeout=5))
        await started.wait()  # the victim's request is being computed; the forger joins it by id
        forged = {ID_HEADER: request_id(topology.SIM_SUBJECT, b"private question")}
        reply = await actor.request(topology.SIM_SUBJECT, b"mine", timeout=5, headers=forged)
        assert reply.data == b"the answer to mine"
        assert (await secret).data == b"the answer to private question"
        assert service.counters["id_mismatch"] == 1 and service.counters["joined"] == 0


async def test_a_service_whose_clock_is_ten_minutes_ahead_still_answers(secured, monkeypatch):
    """The requester's wait is a duration the service counts on its own clock from arrival: a service
    host whose wall clock is 10 minutes ahead of the requester's drops nothing (with wall-clock
    deadlines it dropped every request as expired, and each actor's SimUnreachable poisoned its task)."""
    import time as real_time

    import parley.engines.service  # noqa: F401
    from parley import engines  # noqa: F401
    from parley.protocol.request import request

    async def backend_double(data: bytes) -> bytes:
        return b"answered " + data

    class AheadClock:  # the service host's clock: 10 minutes ahead of the requester's
        def __getattr__(self, name):
            return getattr(real_time, name)

        @staticmethod
        def time() -> float:
            return real_time.time() + 600.0

    monkeypatch.setattr(engines.service, "time", AheadClock())
    async with sim_service(secured, backend_double, concurrency=2) as (service, actor):
        replies = [await request(actor, topology.SIM_SUBJECT, f"q{i}".encode(), timeout=2) for i in range(3)]
        assert [r.data for r in replies] == [b"answered q0", b"answered q1", b"answered q2"]
        assert service.counters["expired"] == 0


def test_the_answer_cache_is_bounded_by_bytes(monkeypatch):
    """Kept answers are bounded by their bytes, not only by their count: 1,000 reference replies of a
    32k-token conversation (128 KiB each) keep at most ANSWER_BYTES_KEPT."""
    import parley.engines.service as svc

    service = Service(object(), {}, queue="q")
    reply = bytes(4 * 32768)
    for i in range(1000):
        service._remember(("subject", f"id{i}"), reply, late=True)
    kept = sum(len(r) for _, r, _ in service._answered.values())
    assert kept <= svc.ANSWER_BYTES_KEPT and service._answered_bytes == kept
    assert len(service._answered) == svc.ANSWER_BYTES_KEPT // len(reply)
    assert ("subject", "id999") in service._answered  # the newest are kept
