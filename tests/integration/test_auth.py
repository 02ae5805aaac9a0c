"""Access control against a real nats-server: per-role users from deploy/credentials.py, with
the permissions of deploy/permissions.py.

Anonymous and wrong-password clients are refused; an actor cannot announce weights or publish
scores; a scorer cannot publish or take tasks; every role can do its own job with its own user,
both with run-scoped users and with users valid for every run (run="*").
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess

import nats.errors
import pytest

from parley.deploy.credentials import generate_credentials, read_env_file, server_auth_conf
from parley.deploy.natsserver import NatsServer
from parley.deploy.permissions import DEAD_LETTERERS, ROLES, role_permissions
from parley.protocol import codec, examples, status, topology
from parley.protocol.bus import PullWorker, dead_letter, publish
from parley.protocol.connect import NatsUnreachable, barrier, connect, inbox_prefix
from parley.protocol.messages import Heartbeat, JudgeReply, JudgeRequest, SimReply, SimRequest, WeightVersion
from parley.weights.common import current_version
from parley.weights.config import ObjstoreWeights
from parley.weights.registry import fetch_version, publish_version
from tests import factories

pytestmark = pytest.mark.integration
RUN = "authrun"
FAST = topology.BusSettings(ack_wait_s=5.0, max_deliver=3)


class Secured:
    def __init__(self, server: NatsServer, creds: dict, auth_dir):
        self.server, self.creds, self.auth_dir = server, creds, auth_dir

    async def connect(self, role: str):
        user, password = self.creds[role]
        return await connect(self.server.url, name=role, user=user, password=password, first_timeout=5)


def _secured_server(tmp_path_factory, cred_run: str):
    d = tmp_path_factory.mktemp(f"auth-{'any' if cred_run == '*' else cred_run}")
    creds = generate_credentials(cred_run, d / "auth")
    server = NatsServer(d / "nats", port=0, extra_conf=server_auth_conf(creds))
    server.start()
    return Secured(server, creds, d / "auth")


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    s = _secured_server(tmp_path_factory, RUN)
    yield s
    s.server.stop()


@pytest.fixture(scope="module")
def secured_any_run(tmp_path_factory):
    s = _secured_server(tmp_path_factory, "*")
    yield s
    s.server.stop()


def violations(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage().lower()]


def test_generated_credentials_are_private_files(secured):
    for name in ["auth.conf", *(f"{role}.env" for role in ROLES)]:
        mode = stat.S_IMODE(os.stat(secured.auth_dir / name).st_mode)
        assert mode == 0o600, f"{name} has mode {oct(mode)}"
    env = read_env_file(secured.auth_dir / "actor.env")
    assert (env["PARLEY_NATS_USER"], env["PARLEY_NATS_PASSWORD"]) == secured.creds["actor"]
    assert len({pw for _, pw in secured.creds.values()}) == len(ROLES)  # a fresh password per role


def test_server_config_with_passwords_is_private(secured, tmp_path):
    """`parley up` hands server_auth_conf to NatsServer, which writes it into RUN_DIR/nats/nats-server.conf."""
    conf = secured.server.store_dir / "nats-server.conf"
    # Only bcrypt hashes of the passwords: the plaintext is in the roles' .env files alone.
    for name in (conf, secured.auth_dir / "auth.conf"):
        text = name.read_text()
        assert not any(password in text for _, password in secured.creds.values()), name
        assert text.count('password: "$2b$10$') == len(secured.creds), name
    assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
    # A config left behind world-readable by an older version is made private when rewritten.
    again = NatsServer(tmp_path / "nats", extra_conf=server_auth_conf(secured.creds))
    (tmp_path / "nats").mkdir()
    (tmp_path / "nats" / "nats-server.conf").write_text("old")
    os.chmod(tmp_path / "nats" / "nats-server.conf", 0o644)
    assert stat.S_IMODE(os.stat(again.write_config()).st_mode) == 0o600


def test_permissions_are_derived_from_the_topology():
    perms = role_permissions(RUN)
    pub = {role: set(p["publish"]["allow"]) for role, p in perms.items()}
    assert topology.subject(RUN, "traj") in pub["actor"] and topology.subject(RUN, "scored") not in pub["actor"]
    assert topology.subject(RUN, "tasks") in pub["learner"] and topology.subject(RUN, "tasks") not in pub["scorer"]
    assert not any(s.startswith(f"$KV.{topology.kv_bucket(RUN)}") for s in pub["actor"] | pub["scorer"])
    for role in set(ROLES) - {"admin"}:  # only the consuming roles dead-letter (the learner acts on letters)
        assert ">" not in pub[role]
        assert (topology.subject(RUN, "dead") in pub[role]) == (role in DEAD_LETTERERS), role
        assert not any(s.startswith(("$JS.API.STREAM.CREATE", "$JS.API.CONSUMER.CREATE")) for s in pub[role]), role
    assert perms["sim"]["allow_responses"] and "_INBOX.>" not in pub["sim"]
    for role in set(ROLES) - {"admin"}:  # each its own inboxes, nobody every inbox
        assert f"{inbox_prefix(f'parley-{RUN}-{role}')}.>" in perms[role]["subscribe"]["allow"]
        assert not any(s.startswith("_INBOX.") or s == ">" for s in perms[role]["subscribe"]["allow"])
    anyrun = role_permissions("*")
    assert "parley.*.traj" in anyrun["actor"]["publish"]["allow"]


async def test_anonymous_and_wrong_password_are_refused(secured, monkeypatch):
    for var in ("PARLEY_NATS_USER", "PARLEY_NATS_PASSWORD", "PARLEY_NATS_CREDS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(NatsUnreachable, match="authorization violation"):
        await connect(secured.server.url, name="anonymous", first_timeout=2)
    user, _ = secured.creds["actor"]
    with pytest.raises(NatsUnreachable, match="authorization violation"):
        await connect(secured.server.url, name="guesser", user=user, password="not-the-password", first_timeout=2)


async def test_actor_cannot_announce_weights_or_publish_scores(secured, tmp_path, caplog):
    admin = await secured.connect("admin")
    actor = await secured.connect("actor")
    try:
        await topology.ensure_topology(admin.jetstream(), RUN, FAST)
        kv_admin = await admin.jetstream().key_value(topology.kv_bucket(RUN))
        wv = WeightVersion(version=0, step=0, transport="objstore", location="v0", sha256="0", bytes=0, created=0.0)
        announced = codec.encode(wv)
        await kv_admin.put(topology.WEIGHTS_KEY, announced)

        js = actor.jetstream(timeout=1.0)  # a denied request just goes unanswered
        kv = await js.key_value(topology.kv_bucket(RUN))  # reading is allowed
        with pytest.raises(nats.errors.TimeoutError):
            await kv.put(topology.WEIGHTS_KEY, b"forged")
        assert (await kv.get(topology.WEIGHTS_KEY)).value == announced

        store = await js.object_store(topology.object_bucket(RUN))
        with pytest.raises(nats.errors.TimeoutError):
            await store.put("v999999/model.safetensors", b"forged weights")

        scored = factories.scored(factories.trajectory(RUN, "t", 0), {}, total=1e9)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(topology.subject(RUN, "scored"), codec.encode(scored), timeout=1.0)
        with pytest.raises(topology.TopologyError, match="no answer"):  # may not loosen the streams either
            await topology.ensure_topology(js, RUN, topology.BusSettings(ack_wait_s=600.0))

        info = await admin.jetstream().stream_info(topology.stream_name(RUN, "scored"))
        assert info.state.messages == 0
        denied = " ".join(violations(caplog)).lower()
        assert f"$kv.{topology.kv_bucket(RUN)}.current".lower() in denied
        assert topology.subject(RUN, "scored") in denied
        assert "stream.update" in denied or "consumer" in denied
    finally:
        await actor.close()
        await admin.close()


async def test_scorer_cannot_publish_or_take_tasks(secured, caplog):
    admin = await secured.connect("admin")
    scorer = await secured.connect("scorer")
    try:
        await topology.ensure_topology(admin.jetstream(), RUN, FAST)
        before = (await admin.jetstream().stream_info(topology.stream_name(RUN, "tasks"))).state.messages
        js = scorer.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(topology.subject(RUN, "tasks"), codec.encode(examples.task(RUN, "forged")), timeout=1.0)
        sub = await js.pull_subscribe_bind("actor", stream=topology.stream_name(RUN, "tasks"))
        with pytest.raises(nats.errors.TimeoutError):
            await sub.fetch(1, timeout=1.0)
        after = (await admin.jetstream().stream_info(topology.stream_name(RUN, "tasks"))).state.messages
        assert after == before
        denied = " ".join(violations(caplog))
        assert topology.subject(RUN, "tasks") in denied and "msg.next" in denied.lower()
    finally:
        await scorer.close()
        await admin.close()


@pytest.mark.parametrize("which", ["run-scoped", "every-run"])
async def test_no_role_can_read_another_roles_inbox(which, request, caplog):
    """A scorer's judge reply and its pull deliveries arrive under its own inbox prefix; an actor (or the
    simulator user every run shares) subscribing to that prefix or to `_INBOX.>` is refused and sees nothing."""
    secured = request.getfixturevalue("secured" if which == "run-scoped" else "secured_any_run")
    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    conns = {role: await secured.connect(role) for role in ("scorer", "judge", "actor", "sim")}
    try:
        scorer_user = secured.creds["scorer"][0]
        assert conns["scorer"]._inbox_prefix.decode() == inbox_prefix(scorer_user)  # what connect() set
        spied = []

        async def spy(msg):
            spied.append(msg.subject)

        wanted = ["_INBOX.>", f"{inbox_prefix(scorer_user)}.>", ">"]
        for role in ("actor", "sim"):
            for subj in wanted:
                await conns[role].subscribe(subj, cb=spy)
            await barrier(conns[role])

        async def judge_cb(msg):
            await msg.respond(codec.encode(JudgeReply(ok=True, document="private")))

        await conns["judge"].subscribe(topology.judge_subject("extract"), queue=topology.JUDGE_QUEUE, cb=judge_cb)
        await barrier(conns["judge"])
        request_ = codec.encode(JudgeRequest(op="extract", messages=[]))
        reply = await conns["scorer"].request(topology.judge_subject("extract"), request_, timeout=5)
        assert codec.decode("judge.reply", reply.data).document == "private"
        assert reply.subject.startswith(inbox_prefix(scorer_user) + ".")
        for role in ("actor", "sim"):
            await barrier(conns[role])
        assert spied == []
        denied = " ".join(violations(caplog)).lower()
        for subj in wanted:
            assert f'subscription to "{subj.lower()}"' in denied, (subj, denied)
    finally:
        for nc in conns.values():
            await nc.close()


async def test_verify_only_names_what_is_missing(secured):
    admin = await secured.connect("admin")
    try:
        with pytest.raises(
            topology.TopologyError, match="stream PARLEY_never_made_TASKS of run 'never_made' does not exist"
        ):
            await topology.ensure_topology(admin.jetstream(), "never_made", create=False)
        await topology.ensure_topology(admin.jetstream(), RUN, FAST)
        await topology.ensure_topology(admin.jetstream(), RUN, FAST, create=False)
    finally:
        await admin.close()


@pytest.mark.parametrize("which", ["run-scoped", "every-run"])
async def test_every_role_can_do_its_job(which, request, tmp_path, caplog):
    """learner -> task -> actor (asks sim, reads weights) -> traj -> scorer (asks judge) -> scored -> learner."""
    secured = request.getfixturevalue("secured" if which == "run-scoped" else "secured_any_run")
    run = f"job_{which.replace('-', '_')}"
    if which == "run-scoped":
        run = RUN  # run-scoped users only see their own run
    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    conns = {role: await secured.connect(role) for role in ("learner", "actor", "scorer", "sim", "judge", "eval")}
    stop = asyncio.Event()
    try:
        learner = conns["learner"].jetstream()
        admin = await secured.connect("admin")
        try:  # the set-up credential makes the topology (`parley up`, `parley auth topology`)
            await topology.ensure_topology(admin.jetstream(), run, FAST)
        finally:
            await admin.close()
        for role in ("learner", "actor", "scorer", "eval"):  # the roles find it in place and change nothing
            await topology.ensure_topology(conns[role].jetstream(), run, FAST)

        # services answer on the requester's reply subject (allow_responses), nothing else
        async def sim_cb(msg):
            req = codec.decode("sim.request", msg.data)
            await msg.respond(codec.encode(SimReply(message=f"re: {req.messages[-1].content}")))

        async def judge_cb(msg):
            codec.decode("judge.request", msg.data)
            await msg.respond(codec.encode(JudgeReply(ok=True, document="the doc")))

        await conns["sim"].subscribe(topology.SIM_SUBJECT, queue=topology.SIM_QUEUE, cb=sim_cb)
        await conns["judge"].subscribe(topology.judge_subject("extract"), queue=topology.JUDGE_QUEUE, cb=judge_cb)
        for role in ("sim", "judge"):
            await barrier(conns[role])
            await status.send(conns[role], run, Heartbeat(role=role, id=f"{role}-0", state="ready"))

        # learner: weights (object store + KV, twice so that pruning deletes a version) and one task
        for v in (0, 1):
            state = tmp_path / f"state{v}"
            state.mkdir()
            (state / "model.safetensors").write_bytes(os.urandom(300_000))
            (state / "config.json").write_text('{"model_type": "qwen3"}')
            await publish_version(learner, run, v, step=v, state_dir=state, settings=ObjstoreWeights(), keep=1)
        await publish(learner, run, "tasks", examples.task(run, "job-1"))
        # a resumed learner reads back the tasks it published (Feeder.adopt_published, by sequence);
        # "job-1" is not one of a feeder's task ids, so none is adopted
        from parley.config.learner import RolloutConfig
        from parley.learner.feeder import Feeder
        from parley.tasks.data import load_items

        resumed = Feeder(learner, run, load_items()[:1], RolloutConfig(n=1), max_staleness=1, groups_per_step=1, seed=0)
        assert await resumed.adopt_published() == 0

        got = {}

        async def actor_handler(task, msg):
            js = conns["actor"].jetstream()
            wv = await current_version(js, run)
            weights = await fetch_version(js, run, wv, tmp_path / "actor-weights")
            # actors also hear the key's puts (weights/follow.py); the learner announces once more
            heard = asyncio.get_running_loop().create_future()

            async def on_put(m):
                if not heard.done():
                    heard.set_result(m.data)

            sub = await conns["actor"].subscribe(topology.weights_key_subject(run, topology.WEIGHTS_KEY), cb=on_put)
            await barrier(conns["actor"])
            kv = await learner.key_value(topology.kv_bucket(run))
            await kv.put(topology.WEIGHTS_KEY, (await kv.get(topology.WEIGHTS_KEY)).value)
            got["watched"] = codec.decode("weights", await asyncio.wait_for(heard, 5)).version
            await sub.unsubscribe()
            reply = await conns["actor"].request(
                topology.SIM_SUBJECT, codec.encode(SimRequest(prompt="lazy_full", messages=task.prefix)), timeout=5
            )
            got["sim"] = codec.decode("sim.reply", reply.data).message
            got["weights"] = (wv.version, (weights / "model.safetensors").stat().st_size)
            traj = examples.trajectory(run, task_id=task.task_id)
            await publish(js, run, "traj", traj)
            await dead_letter(js, run, subject=msg.subject, reason="permission test", consumer="actor", payload=b"x")
            await status.send(conns["actor"], run, Heartbeat(role="actor", id="actor-0", state="busy"))
            await msg.ack()

        async def scorer_handler(traj, msg):
            request = codec.encode(JudgeRequest(op="extract", messages=traj.messages))
            reply = await conns["scorer"].request(topology.judge_subject("extract"), request, timeout=5)
            doc = codec.decode("judge.reply", reply.data).document
            scored = factories.scored(traj, {"bleu": 0.5}, document=doc)
            await publish(conns["scorer"].jetstream(), run, "scored", scored)
            await msg.ack()

        async def learner_handler(scored, msg):
            got["scored"] = (scored.traj_id, scored.document)
            await msg.ack()
            stop.set()

        workers = [
            PullWorker(js, run, key, handler, bus=FAST, name=name, fetch_timeout=0.5)
            for js, key, handler, name in (
                (conns["actor"].jetstream(), "tasks", actor_handler, "actor"),
                (conns["scorer"].jetstream(), "traj", scorer_handler, "scorer"),
                (learner, "scored", learner_handler, "learner"),
            )
        ]
        await asyncio.wait_for(asyncio.gather(*(w.run_until(stop) for w in workers)), timeout=30)

        rec = examples.channel_examples(run)["eval"]
        await publish(conns["eval"].jetstream(), run, "eval", rec)

        # The learner reads the run's dead letters (the fates of the tasks it issued) and how full
        # every stream is (the backlog warning).
        from parley.protocol import backlog, dead

        letters, _ = await dead.read_since(learner, run, 0)
        assert len(letters) == 1
        assert set(await backlog.shares(learner, run)) >= {"tasks", "traj", "scored"}

        assert got["sim"] == "re: can you help me with a blog post"
        assert got["weights"] == (1, 300_000) and got["watched"] == 1
        assert got["scored"] == ("job-1/0", "the doc")
        admin = await secured.connect("admin")
        try:
            for key in ("tasks", "traj", "scored", "eval", "dead"):
                info = await admin.jetstream().stream_info(topology.stream_name(run, key))
                assert info.state.messages == 1, key
        finally:
            await admin.close()
        assert violations(caplog) == []
    finally:
        stop.set()
        for nc in conns.values():
            await nc.close()


async def test_services_may_answer_for_as_long_as_the_config_lets_requesters_wait(tmp_path, caplog):
    from parley.config.run import load_config
    from parley.deploy.permissions import response_window_s

    cfg = load_config(None, ["actor.sim_timeout_s=400", "scorer.judge_timeout_s=30"])
    assert response_window_s(cfg) >= 400
    defaults = load_config()
    assert response_window_s() >= max(defaults.actor.sim_timeout_s, defaults.scorer.judge_timeout_s) > 120
    creds = generate_credentials(RUN, tmp_path / "auth", response_window=response_window_s(cfg))
    assert f'"expires": "{response_window_s(cfg):.0f}s"' in (tmp_path / "auth" / "auth.conf").read_text()

    # The server holds a service to the window it is given: with 2 s, an answer after 3 s is refused.
    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    server = NatsServer(tmp_path / "nats", port=0, extra_conf=server_auth_conf(creds, response_window=2.0))
    server.start()
    sim = actor = None
    try:
        sim = await connect(server.url, name="sim", user=creds["sim"][0], password=creds["sim"][1])
        actor = await connect(server.url, name="actor", user=creds["actor"][0], password=creds["actor"][1])

        async def answer_after(msg):
            await asyncio.sleep(float(msg.data))
            await msg.respond(b"ok")

        async def receive(msg):  # answered in a task, so the slow answer does not hold up the next request
            asyncio.ensure_future(answer_after(msg))

        await sim.subscribe(topology.SIM_SUBJECT, cb=receive)
        await barrier(sim)
        assert (await actor.request(topology.SIM_SUBJECT, b"0.2", timeout=5)).data == b"ok"
        with pytest.raises(nats.errors.TimeoutError):
            await actor.request(topology.SIM_SUBJECT, b"3", timeout=5)
        assert any("publish to" in v.lower() for v in violations(caplog))
    finally:
        for nc in (sim, actor):
            if nc is not None:
                await nc.close()
        server.stop()


def make_tls(d) -> tuple[str, str, str]:
    """A throw-away CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    d.mkdir()

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=parley test CA",
    )
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    )
    return str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key")


async def test_tls_with_role_users(tmp_path, monkeypatch):
    """The optional TLS block of deploy/nats/*.conf, with PARLEY_NATS_CA on the client side."""
    ca, cert, key = make_tls(tmp_path / "tls")
    creds = generate_credentials(RUN, tmp_path / "auth")
    tls = f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n'
    server = NatsServer(tmp_path / "nats", port=0, extra_conf=server_auth_conf(creds) + tls)
    server.start()
    try:
        url = server.url.replace("nats://", "tls://")
        with pytest.raises(NatsUnreachable):  # a client that does not trust the CA gets nowhere
            await connect(url, name="untrusting", user=creds["actor"][0], password=creds["actor"][1], first_timeout=2)
        monkeypatch.setenv("PARLEY_NATS_CA", ca)
        admin = await connect(url, name="admin", user=creds["admin"][0], password=creds["admin"][1])
        actor = await connect(url, name="actor", user=creds["actor"][0], password=creds["actor"][1])
        try:
            await topology.ensure_topology(admin.jetstream(), RUN, FAST)
            await topology.ensure_topology(actor.jetstream(), RUN, FAST)
            ack = await publish(actor.jetstream(), RUN, "traj", examples.trajectory(RUN))
            assert ack.stream == topology.stream_name(RUN, "traj")
        finally:
            await actor.close()
            await admin.close()
    finally:
        server.stop()


async def test_the_reference_service_answers_the_scorer_and_nobody_else_may_ask_or_serve(secured, caplog):
    """[policy] reference = "service": the reference user serves its model's subject and
    answers the scorer; an actor may not ask it, and the judge user may not serve it."""
    from parley.protocol.messages import ReferenceReply, ReferenceRequest

    caplog.set_level(logging.WARNING, logger="parley.protocol.connect")
    conns = {role: await secured.connect(role) for role in ("scorer", "reference", "actor", "judge")}
    try:

        async def answer(msg):
            codec.decode("reference.request", msg.data)
            await msg.respond(codec.encode(ReferenceReply(ok=True, model="toy")))

        subject = topology.reference_subject("toy")
        await conns["reference"].subscribe(subject, queue=topology.REFERENCE_QUEUE, cb=answer)
        await conns["judge"].subscribe(subject, queue=topology.REFERENCE_QUEUE, cb=answer)
        for role in ("reference", "judge"):
            await barrier(conns[role])
        data = codec.encode(ReferenceRequest(model="toy", token_ids_i32=b"\x01\x00\x00\x00\x02\x00\x00\x00"))
        for _ in range(4):  # the judge's subscription was refused: every answer comes from the reference user
            reply = await conns["scorer"].request(subject, data, timeout=5)
            assert codec.decode("reference.reply", reply.data).ok
        await conns["actor"].publish(subject, data)
        await barrier(conns["actor"])
        denied = " ".join(violations(caplog)).lower()
        assert f'subscription to "{subject}"' in denied
        assert f'publish to "{subject}"' in denied
    finally:
        for nc in conns.values():
            await nc.close()


async def test_only_the_admin_can_change_a_runs_call_budget(secured, caplog, monkeypatch):
    """A running scorer (the real Scorer, its judge a test double behind its BudgetedJudge) and an actor's
    simulator budget hear the operator's BudgetUpdate on the run's control subject and apply their share
    (services.budget.follow_updates); neither role may publish one itself (a workload role would lift its
    own budget), so the server refuses theirs and nobody hears it. The operator's is sent as
    `parley auth budget` sends it (deploy/cli_auth.publish_budget), which says so when it is refused.
    (Users of every run: tests/unit/test_budget_update.py checks their table.)"""
    from parley.config.run import load_config
    from parley.config.scorer import ScorerConfig
    from parley.deploy.cli_auth import publish_budget
    from parley.protocol.messages import BudgetUpdate
    from parley.scorer.scorer import Scorer
    from parley.services.budget import BudgetedJudge, CallBudget, follow_updates

    class JudgeDouble:
        async def ask(self, op, messages, *, seed=0):
            return JudgeReply(ok=True, score=1.0)

    admin = await secured.connect("admin")
    await topology.ensure_topology(admin.jetstream(), RUN, FAST)
    await admin.close()
    actor, scorer = await secured.connect("actor"), await secured.connect("scorer")
    subject = topology.control_subject(RUN, "budget")
    stop = asyncio.Event()
    sim = CallBudget.of_run("sim_budget", 4, 0.0, processes=2)
    judge = CallBudget.of_run("judge_budget", 4, 0.0, processes=1)
    scoring = asyncio.create_task(
        Scorer(scorer, RUN, BudgetedJudge(JudgeDouble(), judge), ScorerConfig(), FAST, "scorer-t").run_until(
            stop, fetch_timeout=0.5
        )
    )
    try:
        await follow_updates(actor, RUN, "sim", sim)  # a subscription the server allows
        await barrier(actor)
        for _ in range(100):  # the scorer subscribes as it starts
            if any(sub.subject == subject for sub in scorer._subs.values()):
                break
            await asyncio.sleep(0.02)
        await barrier(scorer)

        forged = codec.encode(BudgetUpdate(sim_call_budget=10**6, judge_call_budget=10**6))
        for nc in (actor, scorer):
            await nc.publish(subject, forged)
            await barrier(nc)
        await asyncio.sleep(0.3)
        assert (sim.budget, judge.budget) == (2, 4)  # refused by the server: nobody heard it
        assert sum(subject in v for v in violations(caplog)) >= 2

        cfg = load_config(None, [f'nats.url="{secured.server.url}"', f'run.name="{RUN}"'])
        for role, rc in (("actor", 4), ("admin", 0)):
            user, password = secured.creds[role]
            monkeypatch.setenv("PARLEY_NATS_USER", user)
            monkeypatch.setenv("PARLEY_NATS_PASSWORD", password)
            update = BudgetUpdate(sim_call_budget=10 if role == "admin" else 10**6, judge_calls_per_s=3.0)
            assert await publish_budget(asyncio.Event(), cfg, update) == rc, role
            if role == "actor":
                await asyncio.sleep(0.3)
                assert (sim.budget, judge.per_s) == (2, 0.0)  # `parley auth budget` as the actor: refused
        for _ in range(50):
            if (sim.budget, judge.per_s) == (5, 3.0):
                break
            await asyncio.sleep(0.05)
        assert (sim.budget, sim.per_s, judge.budget, judge.per_s) == (5, 0.0, 4, 3.0)
    finally:
        stop.set()
        await asyncio.wait_for(scoring, 10)
        await actor.close()
        await scorer.close()
