"""A learner whose run is taken over by another stops at once, with one line: the real `parley learner`
process on the tiny model and a real nats-server, paused (SIGSTOP) past the lease's TTL while a second
learner takes the lease (learner.lease's own code) and announces its version, then woken. It must exit
2 with one line on stderr naming the lost lease, publish nothing after the usurper's version, and leave
the books to the new learner: no ledger write, no ack of the samples that came meanwhile."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parley.learner.checkpoint import learner_dir, read_state
from parley.learner.lease import Lease
from parley.protocol import topology
from parley.protocol.bus import publish
from parley.protocol.connect import connect
from parley.protocol.messages import WeightVersion
from parley.weights.common import announce, current_version, forget_writes
from tests.integration.test_learner_resume import make_scored, wait_for

# A learner start on the tiny model and the lease's TTL (15 s) waited out: the extended tier
pytestmark = [pytest.mark.integration, pytest.mark.extended, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
N = 3
BUS = topology.BusSettings(max_bytes=16 * 1024**2, ack_wait_s=4.0)


def start_learner(url: str, run: str, run_dir: Path, model: Path, out: Path, err: Path) -> subprocess.Popen:
    sets = [
        f'run.dir="{run_dir}"',
        f'policy.model="{model}"',
        f"rollout.n={N}",
        "learner.groups_per_step=2",
        "learner.micro_batch_tokens=256",
        f"bus.ack_wait_s={BUS.ack_wait_s}",
        f"bus.max_bytes={BUS.max_bytes}",
        "learner.ledger_flush_s=0.2",
        "learner.accept_foreign_scored=true",  # synthetic samples: no feeder issued their tasks
        "learner.eval_every=0",
    ]
    cmd = [sys.executable, "-m", "parley.deploy.cli", "learner", "--nats", url, "--run", run, "--steps", "5"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PARLEY_LOG": "INFO"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out.open("w"), stderr=err.open("w"))


async def test_a_learner_whose_run_was_taken_over_exits_with_one_line_and_writes_nothing(
    js, nats_server, tiny_model, tmp_path
):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    run = "usurped"
    await topology.ensure_topology(js, run, BUS)
    run_dir, out, err = tmp_path / "run", tmp_path / "learner.out", tmp_path / "learner.err"
    proc = start_learner(nats_server.url, run, run_dir, tiny_model, out, err)
    kv = await js.key_value(topology.kv_bucket(run))
    other = await connect(nats_server.url, name="usurper")
    try:
        # before the takeover: two of group 0's samples recorded in the ledger (so acked)
        for i in range(2):
            s = make_scored(tok, model, run, 0, i)
            await publish(js, run, "scored", s)

        def recorded() -> bool:
            state = read_state(run_dir) if (learner_dir(run_dir) / "state.msgpack").is_file() else None
            return state is not None and any(len(g.samples) == 2 for g in state.groups)

        await wait_for(recorded, 90, "the first learner's ledger to record two samples", proc, err)
        first_version = (await current_version(js, run)).version  # its baseline, announced at start

        # paused past the TTL (a long GC, a stalled host): its renewals stop, the key expires
        proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(0.5)  # stopped for sure, then its ledger as it left it (written by rename)
        ledger_before = (learner_dir(run_dir) / "state.msgpack").read_bytes()
        t0 = time.monotonic()
        js_u = other.jetstream()
        await Lease(js_u, run, "usurper-learner").acquire()  # waits out the TTL, as a real second learner does
        assert time.monotonic() - t0 < topology.LEASE_TTL_S + 5
        forget_writes(js_u, run)
        usurper = WeightVersion(
            version=first_version + 1,
            step=first_version + 1,
            transport="objstore",
            location="usurper",
            sha256="0" * 64,
            bytes=1,
            created=time.time(),
        )
        await announce(js_u, run, usurper)
        announced = (await kv.get(topology.WEIGHTS_KEY)).revision
        # samples that arrive meanwhile belong to the new learner's books
        for g, i in [(0, 2)] + [(1, i) for i in range(N)]:
            await publish(js, run, "scored", make_scored(tok, model, run, g, i))
        last_seq = (await js.stream_info(topology.stream_name(run, "scored"))).state.last_seq
        before_wake = await js.consumer_info(topology.stream_name(run, "scored"), "learner")

        proc.send_signal(signal.SIGCONT)
        woke = time.monotonic()
        code = await asyncio.to_thread(proc.wait, 30)
        took = time.monotonic() - woke
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        await other.close()

    stderr = err.read_text()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr[-4000:]
    assert took < 10, f"{took:.1f} s from waking to exit"
    assert "Traceback" not in stderr, stderr[-4000:]
    errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
    assert len(errors) == 1, stderr[-4000:]
    # what happened (who holds the run now) and what to do, in the one line
    assert "lease" in errors[0] and "another learner, usurper-learner," in errors[0], errors[0]
    assert "--resume" in errors[0], errors[0]
    after = lines[lines.index(errors[0]) + 1 :]
    assert not any("lease" in line for line in after), after  # nothing about the lease that contradicts it

    # nothing published after the usurper's version: the weights key is as it left it
    entry = await kv.get(topology.WEIGHTS_KEY)
    assert entry.revision == announced and (await current_version(js, run)).location == "usurper"
    # the books stay for the new learner: the ledger unwritten, the samples of the pause not acked
    assert (learner_dir(run_dir) / "state.msgpack").read_bytes() == ledger_before
    info = await js.consumer_info(topology.stream_name(run, "scored"), "learner")
    assert info.ack_floor.stream_seq == before_wake.ack_floor.stream_seq < last_seq, (before_wake, info)
