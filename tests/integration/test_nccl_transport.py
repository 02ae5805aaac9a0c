"""transport nccl's sender and receiver (weights.nccl: NcclSender, Receiver) over a real
TCPStore and gloo, both sides in this process: a version arrives whole and checked, a wrong
checksum and a version no longer held are refused with their reasons, a receiver whose group
broke joins again, so does one after a learner restart (same address, a new store) or after the
sender dropped it for idling, and bad addresses are refused with the fix."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import torch

from parley.config.run import ConfigError, load_config
from parley.weights.config import NcclWeights
from parley.weights.cuda_ipc import IpcPublisher
from parley.weights.nccl import NcclSender, Receiver, parse_address

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
    monkeypatch.setattr("parley.weights.cuda_ipc.time.monotonic", lambda: now[0])
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

        bad = msgspec.structs.replace(
            s2, tensors=[s2.tensors[0], msgspec.structs.replace(s2.tensors[1], checksum=[0, 0, 0])]
        )
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
    with pytest.raises(ConfigError, match=r"\[weights\] address"):
        load_config(None, ['weights={kind="nccl"}'])
    assert NcclWeights(address="10.0.0.1:29600").address == "10.0.0.1:29600"
    assert load_config(None, ['weights={kind="nccl", address="10.0.0.1:29600"}']).weights == NcclWeights(
        address="10.0.0.1:29600"
    )


def test_a_receiver_serves_the_version_of_a_restarted_learner_at_the_same_address():
    """The learner restarts (its sender closed, a new one at the same address, a new store): the
    receiver sees the new instance in the announcement and joins the new store and group (with the
    new instance as its join secret), and serves the resumed version at its first fetch. (An older
    learner announced no instance: such an announcement is refused with the reason,
    test_nccl_rendezvous.)"""

    address = f"127.0.0.1:{free_port()}"
    first = NcclSender(IpcPublisher(hold_s=5.0), address, "gloo", timeout_s=5.0)
    receiver = Receiver("test-actor")
    try:
        got, reason = receiver.fetch(first.pack(weights(1), 1), 1, "cpu")
        assert reason is None and torch.equal(got[0][1], weights(1)[0][1])
    finally:
        first.close()
    resumed = NcclSender(IpcPublisher(hold_s=5.0), address, "gloo", timeout_s=5.0)
    try:
        s1 = resumed.pack(weights(11), 1)  # the resumed learner re-announces version 1, other weights
        got, reason = receiver.fetch(s1, 1, "cpu")
        assert reason is None and torch.equal(got[0][1], weights(11)[0][1])
        got, reason = receiver.fetch(resumed.pack(weights(12), 2), 2, "cpu")
        assert reason is None and torch.equal(got[1][1], weights(12)[1][1]) and len(resumed.actors) == 1
    finally:
        resumed.close()


def test_an_actor_dropped_for_idling_rejoins_at_its_next_fetch():
    """NcclSender drops an actor silent for idle_s (its thread and group go); the actor's next fetch
    joins again rather than wait out hold_s for an answer nobody will give, and is served."""
    sender = NcclSender(IpcPublisher(hold_s=3.0), f"127.0.0.1:{free_port()}", "gloo", timeout_s=3.0, idle_s=0.3)
    receiver = Receiver("test-actor")
    try:
        got, reason = receiver.fetch(sender.pack(weights(1), 1), 1, "cpu")
        assert reason is None
        deadline = time.monotonic() + 5.0
        while sender.actors:  # dropped after idle_s
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        got, reason = receiver.fetch(sender.pack(weights(2), 2), 2, "cpu")
        assert reason is None and torch.equal(got[0][1], weights(2)[0][1])
        assert time.monotonic() - t0 < 2.0  # joined again at once, not after a timeout
    finally:
        sender.close()


class LaggingWork:
    """Test double of an NCCL work without blocking wait: wait() returns at once while the transfer
    runs on (here for `lag_s` more, or for ever); is_completed() says when it has ended."""

    def __init__(self, work, lag_s: float | None):
        self.work, self.done_at = work, None if lag_s is None else time.monotonic() + lag_s

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        if self.done_at is None or time.monotonic() < self.done_at:
            return False
        if self.work is not None:
            self.work.wait()  # gloo's own send (done by now: the receiver has it), waited once
            self.work = None
        return True


class LaggingGroup:
    """The learner's side of a gloo pair group whose sends come back as LaggingWork; aborts are counted."""

    def __init__(self, group, lag_s):
        self.group, self.lag_s, self.aborted = group, lag_s, 0
        self.works: list[LaggingWork] = []

    def send(self, tensors, dst, tag):
        self.works.append(LaggingWork(self.group.send(tensors, dst, tag), self.lag_s))
        return self.works[-1]

    def abort(self):
        self.aborted += 1


def lagging_sender(monkeypatch, lag_s, timeout_s):
    import parley.weights.nccl as nccl

    groups, real = [], nccl.pair_group

    def pair_group(store, rank, backend, timeout):
        g = real(store, rank, backend, timeout)
        if rank == 0:
            groups.append(LaggingGroup(g, lag_s))
            return groups[-1]
        return g

    monkeypatch.setattr(nccl, "pair_group", pair_group)
    pub = IpcPublisher(hold_s=5.0)
    released = []  # at each release: had every send ended?
    release = pub.release
    monkeypatch.setattr(
        pub, "release", lambda buf: (released.append(all(w.is_completed() for w in groups[0].works)), release(buf))
    )
    return NcclSender(pub, f"127.0.0.1:{free_port()}", "gloo", timeout_s=timeout_s), groups, released


def test_a_sent_buffer_is_released_only_once_its_send_has_finished(monkeypatch):
    """As NCCL without blocking wait: the send's wait() returns before the transfer ends; the reader
    guard (IpcPublisher.take/release) is kept until is_completed(), so no fill overwrites the buffer
    while it is still being read."""
    sender, groups, released = lagging_sender(monkeypatch, lag_s=0.3, timeout_s=5.0)
    try:
        got, reason = Receiver("test-actor").fetch(sender.pack(weights(1), 1), 1, "cpu")
        assert reason is None
        deadline = time.monotonic() + 5.0
        while not released:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert released == [True] and groups[0].aborted == 0
    finally:
        sender.close()


def test_a_send_that_never_finishes_times_out_on_the_host_and_is_aborted_before_release(monkeypatch):
    sender, groups, released = lagging_sender(monkeypatch, lag_s=None, timeout_s=0.5)
    receiver = Receiver("test-actor")
    try:
        t0 = time.monotonic()
        got, reason = receiver.fetch(sender.pack(weights(1), 1), 1, "cpu")  # gloo's own receive completes
        deadline = time.monotonic() + 5.0
        while sender.actors or not released:  # the send timed out: its actor dropped, its group aborted
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert time.monotonic() - t0 >= 0.5 and groups[0].aborted == 1 and released == [False]
    finally:
        sender.close()
