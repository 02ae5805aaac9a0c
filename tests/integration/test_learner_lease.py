"""One learner per run: the lease in the run's lease KV (learner.lease) on a real nats-server. A second
learner refuses while the first renews; the lease of a learner that was killed expires and a resume
takes it; a learner whose lease was taken notices at its next renewal. The real `parley learner`
command refuses with one line while another learner holds the run, and a fresh start refuses an
older run's streams unless --reset-streams purges them."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parley.learner.lease import Lease, LeaseHeld, LeaseLost, check_fresh_streams
from parley.protocol import topology
from parley.protocol.bus import publish
from parley.protocol.messages import Task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
BUS = topology.BusSettings(max_bytes=4 * 1024**2)


def learner_cmd(url: str, run: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "parley.deploy.cli", "learner", "--nats", url, "--run", run, *extra]
    cmd += ["--set", f'run.dir="{run_dir}"', "--set", f"bus.max_bytes={BUS.max_bytes}"]
    # tiny passes the start checks without being built: the refusal comes before any model is loaded
    cmd += ["--set", 'policy.model="tiny"']
    return subprocess.run(cmd, cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=90)


async def test_a_second_learner_refuses_and_a_dead_ones_lease_expires(js, nats_server, tmp_path):
    run = "leased"
    await topology.ensure_topology(js, run, BUS)
    first = Lease(js, run, "first-learner")
    await first.acquire()
    halt = asyncio.Event()
    renewing = asyncio.create_task(first.keep(halt))

    t0 = time.monotonic()
    with pytest.raises(LeaseHeld, match=r"run 'leased' already has a learner \(first-learner"):
        await Lease(js, run, "second-learner").acquire()
    assert time.monotonic() - t0 < topology.LEASE_TTL_S  # refused once a renewal was seen, not after the TTL

    # the real command, while the first renews: exit 2, one line naming the holder
    proc = await asyncio.to_thread(learner_cmd, nats_server.url, run, tmp_path / "run2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    refusals = [line for line in proc.stderr.splitlines() if "already has a learner" in line]
    assert len(refusals) == 1 and "first-learner" in refusals[0], proc.stderr[-3000:]
    assert not (tmp_path / "run2" / "learner").exists()  # nothing written for the refused one

    # killed: renewals stop, nothing released; the next learner waits for the TTL and takes it
    halt.set()
    await renewing
    t0 = time.monotonic()
    third = Lease(js, run, "resumed-learner")
    await third.acquire()
    waited = time.monotonic() - t0
    assert 0 < waited <= topology.LEASE_TTL_S + 3, waited
    with pytest.raises(LeaseLost, match="was lost"):
        await first.renew()  # a stale first learner would stop here, before moving the weights key back
    await third.release()
    await Lease(js, run, "next").acquire()  # released: taken at once


async def test_a_fresh_start_refuses_an_older_runs_streams_unless_reset(js, nats_server, tmp_path):
    run = "reused"
    await topology.ensure_topology(js, run, BUS)
    await publish(js, run, "tasks", Task(task_id=f"{run}-g000000", run=run, item_id="item-0", n=2))

    proc = await asyncio.to_thread(learner_cmd, nats_server.url, run, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "older learner's streams" in line]
    assert len(lines) == 1 and "PARLEY_reused_TASKS holds 1 messages" in lines[0], proc.stderr[-3000:]
    assert "--reset-streams" in lines[0]
    # the refused learner released its lease: the next one need not wait
    await Lease(js, run, "check").acquire()

    with pytest.raises(LeaseHeld, match="older learner's streams"):
        await check_fresh_streams(js, run, reset=False)
    await check_fresh_streams(js, run, reset=True)
    assert (await js.stream_info(topology.stream_name(run, "tasks"))).state.messages == 0
    await check_fresh_streams(js, run, reset=False)  # nothing left to refuse


async def test_a_lease_of_a_learner_that_died_on_this_host_is_taken_at_once(js, tmp_path):
    """A resume on the host where the learner was killed need not wait out the TTL: the holder's name
    (host-pid) names a process that no longer exists there; a live one, or another host's, is not."""
    import socket

    from parley.learner.lease import holder_name

    run = "died"
    await topology.ensure_topology(js, run, BUS)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = Lease(js, run, holder_name(gone.pid))
    await dead.acquire()  # killed: it never renews nor releases
    t0 = time.monotonic()
    await Lease(js, run, holder_name()).acquire()
    assert time.monotonic() - t0 < 3.0  # not the TTL's 15 s

    # one whose process still runs here is not taken over (it is waited for, as any holder is)
    from parley.learner import lease as lease_module

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not lease_module._died_here(holder_name(live.pid))
        assert not lease_module._died_here(holder_name(gone.pid).replace(socket.gethostname(), "another-host", 1))
        assert lease_module._died_here(holder_name(gone.pid))
    finally:
        live.kill()


def test_a_holder_of_the_same_host_name_in_another_pid_namespace_is_not_taken_over():
    """Two learners in containers that share a host name (host networking, a fixed `hostname:`) see
    each other's pids as absent: a pid of another namespace says nothing of that process. Only a holder
    of this boot and PID namespace is checked here; others, and a name without a scope, wait out the TTL."""
    import socket

    from parley.learner import lease as lease_module

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = lease_module.pid_scope()
    assert here and here == lease_module.holder_name().split("@", 1)[1]
    boot, ns = here.rsplit(".", 1)
    host = socket.gethostname()
    assert lease_module._died_here(f"{host}-{gone.pid}@{here}")
    # the same host name and pid, another container's namespace (same kernel) or another machine's boot
    assert not lease_module._died_here(f"{host}-{gone.pid}@{boot}.{int(ns) + 1}")
    assert not lease_module._died_here(f"{host}-{gone.pid}@00000000-0000-0000-0000-000000000000.{ns}")
    # a name as learners wrote it before scopes (host-pid): nothing says which namespace it was
    assert not lease_module._died_here(f"{host}-{gone.pid}")


async def test_a_lease_that_expired_with_nobody_else_is_taken_back_at_the_next_renewal(js):
    """A NATS outage longer than the TTL (the restarted server has dropped the key) or a renewal held
    up as long: nobody else wrote the key, so the holder takes it back instead of stopping (make faults'
    nats-server restarts of 20 s stopped the learner with exit 4 at each). Another learner's key is
    still a lost lease."""
    run = "expired"
    await topology.ensure_topology(js, run, BUS)
    kv = await js.key_value(topology.lease_bucket(run))
    lease = Lease(js, run, "holder")
    first = await lease.acquire()
    await kv.purge(topology.LEASE_KEY)  # what the TTL does to a key nobody renewed
    await lease.renew()
    assert lease.revision > first and (await kv.get(topology.LEASE_KEY)).value == b"holder"
    await kv.purge(topology.LEASE_KEY)
    other = Lease(js, run, "other")
    await other.acquire()  # the key is free: taken at once
    with pytest.raises(LeaseLost, match="was lost"):
        await lease.renew()


async def test_a_renewal_stored_after_its_answer_was_lost_keeps_the_lease(js):
    """A renewal sent while the learner was cut off from NATS times out, and the reconnect then flushes
    it: the key holds this learner's own name one revision past the one it holds. That is still its
    lease (make faults' chaos run stopped a live learner with exit 2, 'lost to' itself)."""
    run = "own-renewal"
    await topology.ensure_topology(js, run, BUS)
    kv = await js.key_value(topology.lease_bucket(run))
    lease = Lease(js, run, "holder")
    first = await lease.acquire()
    late = await kv.update(topology.LEASE_KEY, b"holder", last=first)  # the flushed renewal
    await lease.renew()
    assert lease.holds() and lease.revision > late
    assert (await kv.get(topology.LEASE_KEY)).revision == lease.revision
    await kv.update(topology.LEASE_KEY, b"other", last=lease.revision)  # another's name: lost, as before
    with pytest.raises(LeaseLost, match="lost to another learner, other,"):
        await lease.renew()
    assert not lease.holds()


async def test_the_lease_is_renewed_while_the_event_loop_is_blocked(js, nats_server):
    """The learner's loop can be held for longer than the TTL by synchronous work (Learner's
    construction loads the training split on it: 40 s for 60 items of 2 MB reference documents in
    make faults' 2 MB run, where the first renewal after it found the key expired). The renewals run
    on their own thread and connection: another learner trying meanwhile is refused, and the revision
    (the fencing token) moves while the loop does nothing."""
    import threading

    from parley.protocol.connect import connect

    run = "blocked"
    ttl = 1.0
    await js.create_key_value(config=dataclasses.replace(topology.lease_config(run, BUS), ttl=ttl))
    lease = Lease(js, run, "busy-learner", ttl_s=ttl, connect=lambda: connect(nats_server.url, name="lease-test"))
    first = await lease.acquire()
    halt = asyncio.Event()
    keeping = asyncio.create_task(lease.keep(halt))
    await asyncio.sleep(0.2)  # the renewals have started

    outcome: list[str] = []

    async def second_learner() -> None:
        nc = await connect(nats_server.url, name="second-learner")
        try:
            await Lease(nc.jetstream(), run, "second-learner", ttl_s=ttl).acquire()
            outcome.append("taken")
        except LeaseHeld:
            outcome.append("refused")
        finally:
            await nc.close()

    other = threading.Thread(target=asyncio.run, args=(second_learner(),))
    t0 = time.monotonic()
    other.start()
    other.join(timeout=3 * ttl + 10)  # blocks this loop, as a long synchronous load does
    time.sleep(max(0.0, 2.5 * ttl - (time.monotonic() - t0)))  # and longer than a TTL in all
    moved = lease.revision - first  # read before any await: only another thread could have moved it
    assert outcome == ["refused"], outcome
    assert moved >= 3, f"revision moved by {moved} while the loop was blocked {time.monotonic() - t0:.1f} s"
    halt.set()
    await keeping
    kv = await js.key_value(topology.lease_bucket(run))
    entry = await kv.get(topology.LEASE_KEY)
    assert entry.value == b"busy-learner" and entry.revision == lease.revision
    await lease.release()
    await Lease(js, run, "next", ttl_s=ttl).acquire()  # released: taken at once


async def test_a_lease_lost_on_the_renewal_thread_stops_keep_on_the_learners_loop(js, nats_server):
    """learner.service watches keep()'s task: a LeaseLost raised on the renewal thread must end it."""
    from parley.protocol.connect import connect

    run = "taken"
    ttl = 1.0
    await js.create_key_value(config=dataclasses.replace(topology.lease_config(run, BUS), ttl=ttl))
    lease = Lease(js, run, "first", ttl_s=ttl, connect=lambda: connect(nats_server.url, name="lease-test"))
    await lease.acquire()
    keeping = asyncio.create_task(lease.keep(asyncio.Event()))
    kv = await js.key_value(topology.lease_bucket(run))
    await kv.purge(topology.LEASE_KEY)
    await kv.create(topology.LEASE_KEY, b"another-learner")  # taken meanwhile, as after a long outage
    with pytest.raises(LeaseLost, match="was lost"):
        await asyncio.wait_for(keeping, timeout=5 * ttl)
