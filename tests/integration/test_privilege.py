"""Privilege against the server's own deliveries, tried as an attacker would on a real nats-server.

nats-server checks what a user publishes itself, and the API subject of a JetStream request, but not
the request's body: a user that may create a consumer may make it a push consumer whose
deliver_subject is any subject (the server then publishes the stream's messages there on its
behalf), and a user that may create or update a stream may point its subjects, mirror, sources or
republish anywhere. For every workload role (everyone but admin) these tests send every such request,
into this run's SCORED / TASKS / DEAD / TRAJ subjects and into another run's, and check with an admin
connection that every request was refused or went unanswered, that nothing was created or changed,
and that nothing landed on any target subject (deploy/permissions.py: FORBIDDEN_API).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from parley.deploy.credentials import generate_credentials, server_auth_conf
from parley.deploy.natsserver import NatsServer
from parley.deploy.permissions import ROLES
from parley.protocol import codec, examples, topology
from parley.protocol.connect import barrier, connect, inbox_prefix
from tests import factories

pytestmark = pytest.mark.integration
RUN = "privrun"
OTHER = "otherrun"  # another run on the same server, made by the admin
WORKLOAD = [role for role in ROLES if role != "admin"]  # every role that runs the workload
API = "$JS.API"


class Server:
    def __init__(self, server: NatsServer, creds: dict):
        self.server, self.creds = server, creds

    async def connect(self, role: str):
        user, password = self.creds[role]
        return await connect(self.server.url, name=f"attacker-{role}", user=user, password=password, first_timeout=5)


def _streams(run: str) -> list[str]:
    names = [topology.stream_name(run, key) for key in topology.CHANNELS]
    return [
        *names,
        f"KV_{topology.kv_bucket(run)}",
        f"KV_{topology.held_bucket(run)}",
        f"OBJ_{topology.object_bucket(run)}",
    ]


# Where a forged delivery would do harm: the learner trains what lands in SCORED, acts on DEAD, the
# actors work on TASKS; the other run's the same; the services' subjects (a captured request).
def _targets() -> list[str]:
    mine = [topology.subject(RUN, key) for key in ("scored", "tasks", "dead", "traj")]
    theirs = [topology.subject(OTHER, key) for key in ("scored", "tasks", "dead")]
    return [*mine, *theirs, topology.SIM_SUBJECT]


async def _seed(js) -> None:
    """A valid Scored in every stream a role can read, so that any consumer would have something to deliver."""
    scored = codec.encode(factories.scored(examples.trajectory(RUN, task_id="forged"), {"bleu": 1.0}, total=1e6))
    for run in (RUN, OTHER):
        for key, msg in examples.channel_examples(run).items():
            await js.publish(topology.subject(run, key), codec.encode(msg))
        await js.publish(f"$KV.{topology.held_bucket(run)}.forged", scored)
        await js.publish(f"$KV.{topology.kv_bucket(run)}.forged", scored)
        await js.publish(f"$O.{topology.object_bucket(run)}.C.forged", scored)


@pytest.fixture(scope="module", params=["run-scoped", "every-run"])
def server(request, tmp_path_factory):
    cred_run = RUN if request.param == "run-scoped" else "*"
    d = tmp_path_factory.mktemp(f"priv-{request.param}")
    creds = generate_credentials(cred_run, d / "auth")
    srv = NatsServer(d / "nats", port=0, extra_conf=server_auth_conf(creds, cred_run))
    srv.start()

    async def setup():
        admin = await connect(srv.url, name="setup", user=creds["admin"][0], password=creds["admin"][1])
        try:
            for run in (RUN, OTHER):
                await topology.ensure_topology(admin.jetstream(), run)
            await _seed(admin.jetstream())
        finally:
            await admin.close()

    asyncio.run(setup())
    yield Server(srv, creds)
    srv.stop()


def _consumer_attacks(stream: str, target: str, n: int) -> list[tuple[str, dict]]:
    """Every form of consumer creation the server accepts, each as a push consumer delivering to `target`."""
    push = {"deliver_subject": target, "ack_policy": "none", "deliver_policy": "all"}
    name = f"evil{n}"
    attacks = [
        (f"{API}.CONSUMER.CREATE.{stream}", {"stream_name": stream, "config": push}),
        (f"{API}.CONSUMER.CREATE.{stream}.{name}", {"stream_name": stream, "config": {**push, "name": name}}),
        (
            f"{API}.CONSUMER.CREATE.{stream}.{name}f.>",
            {"stream_name": stream, "config": {**push, "name": f"{name}f", "filter_subject": ">"}},
        ),
        (
            f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{name}d",
            {"stream_name": stream, "config": {**push, "durable_name": f"{name}d"}},
        ),
    ]
    for channel in topology.CHANNELS.values():  # turn a role's shared durable into a push consumer
        if channel.durable and stream.endswith(f"_{channel.key.upper()}"):
            cfg = {**push, "durable_name": channel.durable, "ack_policy": "explicit"}
            attacks.append(
                (f"{API}.CONSUMER.CREATE.{stream}.{channel.durable}", {"stream_name": stream, "config": cfg})
            )
            attacks.append((f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{channel.durable}", {"config": cfg}))
    return attacks


def _stream_attacks(role: str) -> list[tuple[str, dict]]:
    """Streams and buckets that would capture or republish: new ones, and the run's own re-pointed."""
    targets, attacks = _targets(), []
    base = {"retention": "limits", "storage": "file", "num_replicas": 1, "max_bytes": 1 << 20}
    new = f"EVIL_{role}"
    attacks.append((f"{API}.STREAM.CREATE.{new}", {**base, "name": new, "subjects": targets}))
    attacks.append((f"{API}.STREAM.CREATE.{new}_svc", {**base, "name": f"{new}_svc", "subjects": ["parley.svc.>"]}))
    for run in (RUN, OTHER):
        scored = topology.stream_name(run, "scored")
        attacks.append(
            (f"{API}.STREAM.CREATE.{new}_m{run}", {**base, "name": f"{new}_m{run}", "mirror": {"name": scored}})
        )
        srcs = [{"name": scored}, {"name": topology.stream_name(run, "dead")}]
        attacks.append((f"{API}.STREAM.CREATE.{new}_s{run}", {**base, "name": f"{new}_s{run}", "sources": srcs}))
    for i, target in enumerate(targets):  # a stream that republishes what it stores onto a target
        attacks.append(
            (
                f"{API}.STREAM.CREATE.{new}_r{i}",
                {
                    **base,
                    "name": f"{new}_r{i}",
                    "subjects": [f"evil.{role}.{i}"],
                    "republish": {"src": ">", "dest": target},
                },
            )
        )
    for stream in _streams(RUN):  # the run's own streams, re-pointed, republishing, mirroring
        own = {**base, "name": stream, "subjects": [f"parley.{RUN}.scratch.{stream}"]}
        attacks.append((f"{API}.STREAM.UPDATE.{stream}", {**own, "subjects": ["parley.svc.>", *targets]}))
        attacks.append((f"{API}.STREAM.UPDATE.{stream}", {**own, "republish": {"src": ">", "dest": targets[0]}}))
        attacks.append(
            (f"{API}.STREAM.UPDATE.{stream}", {**own, "sources": [{"name": topology.stream_name(OTHER, "scored")}]})
        )
    for kind, prefix in (("KV", "$KV"), ("OBJ", "$O")):  # buckets: a KV or object store is a stream
        bucket = f"evil_{role}_{kind.lower()}"
        attacks.append(
            (
                f"{API}.STREAM.CREATE.{kind}_{bucket}",
                {**base, "name": f"{kind}_{bucket}", "subjects": [f"{prefix}.{bucket}.>"]},
            )
        )
        mirror = f"{kind}_{topology.kv_bucket(OTHER) if kind == 'KV' else topology.object_bucket(OTHER)}"
        attacks.append(
            (f"{API}.STREAM.CREATE.{kind}_{bucket}m", {**base, "name": f"{kind}_{bucket}m", "mirror": {"name": mirror}})
        )
    attacks.append((f"{API}.STREAM.RESTORE.{new}_restored", {"config": {**base, "name": f"{new}_restored"}}))
    return attacks


async def _snapshot(js) -> dict:
    """What an attack could have changed: every stream's config and count, every consumer's config."""
    snap = {}
    for name in await js.streams_info():
        cfg = name.config
        consumers = {c.name: c.config.deliver_subject for c in await js.consumers_info(cfg.name)}
        snap[cfg.name] = (
            tuple(cfg.subjects or ()),
            cfg.mirror and cfg.mirror.name,
            tuple(s.name for s in cfg.sources or ()),
            cfg.republish and cfg.republish.destination,
            name.state.messages,
            tuple(sorted(consumers.items())),
        )
    return snap


@pytest.mark.parametrize("role", WORKLOAD)
async def test_no_role_can_make_the_server_publish_or_capture_for_it(server, role, caplog):
    admin = await server.connect("admin")
    attacker = await server.connect(role)
    try:
        ajs = admin.jetstream()
        before = await _snapshot(ajs)
        landed = []

        async def on_target(msg):
            landed.append((msg.subject, msg.data[:80]))

        for target in _targets():
            await admin.subscribe(target, cb=on_target)
        await barrier(admin)

        answers = []

        async def on_answer(msg):
            answers.append((msg.subject, json.loads(msg.data)))

        inbox = f"{inbox_prefix(server.creds[role][0])}.attack"
        await attacker.subscribe(f"{inbox}.*", cb=on_answer)
        attacks = [
            a
            for s in [*_streams(RUN), *_streams(OTHER)]
            for n, t in enumerate(_targets())
            for a in _consumer_attacks(s, t, n)
        ]
        attacks += _stream_attacks(role)
        for i, (subject, body) in enumerate(attacks):
            await attacker.publish(subject, json.dumps(body).encode(), reply=f"{inbox}.{i}")
        await barrier(attacker)
        await asyncio.sleep(2.0)  # a push consumer delivers at once; a mirror or source within a second

        accepted = [(attacks[int(s.rsplit(".", 1)[1])][0], a) for s, a in answers if "error" not in a]
        assert accepted == [], f"{role}: the server accepted {len(accepted)} of {len(attacks)} requests: {accepted[:3]}"
        assert landed == [], f"{role}: {len(landed)} messages landed on target subjects: {landed[:3]}"
        after = await _snapshot(ajs)
        assert after == before, (
            f"{role}: changed {sorted(k for k in after.keys() | before.keys() if after.get(k) != before.get(k))}"
        )
    finally:
        await attacker.close()
        await admin.close()


class CountingFollower:
    """Test double around the real WeightFollower: counts the key reads (check) instead of loading."""

    @staticmethod
    def make(js):
        from types import SimpleNamespace

        from parley.weights.follow import WeightFollower

        class Counting(WeightFollower):
            checks = 0

            async def check(self) -> bool:
                type(self).checks += 1
                return False

        return Counting(js, RUN, SimpleNamespace(version=0), dest_root="/nonexistent", poll_s=60.0)


async def test_an_actor_hears_a_new_weights_announcement_without_a_watcher(server, caplog):
    """The follower no longer makes a KV watcher (an ordered push consumer, refused to the actor now):
    the learner's put of the key wakes it as a core message, long before its poll (60 s here)."""
    actor, learner = await server.connect("actor"), await server.connect("learner")
    stop = asyncio.Event()
    try:
        follower = CountingFollower.make(actor.jetstream())
        task = asyncio.create_task(follower.run_until(stop))
        for _ in range(50):  # the first read, and the watchers' subscriptions in place
            await asyncio.sleep(0.05)
        await barrier(actor)
        assert type(follower).checks == 1
        kv = await learner.jetstream().key_value(topology.kv_bucket(RUN))
        for key in (topology.WEIGHTS_KEY, topology.WEIGHTS_EARLY_KEY):
            seen = type(follower).checks
            await kv.put(key, b"announcement")
            for _ in range(40):
                if type(follower).checks > seen:
                    break
                await asyncio.sleep(0.05)
            assert type(follower).checks == seen + 1, key
        stop.set()
        await asyncio.wait_for(task, 5)
        assert not [r for r in caplog.records if "permissions violation" in r.getMessage().lower()]
    finally:
        stop.set()
        await actor.close()
        await learner.close()


async def test_a_service_answers_only_into_an_inbox(server, caplog):
    """A service may answer any reply subject once (allow_responses): a requester that names a run's
    SCORED or DEAD (or another run's) as its reply would have the service publish there for it. The
    service answers inboxes only; the honest request still gets its answer."""
    from parley.engines.service import Service

    async def echo(data: bytes) -> bytes:
        return data

    sim, actor, admin = await server.connect("sim"), await server.connect("actor"), await server.connect("admin")
    service = Service(sim, {topology.SIM_SUBJECT: echo}, queue=topology.SIM_QUEUE, concurrency=2)
    await service.start()
    try:
        landed = []

        async def on_target(msg):
            landed.append(msg.subject)

        targets = [t for t in _targets() if t != topology.SIM_SUBJECT]
        for target in targets:
            await admin.subscribe(target, cb=on_target)
        await barrier(admin)
        before = await _snapshot(admin.jetstream())
        payload = codec.encode(factories.scored(examples.trajectory(RUN, task_id="via-sim"), {"bleu": 1.0}))
        for target in targets:
            await actor.publish(topology.SIM_SUBJECT, payload, reply=target)
        honest = await actor.request(topology.SIM_SUBJECT, b"hello", timeout=5)
        assert honest.data == b"hello"
        await asyncio.sleep(1.0)
        assert landed == []
        assert await _snapshot(admin.jetstream()) == before
        assert sum("not an inbox" in r.getMessage() for r in caplog.records) == len(targets)
    finally:
        await service.stop(grace_s=2)
        for nc in (sim, actor, admin):
            await nc.close()


async def test_api_answers_sent_into_a_channel_are_never_a_message(server):
    """The one path permissions do not close: the reply subject of a JetStream API request is not
    checked, so a role may have the server publish its answer onto a channel subject. A direct get
    answers with the stored message's raw bytes (a forged Scored in the held KV, which the actor may
    write), and on this server it never lands; the other answers are JSON, which lands but no
    channel decoder accepts (the consumer dead-letters it as undecodable): noise, never a message."""
    actor, admin = await server.connect("actor"), await server.connect("admin")
    try:
        ajs = admin.jetstream()
        held, held_stream = topology.held_bucket(RUN), f"KV_{topology.held_bucket(RUN)}"
        forged = codec.encode(factories.scored(examples.trajectory(RUN, task_id="via-api"), {"bleu": 1.0}))
        await actor.jetstream().publish(f"$KV.{held}.via-api", forged)
        keys = ("scored", "dead", "tasks")
        channels = [(run, key) for run in (RUN, OTHER) for key in keys]
        counts = {c: (await ajs.stream_info(topology.stream_name(*c))).state.last_seq for c in channels}
        for run, key in channels:
            reply = topology.subject(run, key)
            requests = [
                (f"{API}.DIRECT.GET.{held_stream}", json.dumps({"last_by_subj": f"$KV.{held}.via-api"}).encode()),
                (f"{API}.DIRECT.GET.{held_stream}.$KV.{held}.via-api", b""),
                (f"{API}.STREAM.MSG.GET.{held_stream}", json.dumps({"last_by_subj": f"$KV.{held}.via-api"}).encode()),
                (f"{API}.STREAM.INFO.{held_stream}", b""),
            ]
            for subject, body in requests:
                await actor.publish(subject, body, reply=reply)
        await barrier(actor)
        await asyncio.sleep(1.0)
        for run, key in channels:
            name = topology.stream_name(run, key)
            last = (await ajs.stream_info(name)).state.last_seq
            for seq in range(counts[(run, key)] + 1, last + 1):
                data = (await ajs.get_msg(name, seq)).data
                assert data != forged, f"the raw forged message landed in {name}"
                with pytest.raises(Exception):  # noqa: B017 - any decode error: not a message of the channel
                    codec.decode(key, data)
    finally:
        await actor.close()
        await admin.close()
