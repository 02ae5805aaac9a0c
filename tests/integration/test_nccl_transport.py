"""transport nccl's sender and receiver (weights.nccl: NcclSender, Receiver) over a real
TCPStore and gloo, both sides in this process: a version arrives whole and checked, a wrong
checksum and a version no longer held are refused with their reasons, a receiver whose group
broke joins again, and bad addresses are refused with the fix."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import torch

from config.run import ConfigError, load_config
from weights.config import NcclWeights
from weights.cuda_ipc import IpcPublisher
from weights.nccl import NcclSender, Receiver, parse_address

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(50, 32, generator=g)), ("norm.weight", torch.randn(5, generator=g).bfloat16())]


def test_versions_arrive_checked_and_stale_or_bad_ones_are_refused(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("weights.cuda_ipc.time.monotonic", lambda: now[0])
    sender = NcclSender(IpcPublisher(hold_s=10.0), f"127.0.0.1:{free_port()}", "gloo", timeout_s=20.0)
    receiver = Receiver("test-actor")
    try:
        s1 = sender.pack(weights(1), 1)
        got, reason = receiver.fetch(s1, 1, "cpu")
        assert reason is None and [n for n, _ in got] == ["embed.weight", "norm.weight"]
        assert all(torch.equal(t, w) for (_, t), (_, w) in zip(got, weights(1)))

        s2 = sender.pack(weights(2), 2)
        got, reason = receiver.fetch(s2, 2, "cpu")
        assert reason is None and torch.equal(got[0][1], weights(2)[0][1])
        got, reason = receiver.fetch(s1, 1, "cpu")  # v1 superseded just now: still held
        assert reason is None and torch.equal(got[0][1], weights(1)[0][1])

        now[0] += 11.0  # past v1's hold time: still there until a fill reuses its buffer
        got, reason = receiver.fetch(s1, 1, "cpu")
        assert reason is None and torch.equal(got[0][1], weights(1)[0][1])
        for _ in range(200):  # the sender's thread releases its reader guard just after the send
            if not any(b.readers for b in sender.pub.buffers):
                break
            time.sleep(0.01)
        assert sender.pack(weights(3), 3) is not None  # into v1's buffer, the oldest past its hold
        got, reason = receiver.fetch(s1, 1, "cpu")
        assert got == [] and "version 1 is no longer held" in reason

        bad = msgspec.structs.replace(s2, tensors=[s2.tensors[0], msgspec.structs.replace(s2.tensors[1], checksum=[0, 0, 0])])
        got, reason = receiver.fetch(bad, 2, "cpu")
        assert got == [] and reason == "checksum mismatch in 1 of 2 tensors (first: norm.weight)"
        assert len(sender.actors) == 1

        receiver.group = None  # as after a broken transfer: the next fetch joins again
        got, reason = receiver.fetch(s2, 2, "cpu")
        assert reason is None and torch.equal(got[1][1], weights(2)[1][1])
    finally:
        sender.close()


def test_bad_addresses_name_the_fix():
    with pytest.raises(ValueError, match=r"'nowhere' is not host:port; set \[weights\] address"):
        parse_address("nowhere")
    with pytest.raises(ValueError, match=r"\[weights\] address"):
        NcclWeights()
    with pytest.raises(ConfigError, match=r"\[weights\] address"):  # the old keys: the same check
        load_config(None, ["learner.transport=nccl"])
    assert NcclWeights(address="10.0.0.1:29600").address == "10.0.0.1:29600"
    assert load_config(None, ["learner.transport=nccl", 'learner.nccl_address="10.0.0.1:29600"']).weights \
        == NcclWeights(address="10.0.0.1:29600")
