"""protocol.connect.barrier: after it returns, the server has seen every command the client sent.

nats-py's flush() writes its PING to the socket ahead of the SUB/PUB commands still queued for its
flusher task; these tests record the bytes a real connection writes and check the order, so they fail
wherever the PING can overtake a queued command (as it did with a plain flush: CI saw a permission
error for a publish arrive after the flush that should have waited for it)."""

from __future__ import annotations

import pytest

from parley.protocol.connect import barrier

pytestmark = [pytest.mark.integration]


def record_writes(nc) -> list[bytes]:
    """Spy on the connection's transport: every chunk written, in order (the server sees that order)."""
    wire: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines

    def spy_write(payload):
        wire.append(bytes(payload))
        return write(payload)

    def spy_writelines(payloads):
        wire.extend(bytes(p) for p in payloads)
        return writelines(payloads)

    transport.write, transport.writelines = spy_write, spy_writelines
    return wire


def first(wire: list[bytes], prefix: bytes) -> int:
    return next(i for i, chunk in enumerate(wire) if chunk.startswith(prefix))


@pytest.mark.parametrize("command", ["subscribe", "publish"])
async def test_the_ping_goes_out_after_every_queued_command(nc, command):
    wire = record_writes(nc)
    if command == "subscribe":
        await nc.subscribe("parley.test.barrier", cb=None)
        sent = b"SUB "
    else:
        await nc.publish("parley.test.barrier", b"x")
        sent = b"PUB "
    await barrier(nc)
    assert first(wire, sent) < first(wire, b"PING"), wire


async def test_a_subscription_is_live_when_barrier_returns(nc, nats_server):
    """Another connection's message reaches the new subscription: the server had it before the PONG."""
    from parley.protocol.connect import connect

    got = []

    async def on_msg(msg):
        got.append(msg.data)

    other = await connect(nats_server.url, name="other")
    try:
        for i in range(20):
            await nc.subscribe(f"parley.test.live.{i}", cb=on_msg)
            await barrier(nc)
            await other.publish(f"parley.test.live.{i}", b"%d" % i)
            await barrier(other)
        await barrier(nc)
        await barrier(other)
        for _ in range(100):
            if len(got) == 20:
                break
            await barrier(nc)
        assert sorted(got, key=int) == [b"%d" % i for i in range(20)]
    finally:
        await other.close()
