"""Scorer + judge end to end: a real vLLM judge (the toy model) behind the judge service, real
nats-server, real scorers. Trajectories are scored once each; while the judge is down they wait
and are scored when it returns; two scorers (one of them the `parley scorer` command) split the
work and SCORED holds each trajectory once.

One judge engine for the module (~30 s to load); the toy model's text is gibberish, but the
JSON-schema-constrained decoding makes every verdict valid JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from parley.config.scorer import JudgeConfig, ScorerConfig
from parley.deploy.natsserver import NatsServer
from parley.protocol import bus, codec, examples, topology
from parley.protocol.connect import connect
from parley.protocol.messages import ChatMessage, FutureRollout, Trajectory
from parley.rewards.reward import default_weights, total_reward
from parley.scorer.scorer import Scorer
from parley.services.judge.client import JudgeClient
from parley.services.judge.server import Judge, judge_service
from parley.tasks.data import load_items

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

SCORER_CFG = ScorerConfig(concurrency=4, retry_delay_s=0.5, retry_max_delay_s=1.0, judge_timeout_s=60.0)
# Enough deliveries that an outage of a few seconds with 0.5-1 s back-off never dead-letters.
PATIENT_BUS = topology.BusSettings(ack_wait_s=30.0, max_deliver=50, max_bytes=64 * 2**20)
# Streams reserve max_bytes each; the default 8 GiB x 5 streams x 3 runs exceeds a test machine's disk.
SMALL = ["--set", f"bus.max_bytes={64 * 2**20}"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = NatsServer(tmp_path_factory.mktemp("nats"), port=0)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def judge(tiny_model):
    from parley.engines.backend import make_backend

    cfg = msgspec.convert(
        {
            "engine": {"model": str(tiny_model), "max_model_len": 1536, "kv_cache_bytes": 128 * 2**20},
            # The toy model closes a JSON string only when it happens to sample a quote: 256 tokens
            # give each attempt a good chance; the rationale is capped at 300 characters anyway.
            "max_tokens": 256,
            "max_retries": 3,
            "concurrency": 8,
        },
        JudgeConfig,
    )
    backend = make_backend(cfg)
    yield Judge(backend, cfg)
    backend.engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nc(server):
    client = await connect(server.url, name="pytest-e2e")
    yield client
    await client.drain()


@contextlib.asynccontextmanager
async def judge_up(server, judge):
    """The judge service on its own connection, like a separate `parley judge` process."""
    conn = await connect(server.url, name="judge-test")
    service = judge_service(conn, judge, name="judge-test")
    await service.start()
    try:
        yield service
    finally:
        await service.stop(grace_s=30)
        await conn.drain()


@contextlib.asynccontextmanager
async def scorer_up(server, run: str, ident: str, bus_settings: topology.BusSettings, cfg: ScorerConfig = SCORER_CFG):
    conn = await connect(server.url, name=ident)
    scorer = Scorer(conn, run, JudgeClient(conn, timeout=cfg.judge_timeout_s), cfg, bus_settings, ident)
    stop = asyncio.Event()
    task = asyncio.create_task(scorer.run_until(stop, fetch_timeout=0.5))
    try:
        yield scorer
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await conn.drain()


def trajectories(run: str, n: int, *, futures_every: int = 0) -> list[Trajectory]:
    """Hand-made conversations over the bundled items: the user's opening, a clarifying question,
    the user's answer and a first draft (the reference's opening lines)."""
    items = load_items()
    out = []
    for i in range(n):
        item = items[i % len(items)]
        draft = "\n".join(item.reference.splitlines()[:3])
        messages = list(item.prefix) + [
            ChatMessage("assistant", "Happy to help. Who will read it, and what tone and length do you want?"),
            ChatMessage("user", item.single_turn_prompt[:200] or "friends, warm tone, short"),
            ChatMessage("assistant", f"Here is a first draft:\n\n{draft}\n\nShall I go on?"),
        ]
        traj = examples.trajectory(run, task_id=f"task-{i // 4}", sample=i % 4)
        traj.item_id, traj.reference, traj.messages, traj.seed = item.item_id, item.reference, messages, i
        traj.assistant_tokens = 40 + 10 * i
        traj.futures = []
        if futures_every and i % futures_every == 0:
            traj.futures = [
                FutureRollout(
                    messages=[ChatMessage("user", "yes, finish it"), ChatMessage("assistant", item.reference)],
                    assistant_tokens=300,
                ),
                FutureRollout(messages=[ChatMessage("user", "make it shorter")], assistant_tokens=0),
            ]
        out.append(traj)
    return out


async def stream_messages(js, run: str, key: str) -> list:
    name = topology.stream_name(run, key)
    info = await js.stream_info(name)
    msgs = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(Exception):  # none deleted here, but a gap must not break the read
            msgs.append(codec.decode(key, (await js.get_msg(name, seq)).data))
    return msgs


async def wait_for_count(js, run: str, key: str, n: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    name = topology.stream_name(run, key)
    while True:
        count = (await js.stream_info(name)).state.messages
        if count >= n or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.25)


async def test_trajectories_are_scored_end_to_end(server, judge, nc):
    run = "e2e-score"
    js = nc.jetstream()
    await topology.ensure_topology(js, run, PATIENT_BUS)
    trajs = trajectories(run, 4, futures_every=3)  # samples 0 and 3 carry two futures each
    no_reference = examples.trajectory(run, task_id="task-bad", sample=0)
    no_reference.reference = ""
    async with judge_up(server, judge), scorer_up(server, run, "scorer-a", PATIENT_BUS) as scorer:
        for t in [*trajs, no_reference]:
            await bus.publish(js, run, "traj", t)
        assert await wait_for_count(js, run, "scored", len(trajs)) == len(trajs)
        assert await wait_for_count(js, run, "dead", 1, timeout=10) == 1

    by_id = {s.traj_id: s for s in await stream_messages(js, run, "scored")}
    assert sorted(by_id) == sorted(t.traj_id for t in trajs)
    for t in trajs:
        s = by_id[t.traj_id]
        assert s.trajectory == t and s.scorer == "scorer-a" and s.judge_model == str(judge.backend.model_name)
        assert set(s.metrics) == {"bleu", "interactivity", "token_amount"} and s.weights == default_weights()
        assert 0.0 <= s.metrics["bleu"] <= 1.0
        n_conv = len(t.futures) or 1
        # interactivity is a mean of levels/9 over the judged conversations
        assert round(s.metrics["interactivity"] * 9 * n_conv, 6) == int(round(s.metrics["interactivity"] * 9 * n_conv))
        expected_tokens = (t.assistant_tokens + 150) / 1000 if t.futures else t.assistant_tokens / 1000
        assert s.metrics["token_amount"] == pytest.approx(expected_tokens)
        assert s.total == pytest.approx(total_reward(s.metrics, s.weights))
        assert [o.op for o in s.judge] == ["extract", "interactivity"] * n_conv
        assert all(o.ok and o.raw.startswith("{") for o in s.judge)
        assert s.timings["total"] > 0 and s.created > 0
    [dead] = await stream_messages(js, run, "dead")
    assert "no reference document" in dead.reason and dead.subject == topology.subject(run, "traj")
    assert scorer.counters["scored"] == len(trajs) and scorer.counters["unscorable"] == 1


async def test_trajectories_wait_while_the_judge_is_down(server, judge, nc):
    run = "e2e-outage"
    js = nc.jetstream()
    await topology.ensure_topology(js, run, PATIENT_BUS)
    trajs = trajectories(run, 3)
    async with scorer_up(server, run, "scorer-a", PATIENT_BUS) as scorer:
        for t in trajs:
            await bus.publish(js, run, "traj", t)
        # No judge: every request finds no responders; the trajectories are held and asked again
        # with back-off, without spending their deliveries.
        deadline = time.monotonic() + 20
        while scorer.counters["judge_wait"] < 2 * len(trajs) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert scorer.counters["judge_wait"] >= 2 * len(trajs)
        assert (await js.stream_info(topology.stream_name(run, "scored"))).state.messages == 0

        async with judge_up(server, judge):
            assert await wait_for_count(js, run, "scored", len(trajs)) == len(trajs)
    scored = await stream_messages(js, run, "scored")
    assert sorted(s.traj_id for s in scored) == sorted(t.traj_id for t in trajs)
    assert (await js.stream_info(topology.stream_name(run, "dead"))).state.messages == 0
    # Waited out in place: no delivery was spent on the outage.
    assert scorer.counters["scored"] == len(trajs) and scorer.counters["judge_retry"] == 0


async def test_a_long_outage_hands_trajectories_back_and_they_are_scored_later(server, judge, nc):
    run = "e2e-long-outage"
    js = nc.jetstream()
    await topology.ensure_topology(js, run, PATIENT_BUS)
    trajs = trajectories(run, 2)
    impatient = msgspec.structs.replace(SCORER_CFG, judge_wait_s=0.5)
    async with scorer_up(server, run, "scorer-a", PATIENT_BUS, impatient) as scorer:
        for t in trajs:
            await bus.publish(js, run, "traj", t)
        # Past judge_wait_s each trajectory is nak'ed with back-off (one delivery spent) and comes back.
        deadline = time.monotonic() + 20
        while scorer.counters["judge_retry"] < 2 * len(trajs) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert scorer.counters["judge_retry"] >= 2 * len(trajs)
        async with judge_up(server, judge):
            assert await wait_for_count(js, run, "scored", len(trajs)) == len(trajs)
    assert (await js.stream_info(topology.stream_name(run, "dead"))).state.messages == 0
    assert sorted(s.traj_id for s in await stream_messages(js, run, "scored")) == sorted(t.traj_id for t in trajs)


async def test_two_scorers_score_every_trajectory_exactly_once(server, judge, nc, tmp_path):
    run = "e2e-two"
    js = nc.jetstream()
    small_bus = topology.BusSettings(max_bytes=64 * 2**20)  # what the command below resolves too
    await topology.ensure_topology(js, run, small_bus)
    trajs = trajectories(run, 12)
    parley = Path(sys.executable).with_name("parley")
    log_file = tmp_path / "scorer-b.log"
    cmd = [
        str(parley),
        "scorer",
        "--nats",
        server.url,
        "--run",
        run,
        "--id",
        "scorer-b",
        "--concurrency",
        "2",
        "--set",
        "scorer.retry_delay_s=0.5",
        "--set",
        "scorer.retry_max_delay_s=1.0",
        *SMALL,
    ]
    with open(log_file, "w") as log:
        other = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PARLEY_LOG": "INFO"})
    try:
        async with judge_up(server, judge), scorer_up(server, run, "scorer-a", small_bus) as scorer:
            for t in trajs:
                await bus.publish(js, run, "traj", t)
            # A republished trajectory (an actor retrying a timed-out publish) is stored once.
            again = await bus.publish(js, run, "traj", trajs[0])
            assert again.duplicate
            assert await wait_for_count(js, run, "scored", len(trajs)) == len(trajs)
            await asyncio.sleep(1.0)  # anything scored twice would show up now
    finally:
        other.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(other.wait, 30)
    output = log_file.read_text()
    assert code == 0, output[-3000:]

    scored = await stream_messages(js, run, "scored")
    ids = [s.traj_id for s in scored]
    assert len(ids) == len(set(ids)) == len(trajs), ids
    assert set(ids) == {t.traj_id for t in trajs}
    by_scorer = {name: sum(s.scorer == name for s in scored) for name in ("scorer-a", "scorer-b")}
    assert by_scorer["scorer-a"] == scorer.counters["scored"]
    assert by_scorer["scorer-a"] > 0 and by_scorer["scorer-b"] > 0, (by_scorer, output[-3000:])
    assert (await js.stream_info(topology.stream_name(run, "dead"))).state.messages == 0
