"""transport nccl's rendezvous (weights.nccl) over a real TCPStore socket and gloo, no NCCL: a join
must prove it read the announcement (the secret is NcclSource.instance, carried in the NATS-protected
weights KV), a proof seen on the store is good for its own join only, joins are capped and each
times out, and the group of a worker that died is dropped once its beat stops, not after idle_s.
The forged joins speak the store protocol by hand, as anyone who reaches the port could."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta

import msgspec
import pytest
import torch.distributed as dist

import parley.weights.nccl as nccl
from parley.protocol.messages import NcclSource
from parley.weights.cuda_ipc import IpcPublisher
from parley.weights.nccl import NcclSender, Receiver
from tests.integration.test_nccl_transport import free_port, weights

pytestmark = pytest.mark.integration


def client(sender: NcclSender):
    host, port = nccl.parse_address(sender.address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))


def forged_join(store, value: str) -> tuple[int, str | None]:
    """Take a join number and write `value` as its join; (k, the sender's verdict or None if none came)."""
    k = store.add("joins", 1)
    store.set(f"join{k}", value)
    if not nccl.store_wait(store, f"actor{k}/admit", 5.0):
        return k, None
    return k, store.get(f"actor{k}/admit").decode()


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_join_without_the_announced_secret_is_refused_at_once():
    """Before, any process that reached the port joined: the sender built it a group (holding a
    thread, and on GPUs a communicator, up to idle_s) and served it every version it asked for."""
    sender = NcclSender(IpcPublisher(hold_s=5.0), f"127.0.0.1:{free_port()}", "gloo", timeout_s=5.0)
    store = client(sender)
    try:
        source = sender.pack(weights(1), 1)
        _, verdict = forged_join(store, "intruder")  # the old protocol: a bare name
        assert verdict is not None and verdict.startswith("not a join of this parley"), verdict
        guess = nccl.join_proof("not-the-secret", 2, "intruder")
        _, verdict = forged_join(store, json.dumps({"name": "intruder", "proof": guess}))
        assert verdict == "wrong proof: the joining process has not read this learner's announcement"
        assert sender.joining == 0 and sender.actors == {} and sender.counters["refused"] == 2

        receiver = Receiver("test-actor")  # it read the announcement: joins and is served
        got, reason = receiver.fetch(source, 1, "cpu")
        assert reason is None and len(got) == 2 and list(sender.actors.values()) == ["test-actor"]
        (k,) = sender.actors
        seen = store.get(f"join{k}").decode()  # an honest join's proof, as the store shows it to anyone
        _, verdict = forged_join(store, seen)  # replayed under the next join number
        assert verdict.startswith("wrong proof")
        assert sender.counters["admitted"] == 1 and sender.counters["refused"] == 3
    finally:
        sender.close()


def test_a_receiver_of_an_announcement_without_a_secret_is_told_why():
    sender = NcclSender(IpcPublisher(hold_s=5.0), f"127.0.0.1:{free_port()}", "gloo", timeout_s=5.0)
    try:
        old = msgspec.structs.replace(sender.pack(weights(1), 1), instance="")
        with pytest.raises(RuntimeError, match="announces no join secret .* an older parley"):
            Receiver("test-actor").fetch(old, 1, "cpu")
    finally:
        sender.close()


def test_joins_are_capped_and_each_times_out(monkeypatch):
    """Joins with a valid proof whose group is never built (the joiner walks away): at most
    MAX_JOINING are under way, the rest refused with the reason, and each admitted one gives its
    slot back after JOIN_TIMEOUT_S; then an actor joins and is served."""
    monkeypatch.setattr(nccl, "JOIN_TIMEOUT_S", 1.0)
    cap = nccl.MAX_JOINING
    sender = NcclSender(IpcPublisher(hold_s=5.0), f"127.0.0.1:{free_port()}", "gloo", timeout_s=5.0)
    store = client(sender)
    try:
        source = sender.pack(weights(1), 1)
        verdicts = []
        for _ in range(cap + 2):
            k = store.add("joins", 1)
            proof = nccl.join_proof(source.instance, k, "walks-away")
            store.set(f"join{k}", json.dumps({"name": "walks-away", "proof": proof}))
            assert nccl.store_wait(store, f"actor{k}/admit", 5.0), f"join {k} got no verdict"
            verdicts.append(store.get(f"actor{k}/admit").decode())
        assert verdicts[:cap] == ["ok"] * cap
        assert all(v.endswith(f"joins under way (at most {cap}); ask again later") for v in verdicts[cap:])
        wait_until(lambda: sender.joining == 0, 10.0, "the abandoned joins did not time out")
        got, reason = Receiver("test-actor").fetch(source, 1, "cpu")
        assert reason is None and list(sender.actors.values()) == ["test-actor"]
    finally:
        sender.close()


def doomed(source: NcclSource, told) -> None:
    """A worker process (forked: torch is imported already) that joins, is served, says so, and
    lives on beating until it is killed."""
    nccl.BEAT_S = 0.1
    got, reason = nccl.Receiver("doomed").fetch(source, 1, "cpu")
    told.send(reason or "fetched")
    time.sleep(600)


def test_the_group_of_a_worker_that_died_is_dropped(monkeypatch):
    """A worker joins, is served, keeps beating while alive, and is SIGKILLed: its group is dropped
    within dead_s (here 1 s), not held for idle_s (an hour by default)."""
    monkeypatch.setattr(nccl, "DEAD_S", 1.0, raising=False)
    sender = NcclSender(IpcPublisher(hold_s=5.0), f"127.0.0.1:{free_port()}", "gloo", timeout_s=5.0)
    ours, theirs = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=doomed, args=(sender.pack(weights(1), 1), theirs))
    proc.start()
    try:
        assert ours.poll(30) and ours.recv() == "fetched"
        assert list(sender.actors.values()) == ["doomed"]
        time.sleep(2.5)  # more than dead_s: alive, it beats, and keeps its group
        assert list(sender.actors.values()) == ["doomed"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        wait_until(lambda: not sender.actors, 5.0, "the dead worker's group is still served")
        assert sender.counters["dropped"] == 1
    finally:
        if proc.is_alive():
            proc.kill()
        sender.close()
