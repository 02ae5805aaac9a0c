"""Withdrawn requests, without a network: protocol.request.request() withdraws its send when it is
cancelled, and the Service scaffolding (engines/service.py) drops a withdrawn request still queued,
cancels a computation nobody awaits any more, and goes on with one that a joined re-send still
awaits. The bus and the engine are test doubles; tests/integration/test_service_withdraw.py does the
same over a real nats-server."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

import parley.engines.service as service_module
from parley.engines.service import Service
from parley.protocol import topology
from parley.protocol.request import ID_HEADER, SEND_HEADER, TIMEOUT_HEADER, request, request_id
from tests.factories import EngineDouble

SUBJECT = topology.SIM_SUBJECT
WITHDRAW = topology.withdraw_subject(SUBJECT)


class MsgDouble:
    """Test double of a received nats Msg: what a service reads, and the replies it sends."""

    def __init__(self, subject: str, data: bytes, headers: dict, reply: str = ""):
        self.subject, self.data, self.headers, self.reply = subject, data, headers, reply
        self.replies: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.replies.append(data)


class NatsDouble:
    """Test double of a nats client: records subscriptions and publishes; `request` hangs until
    `answer` is set (or raises `fail`)."""

    def __init__(self):
        self.callbacks: dict[str, object] = {}
        self.published: list[tuple[str, bytes, dict]] = []
        self.requests: list[dict] = []
        self.sent = asyncio.Event()
        self.answer: asyncio.Future | None = None
        self.fail: Exception | None = None
        self.publish_fails: Exception | None = None
        self.pending_data_size, self.is_connected = 0, True

    async def subscribe(self, subject, queue=None, cb=None):
        self.callbacks[subject] = cb

        class SubDouble:
            async def unsubscribe(self):
                pass

        return SubDouble()

    async def flush(self, timeout=None):
        pass

    async def publish(self, subject, data=b"", headers=None):
        if self.publish_fails:
            raise self.publish_fails
        self.published.append((subject, data, dict(headers or {})))

    async def request(self, subject, data, timeout, headers=None):
        self.requests.append(dict(headers or {}))
        self.sent.set()
        if self.fail:
            raise self.fail
        self.answer = asyncio.get_running_loop().create_future()
        return await self.answer

    async def deliver(self, subject: str, msg: MsgDouble) -> None:
        await self.callbacks[subject](msg)


# -- the requester ----------------------------------------------------------------------------------


async def cancelled_mid_request(nc: NatsDouble) -> None:
    task = asyncio.create_task(request(nc, SUBJECT, b"q", timeout=60))
    await nc.sent.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancelled_request_withdraws_its_send_and_stays_cancelled():
    nc = NatsDouble()
    await cancelled_mid_request(nc)
    (sent,) = nc.requests
    assert sent[ID_HEADER] == request_id(SUBJECT, b"q") and sent[SEND_HEADER]
    assert nc.published == [(WITHDRAW, b"", {ID_HEADER: sent[ID_HEADER], SEND_HEADER: sent[SEND_HEADER]})]


async def test_a_withdrawal_that_cannot_be_sent_does_not_hide_the_cancellation():
    nc = NatsDouble()
    nc.publish_fails = nats.errors.ConnectionClosedError()
    await cancelled_mid_request(nc)  # CancelledError, not ConnectionClosedError
    assert nc.published == []


async def test_a_request_answered_or_timed_out_withdraws_nothing_and_each_send_has_its_own_id():
    nc = NatsDouble()
    task = asyncio.create_task(request(nc, SUBJECT, b"q", timeout=60))
    await nc.sent.wait()
    nc.answer.set_result("the reply")
    assert await task == "the reply"
    nc.fail = nats.errors.TimeoutError()
    with pytest.raises(nats.errors.TimeoutError):
        await request(nc, SUBJECT, b"q", timeout=60, resend=True)
    assert nc.published == []
    first, second = nc.requests
    assert first[ID_HEADER] == second[ID_HEADER] and first[SEND_HEADER] != second[SEND_HEADER]


# -- the service ------------------------------------------------------------------------------------


def sent(data: bytes, send: str, wait: float = 60.0) -> MsgDouble:
    """A request as protocol.request.request() sends it."""
    headers = {TIMEOUT_HEADER: f"{wait:.3f}", ID_HEADER: request_id(SUBJECT, data), SEND_HEADER: send}
    return MsgDouble(SUBJECT, data, headers, reply=f"_INBOX.{send}")


def withdrawal(msg: MsgDouble) -> MsgDouble:
    return MsgDouble(WITHDRAW, b"", {ID_HEADER: msg.headers[ID_HEADER], SEND_HEADER: msg.headers[SEND_HEADER]})


async def settle() -> None:
    for _ in range(20):  # let the dispatcher and the handler tasks run
        await asyncio.sleep(0)


@pytest.fixture
async def served():
    nc, engine = NatsDouble(), EngineDouble()
    service = Service(nc, {SUBJECT: engine.handle}, queue="sim", concurrency=1)
    await service.start()
    yield nc, engine, service
    engine.release.set()
    await service.stop(grace_s=1)


async def test_a_withdrawn_request_still_queued_is_never_computed(served):
    nc, engine, service = served
    first, queued = sent(b"first", "s1"), sent(b"queued", "s2")
    await nc.deliver(SUBJECT, first)
    await nc.deliver(SUBJECT, queued)
    await settle()
    assert engine.started == [b"first"]  # one slot: the second waits
    await nc.deliver(WITHDRAW, withdrawal(queued))
    engine.release.set()
    await settle()
    assert engine.started == [b"first"] and first.replies == [b"answer to first"] and queued.replies == []
    assert service.counters["withdrawn"] == 1 and service.counters["cancelled"] == 0
    assert service._sends == {}


async def test_a_computation_whose_only_requester_withdrew_is_cancelled_and_frees_its_slot(served):
    nc, engine, service = served
    cut, after = sent(b"cut", "s1"), sent(b"after", "s2")
    await nc.deliver(SUBJECT, cut)
    await nc.deliver(SUBJECT, after)
    await settle()
    await nc.deliver(WITHDRAW, withdrawal(cut))
    await settle()
    assert engine.ended == {b"cut": "cancelled"} and cut.replies == []
    assert engine.started == [b"cut", b"after"]  # the slot went to the next one
    engine.release.set()
    await settle()
    assert after.replies == [b"answer to after"]
    assert service.counters["withdrawn"] == 1 and service.counters["cancelled"] == 1
    assert service.counters["served"] == 1 and service._joining == {} and service._sends == {}


async def test_a_computation_a_joined_resend_still_awaits_goes_on_for_it(served):
    nc, engine, service = served
    gone, still = sent(b"q", "s1"), sent(b"q", "s2")  # same payload, same id: the second joins
    await nc.deliver(SUBJECT, gone)
    await nc.deliver(SUBJECT, still)
    await settle()
    assert service.counters["joined"] == 1
    await nc.deliver(WITHDRAW, withdrawal(gone))
    await settle()
    assert b"q" not in engine.ended  # still computing
    engine.release.set()
    await settle()
    assert engine.ended == {b"q": "done"} and engine.started == [b"q"]
    assert still.replies == [b"answer to q"] and gone.replies == []
    assert service.counters["withdrawn"] == 1 and service.counters["cancelled"] == 0


async def test_a_computation_whose_other_requester_stopped_waiting_is_cancelled(served):
    """A joined request whose wait has run out is not awaited either: the last withdrawal cuts."""
    nc, engine, service = served
    # a wait long enough to be started within under a loaded machine's scheduling (1 ms expired
    # before the start under `make test` on 2 cores, 2026-12-07), short enough to run out after it
    expired, gone = sent(b"q", "s1", wait=0.3), sent(b"q", "s2")
    await nc.deliver(SUBJECT, expired)
    await settle()
    assert engine.started == [b"q"]
    await asyncio.sleep(0.35)  # the first one's requester no longer waits
    await nc.deliver(SUBJECT, gone)
    await settle()
    await nc.deliver(WITHDRAW, withdrawal(gone))
    await settle()
    assert engine.ended == {b"q": "cancelled"} and service.counters["cancelled"] == 1


async def test_a_withdrawal_read_before_its_request_drops_it(served):
    nc, engine, service = served
    early = sent(b"early", "s1")
    await nc.deliver(WITHDRAW, withdrawal(early))
    await nc.deliver(SUBJECT, early)
    await settle()
    assert engine.started == [] and early.replies == [] and service.counters["withdrawn"] == 1
    assert service._early == {} and service._sends == {}


async def test_withdrawals_of_unknown_sends_are_ignored_and_kept_few(served, monkeypatch):
    monkeypatch.setattr(service_module, "EARLY_WITHDRAWALS_KEPT", 8)
    nc, engine, service = served
    for i in range(100):  # another replica's requests, or ones long answered
        await nc.deliver(WITHDRAW, withdrawal(sent(f"elsewhere {i}".encode(), f"x{i}")))
    assert len(service._early) == 8 and service.counters["withdrawn"] == 0
    mine = sent(b"mine", "s1")
    await nc.deliver(SUBJECT, mine)
    await settle()
    engine.release.set()
    await settle()
    assert mine.replies == [b"answer to mine"]
    monkeypatch.setattr(service_module, "EARLY_WITHDRAWAL_TTL_S", 0.0)
    await asyncio.sleep(0.001)
    await nc.deliver(WITHDRAW, withdrawal(sent(b"latest", "y")))
    assert list(service._early) == [(SUBJECT, "y")]  # the old ones timed out


async def test_a_withdrawal_must_name_the_id_of_the_send_it_withdraws(served):
    nc, engine, service = served
    msg = sent(b"q", "s1")
    await nc.deliver(SUBJECT, msg)
    await settle()
    forged = MsgDouble(WITHDRAW, b"", {ID_HEADER: request_id(SUBJECT, b"other"), SEND_HEADER: "s1"})
    await nc.deliver(WITHDRAW, forged)
    engine.release.set()
    await settle()
    assert msg.replies == [b"answer to q"] and service.counters["withdrawn"] == 0


async def test_stopping_the_service_still_cancels_a_computation_as_before():
    """A cancellation of the serving task (stop() after its grace) is not taken for a withdrawal."""
    nc, engine = NatsDouble(), EngineDouble()
    service = Service(nc, {SUBJECT: engine.handle}, queue="sim", concurrency=1)
    await service.start()
    await nc.deliver(SUBJECT, sent(b"long", "s1"))
    await settle()
    await service.stop(grace_s=0.01)
    assert engine.ended == {b"long": "cancelled"} and service.counters["cancelled"] == 0
