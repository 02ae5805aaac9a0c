"""Withdrawn requests, without a network: protocol.request.request() withdraws its send when it is
cancelled. The bus is a test double."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from protocol import topology
from protocol.request import ID_HEADER, SEND_HEADER, TIMEOUT_HEADER, request, request_id

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
