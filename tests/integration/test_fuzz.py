"""Bad input on every subject, against the real role processes: nothing crashes, and every bad
message is accounted for.

One set of processes serves every case (engine start-up dominates): a real nats-server, `parley
services` (user simulator + judge on one toy-model engine), `parley actor` and `parley scorer`
on run "fuzz", and `parley learner` on run "fuzzl" (its own run, so its task feeder drives no
traffic here). Each stream consumer (actor on TASKS, scorer on TRAJ, learner on SCORED) gets
garbage, truncated, wrong-schema, just-under-the-size-limit and semantically impossible
messages: each must land in the DEAD stream with a reason and be counted in the role's heartbeat.
Messages over max_payload are refused at publish. The services answer malformed requests with an
error reply and count them. The actor refuses weight announcements whose blob does not match
(sha256, size, missing object, unknown transport, a backwards version with a bad hash) and counts
an undecodable announcement. At the end every role still does its real work.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import nats.errors
import pytest
import pytest_asyncio

from parley.deploy.natsserver import NatsServer
from parley.protocol import codec, examples, topology
from parley.protocol.connect import barrier, connect
from parley.protocol.messages import (
    ChatMessage,
    DeadLetter,
    Heartbeat,
    JudgeReply,
    JudgeRequest,
    Scored,
    SimReply,
    SimRequest,
)
from tests import factories

pytestmark = [
    pytest.mark.integration,
    pytest.mark.e2e,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

REPO = Path(__file__).resolve().parents[2]
RUN, LRUN = "fuzz", "fuzzl"  # actor + scorer + services; the learner on its own run
BUS = topology.BusSettings(max_bytes=64 * 2**20, ack_wait_s=10.0)
CONSUMER_OF = {"tasks": (RUN, "actor"), "traj": (RUN, "scorer"), "scored": (LRUN, "learner")}


class System:
    """The processes under test, their logs, and the latest heartbeat of every role."""

    def __init__(self, root: Path):
        self.root = root
        self.server: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.beats: dict[tuple[str, str], Heartbeat] = {}
        self.nc = self.js = None

    def start(self, name: str, argv: list[str]) -> None:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        with log.open("ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "parley.deploy.cli", *argv],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PARLEY_LOG": "INFO", "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    def tail(self, name: str, chars: int = 3000) -> str:
        return self.logs[name].read_text(errors="replace")[-chars:]

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def beat(self, role: str) -> Heartbeat | None:
        found = [hb for (r, _), hb in self.beats.items() if r == role]
        return max(found, key=lambda hb: hb.created) if found else None

    def counter(self, role: str, key: str) -> float:
        hb = self.beat(role)
        return hb.counters.get(key, 0.0) if hb else 0.0

    def dead(self, role: str, key: str) -> float:
        """Messages of channel `key` the role dead-lettered, whatever the cause (dead.<key>.<cause>)."""
        hb = self.beat(role)
        return sum(v for k, v in hb.counters.items() if k.startswith(f"dead.{key}.")) if hb else 0.0

    async def wait(self, pred, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            self.check_alive()
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.25)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def system(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("fuzz")
    s = System(root)
    s.server = NatsServer(root / "nats", port=0)
    url = s.server.start()
    s.nc = await connect(url, name="pytest-fuzz")
    s.js = s.nc.jetstream()
    for run in (RUN, LRUN):
        await topology.ensure_topology(s.js, run, BUS)

    async def on_beat(msg):
        hb = codec.decode("status", msg.data)
        s.beats[(hb.role, hb.id)] = hb

    for run in (RUN, LRUN):
        await s.nc.subscribe(topology.status_subject(run, "*", "*"), cb=on_beat)
    await barrier(s.nc)

    model = str(tiny_model)

    def engine(section: str, length: int) -> list[str]:
        return [
            f'{section}.model="{model}"',
            f"{section}.max_model_len={length}",
            f"{section}.kv_cache_bytes={128 * 2**20}",
        ]

    common = [f"bus.max_bytes={BUS.max_bytes}", f"bus.ack_wait_s={BUS.ack_wait_s}", f'run.dir="{root / "run"}"']
    roles = {  # name: (command and options, config overrides)
        "services": (
            ["services", "--run", RUN, "--id", "svc"],
            [
                *engine("sim.engine", 1536),
                *engine("judge.engine", 1536),
                "judge.max_tokens=256",
                "sim.max_tokens=48",
                "sim.max_retries=1",
            ],
        ),
        "actor": (
            ["actor", "--run", RUN, "--id", "actor-f"],
            [
                *engine("actor.engine", 1024),
                "actor.concurrency=4",
                "actor.weights_poll_s=0.5",
                "actor.sim_timeout_s=60",
            ],
        ),
        "scorer": (
            ["scorer", "--run", RUN, "--id", "scorer-f"],
            ["scorer.retry_delay_s=1", "scorer.retry_max_delay_s=2", "scorer.judge_timeout_s=60"],
        ),
        "learner": (
            ["learner", "--run", LRUN],
            [
                f'policy.model="{model}"',
                "rollout.n=2",
                "learner.groups_per_step=1",
                "learner.micro_batch_tokens=256",
                "learner.steps=0",
                "learner.accept_foreign_scored=true",  # the fuzzed samples reach the content checks
                f'run.dir="{root / "learner"}"',
            ],
        ),
    }
    for name, (argv, sets) in roles.items():
        s.start(name, [*argv, "--nats", url, *(x for kv in [*common, *sets] for x in ("--set", kv))])
    try:
        want = ("actor", "scorer", "sim", "judge", "learner")
        await s.wait(
            lambda: all((hb := s.beat(r)) is not None and hb.state in ("ready", "busy") for r in want),
            "every role to report ready",
            timeout=300,
        )
        yield s
    finally:
        s.stop()
        await s.nc.close()
        s.server.stop()


# -- the stream consumers -------------------------------------------------------------------------


def _valid(key: str, run: str):
    return {
        "tasks": examples.task(run, "t-valid"),
        "traj": examples.trajectory(run, "t-valid"),
        "scored": examples.scored(run),
    }[key]


def fuzz_payloads(key: str, run: str, max_payload: int) -> dict[str, bytes]:
    """Bad messages for channel `key`, by name. Every payload is distinct (dead letters dedupe by content)."""
    rng = random.Random(f"fuzz-{key}")
    good = codec.encode(_valid(key, run))
    other = {"tasks": examples.trajectory(run), "traj": examples.task(run), "scored": examples.task(run)}[key]
    cases = {
        "empty": b"",
        "garbage": rng.randbytes(97),
        "reserved-byte": b"\xc1" + key.encode(),
        "json-text": b'{"channel": "%s", "hello": 1}' % key.encode(),
        "truncated": good[: len(good) // 2],
        "truncated-by-one": good[:-1],
        "other-type": codec.encode(other),
        "wrong-field-types": msgspec.msgpack.encode({"task_id": 5, "traj_id": [], "run": {"x": 1}, "n": "four"}),
        # The largest message the server accepts, all junk: the dead letter must still fit.
        "near-limit-junk": rng.randbytes(max_payload - 1024),
    }
    # Valid wire format, impossible content: each role's own checks reject these as poison.
    if key == "tasks":
        cases["bad-mode"] = codec.encode(msgspec.structs.replace(examples.task(run, "t-mode"), mode="monologue"))
        cases["zero-samples"] = codec.encode(msgspec.structs.replace(examples.task(run, "t-n0"), n=0))
        cases["other-run"] = codec.encode(examples.task("someone-else", "t-run"))
    elif key == "traj":
        cases["no-reference"] = codec.encode(msgspec.structs.replace(examples.trajectory(run, "t-ref"), reference=""))
    else:
        bad = examples.scored(run)
        bad.traj_id, bad.trajectory.loss_mask_u8 = "t-mask/0", bad.trajectory.loss_mask_u8[:-1]
        cases["mask-mismatch"] = codec.encode(bad)
        far = examples.scored(run)
        far.traj_id, far.task_id, far.sample = "t-far/99", "t-far", 99
        cases["sample-out-of-range"] = codec.encode(far)
    return cases


def _matches(dl: DeadLetter, payload: bytes) -> bool:
    if dl.payload == payload:
        return True
    # A near-limit payload is kept cut, with the whole one's digest in the reason.
    return (
        len(dl.payload) < len(payload)
        and payload.startswith(dl.payload)
        and hashlib.sha256(payload).hexdigest() in dl.reason
    )


async def dead_letters(js, run: str) -> list[DeadLetter]:
    stream = topology.stream_name(run, "dead")
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1 if info.state.messages else 0):
        try:
            out.append(codec.decode("dead", (await js.get_msg(stream, seq)).data))
        except Exception:  # noqa: BLE001 - a deleted sequence
            continue
    return out


async def test_oversized_messages_are_refused_at_publish(system):
    big = b"\x00" * (system.nc.max_payload + 1)
    for key in ("tasks", "traj", "scored", "dead"):
        with pytest.raises(nats.errors.MaxPayloadError):
            await system.js.publish(topology.subject(RUN, key), big)
    with pytest.raises(nats.errors.MaxPayloadError):
        await system.nc.request(topology.SIM_SUBJECT, big, timeout=5)
    with pytest.raises(nats.errors.MaxPayloadError):
        await system.nc.request(topology.judge_subject("extract"), big, timeout=5)
    assert system.nc.is_connected  # refused client-side; the connection is fine


async def test_bad_messages_are_dead_lettered_with_reasons_and_counted(system):
    s = system
    sent: dict[tuple[str, str], bytes] = {}
    before = {key: s.dead(role, key) for key, (_, role) in CONSUMER_OF.items()}
    for key, (run, _) in CONSUMER_OF.items():
        for name, payload in fuzz_payloads(key, run, s.nc.max_payload).items():
            await s.js.publish(topology.subject(run, key), payload, timeout=30)
            sent[(key, name)] = payload

    found: dict[tuple[str, str], DeadLetter] = {}

    async def collect():
        letters = {run: await dead_letters(s.js, run) for run in (RUN, LRUN)}
        for (key, name), payload in sent.items():
            run, _ = CONSUMER_OF[key]
            for dl in letters[run]:
                if dl.subject == topology.subject(run, key) and _matches(dl, payload):
                    found[(key, name)] = dl

    deadline = time.monotonic() + 90
    while len(found) < len(sent):
        s.check_alive()
        if time.monotonic() > deadline:
            missing = sorted(set(sent) - set(found))
            pytest.fail(f"not dead-lettered after 90s: {missing}")
        await asyncio.sleep(1.0)
        await collect()

    idents = {"tasks": "actor-f", "traj": "scorer-f", "scored": "learner-"}
    for (key, name), dl in found.items():
        assert dl.reason.strip(), (key, name)
        assert dl.consumer.startswith(idents[key]), (key, name, dl.consumer)
        # garbage fails at decode; well-formed but impossible messages are refused by the role, saying why
        expect = {
            "bad-mode": "mode=",
            "zero-samples": "n=0",
            "other-run": "someone-else",
            "no-reference": "reference",
            "mask-mismatch": "loss_mask",
            "sample-out-of-range": "sample index 99",
        }.get(name, "decode error")
        assert expect in dl.reason, (key, name, dl.reason)
        if name == "near-limit-junk":
            assert "cut to its first" in dl.reason

    # Counted in each role's heartbeat, and nothing is left pending or unacknowledged.
    for key, (run, role) in CONSUMER_OF.items():
        n = sum(1 for k, _ in sent if k == key)
        await s.wait(lambda: s.dead(role, key) >= before[key] + n, f"{role} heartbeat to count {n} dead.{key}")
        durable = topology.CHANNELS[key].durable

        async def drained():
            info = await s.js.consumer_info(topology.stream_name(run, key), durable)
            return info.num_pending == 0 and info.num_ack_pending == 0

        deadline = time.monotonic() + 30
        while not await drained():
            assert time.monotonic() < deadline, f"{durable} on {key} still has pending messages"
            await asyncio.sleep(0.5)


# -- the request/reply services -------------------------------------------------------------------


async def test_model_output_with_lone_surrogates_still_makes_a_reply():
    """Bad input from the model side: a JSON "\\udxxx" escape decodes to a lone surrogate, which
    msgpack cannot encode; the judge used to fail the whole reply on it (seen under the fault suite)."""
    from parley.services.judge.server import parse_verdict
    from parley.services.sim.server import parse_reply

    reply = parse_verdict("extract", '{"document": "Dear Ann,\\udeea thanks"}')
    assert codec.decode("judge.reply", codec.encode(reply)).document == "Dear Ann,? thanks"
    message, done = parse_reply('{"message": "make it \\ud800shorter", "done": false}')
    assert codec.decode("sim.reply", codec.encode(SimReply(message=message, done=done))).message == "make it ?shorter"


async def test_services_answer_malformed_requests_with_an_error(system):
    s = system
    rng = random.Random("fuzz-services")
    convo = [ChatMessage("user", "Help me write a note."), ChatMessage("assistant", "Sure, to whom?")]
    sim_ok = codec.encode(SimRequest(prompt="lazy_full", messages=convo, reference="Dear Ann, thanks.", max_tokens=16))
    judge_ok = codec.encode(JudgeRequest(op="extract", messages=convo))
    near_limit = rng.randbytes(s.nc.max_payload - 1024)
    sim_bad = {
        "empty": b"",
        "garbage": rng.randbytes(64),
        "truncated": sim_ok[: len(sim_ok) // 2],
        "judge-request": judge_ok,
        "unknown-variant": codec.encode(SimRequest(prompt="shouty", messages=convo)),
        "path-variant": codec.encode(SimRequest(prompt="../../etc/passwd", messages=convo)),
        "near-limit-junk": near_limit,
    }
    judge_bad = {
        "empty": b"",
        "garbage": rng.randbytes(64),
        "truncated": judge_ok[: len(judge_ok) // 2],
        "sim-request": codec.encode(SimRequest(prompt="lazy_full", messages=convo)),
        "near-limit-junk": near_limit,
    }
    sim_before, judge_before = s.counter("sim", "bad_request"), s.counter("judge", "bad_request")

    # A request nobody waits for (no reply subject) must not hurt either service.
    await s.nc.publish(topology.SIM_SUBJECT, rng.randbytes(50))
    await s.nc.publish(topology.judge_subject("interactivity"), rng.randbytes(50))

    for name, data in sim_bad.items():
        reply = codec.decode("sim.reply", (await s.nc.request(topology.SIM_SUBJECT, data, timeout=60)).data)
        assert isinstance(reply, SimReply) and reply.fallback, name
        assert reply.error.startswith("bad request"), (name, reply.error)
    for name, data in judge_bad.items():
        for op in topology.JUDGE_OPS:
            reply = codec.decode("judge.reply", (await s.nc.request(topology.judge_subject(op), data, timeout=60)).data)
            assert isinstance(reply, JudgeReply) and not reply.ok, (name, op)
            assert "not a JudgeRequest" in reply.error, (name, op, reply.error)
    # An op that does not match its subject is refused, not judged.
    wrong_op = codec.encode(JudgeRequest(op="interactivity", messages=convo))
    answer = await s.nc.request(topology.judge_subject("extract"), wrong_op, timeout=60)
    reply = codec.decode("judge.reply", answer.data)
    assert not reply.ok and "request op" in reply.error

    n_sim = 1 + len(sim_bad)  # +1: the request with no reply subject
    await s.wait(
        lambda: s.counter("sim", "bad_request") >= sim_before + n_sim, f"sim heartbeat to count {n_sim} bad requests"
    )
    n_judge = 1 + len(topology.JUDGE_OPS) * len(judge_bad)
    await s.wait(
        lambda: s.counter("judge", "bad_request") >= judge_before + n_judge,
        f"judge heartbeat to count {n_judge} bad requests",
    )

    # Both still serve a good request.
    reply = codec.decode("sim.reply", (await s.nc.request(topology.SIM_SUBJECT, sim_ok, timeout=120)).data)
    assert not reply.error.startswith("bad request"), reply.error
    answer = await s.nc.request(topology.judge_subject("extract"), judge_ok, timeout=120)
    reply = codec.decode("judge.reply", answer.data)
    assert "not a JudgeRequest" not in reply.error and reply.model


# -- weight announcements -------------------------------------------------------------------------


async def test_bad_weight_announcements_are_refused_and_counted(system, tiny_model, tmp_path):
    from parley.weights.common import forget_writes
    from parley.weights.config import ObjstoreWeights
    from parley.weights.registry import publish_version

    s = system
    kv = await s.js.key_value(topology.kv_bucket(RUN))
    blob = tmp_path / "blob"
    blob.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(Path(tiny_model) / name, blob / name)

    def actor_version() -> int:
        hb = s.beat("actor")
        return hb.version if hb else -99

    # 1. Not a WeightVersion at all: logged and counted, nothing loaded.
    await kv.put(topology.WEIGHTS_KEY, b"\x93not a weight version")
    await s.wait(lambda: s.counter("actor", "weights.undecodable") >= 1, "the actor to count the undecodable value")

    # 2. A good version is served (publishing over the junk works too).
    good = await publish_version(s.js, RUN, 3, 3, blob, ObjstoreWeights(), keep=8)
    await s.wait(lambda: actor_version() == 3, "the actor to serve version 3")

    # 3. Announcements whose blob does not match are refused one by one; version 3 stays served.
    bad = [
        msgspec.structs.replace(good, version=4, sha256="0" * 64),  # wrong hash
        msgspec.structs.replace(good, version=5, bytes=good.bytes + 1),  # wrong size
        msgspec.structs.replace(good, version=6, location="v999999/model.safetensors"),  # no such object
        msgspec.structs.replace(good, version=7, transport="carrier-pigeon"),  # unknown transport
        msgspec.structs.replace(good, version=2, sha256="f" * 64),  # backwards, and not what the blob holds
    ]
    for i, wv in enumerate(bad, start=1):
        await kv.put(topology.WEIGHTS_KEY, codec.encode(wv))
        await s.wait(
            lambda i=i: s.counter("actor", "refused_versions") >= i,
            f"the actor to refuse version {wv.version} ({i} refused)",
        )
        assert actor_version() == 3
    assert s.procs["actor"].poll() is None
    log = s.tail("actor", 200_000)
    for wv in bad:
        assert f"refused weights version {wv.version}" in log

    # 4. Backwards with a verified blob is what a resumed learner announces: followed, with a warning.
    # A resumed learner's first announcement reads the key (weights.common.forget_writes, as
    # learner.service does at start); the fuzzer's puts above would fence out the writer of version 3.
    forget_writes(s.js, RUN)
    await publish_version(s.js, RUN, 1, 1, blob, ObjstoreWeights(), keep=8)
    await s.wait(lambda: actor_version() == 1, "the actor to follow the verified version 1 back")
    assert "moved back from version 3 to 1" in s.tail("actor", 200_000)


# -- still alive, still working -------------------------------------------------------------------


def _tiny_scored(run: str, task: str, sample: int) -> Scored:
    traj = factories.trajectory(
        run,
        task,
        sample,
        item_id="fuzz-item",
        messages=[("user", "hi"), ("assistant", "hello")],
        token_ids=[5, 6, 7, 8, 9],
        loss_mask=[0, 0, 1, 1, 1],
        turns=[factories.turn(2, [-1.0, -2.0, -0.5])],
        reference="hello",
    )
    return factories.scored(traj, {"bleu": 0.5})


async def test_every_role_still_works_after_the_fuzz(system):
    from parley.protocol.bus import publish

    s = system
    s.check_alive()
    # actor -> simulator -> trajectory -> scorer -> judge -> Scored, for a real task
    task = msgspec.structs.replace(examples.task(RUN, "t-alive"), n=2, max_new_turns=2, max_tokens=16, seed=7)
    await publish(s.js, RUN, "tasks", task)
    stream = topology.stream_name(RUN, "scored")

    async def scored_ids() -> set[str]:
        info = await s.js.stream_info(stream)
        out = set()
        for seq in range(info.state.first_seq, info.state.last_seq + 1 if info.state.messages else 0):
            out.add(codec.decode("scored", (await s.js.get_msg(stream, seq)).data).traj_id)
        return out

    deadline = time.monotonic() + 180
    while not {"t-alive/0", "t-alive/1"} <= await scored_ids():
        s.check_alive()
        assert time.monotonic() < deadline, "the valid task was not played and scored within 180s"
        await asyncio.sleep(1.0)

    # the learner still takes a valid sample into its buffer
    await publish(s.js, LRUN, "scored", _tiny_scored(LRUN, "t-alive", 0))
    await s.wait(lambda: s.counter("learner", "buffered_groups") >= 1, "the learner to buffer a valid sample")

    s.check_alive()
    for name in s.procs:
        log = s.tail(name, 2_000_000)
        assert "Task exception was never retrieved" not in log, f"{name} lost a crash:\n{log[-3000:]}"
        assert "Traceback" not in log, f"{name} logged a traceback:\n{log[-3000:]}"
