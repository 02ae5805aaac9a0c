"""NATS permissions: which subjects each role may publish and subscribe to, derived from
protocol/topology.py (and nats.py's own KV and object-store stream names), and how long a service
may answer. deploy/credentials.py renders them into the server's auth.conf; `parley auth permissions`
prints them (docs/operations.md).
"""

from __future__ import annotations

from parley.protocol import topology
from parley.protocol.connect import inbox_prefix

ROLES = ("actor", "scorer", "learner", "sim", "judge", "services", "reference", "eval", "admin")
# `services` is one process serving both sim and judge (what `parley up` starts when they share a model).
COMBINED = {"services": ("sim", "judge")}
# Only the set-up credential creates or changes streams, consumers and buckets (`parley up`, `parley auth
# topology`: the compose topology service, the k8s Job); every workload role only verifies them
# (ensure_topology looks first and changes nothing that is already right). The server checks the API
# subject of a request, not its body: a user that may create or update a stream may point it at any
# subject (another run's, the services'), and one that may create a consumer may make it a push
# consumer whose deliver_subject is any subject, which the server then publishes to without checking
# the user's rights. So no workload role may send STREAM.CREATE/UPDATE or any CONSUMER.CREATE: each
# reads through the admin's durable pull consumers and direct gets only (docs/operations.md).
TOPOLOGY_OWNERS = ("admin",)
# The JetStream API requests that make or change something the server then publishes from, or that
# capture subjects: no role but the admin may send one (tests/integration/test_privilege.py).
FORBIDDEN_API = (
    "STREAM.CREATE",
    "STREAM.UPDATE",
    "CONSUMER.CREATE",
    "CONSUMER.DURABLE.CREATE",
    "STREAM.RESTORE",
)

API = "$JS.API"  # nats.js.api.DEFAULT_PREFIX, spelled here so that importing this module stays light
# Sentinel run name used to build the permissions of run="*": topology names are spelled with it, then
# every subject token that contains it is turned into a `*` wildcard.
_ANY_RUN = "zzAnyRunzz"

Permissions = dict[str, object]  # {"publish": {"allow": [...]}, "subscribe": {"allow": [...]}, "allow_responses": bool}


def _kv_stream(run: str) -> str:
    from nats.js.client import KV_STREAM_TEMPLATE

    return KV_STREAM_TEMPLATE.format(bucket=topology.kv_bucket(run))


def _held_stream(run: str) -> str:
    from nats.js.client import KV_STREAM_TEMPLATE

    return KV_STREAM_TEMPLATE.format(bucket=topology.held_bucket(run))


def _lease_stream(run: str) -> str:
    from nats.js.client import KV_STREAM_TEMPLATE

    return KV_STREAM_TEMPLATE.format(bucket=topology.lease_bucket(run))


def _obj_stream(run: str) -> str:
    from nats.js.object_store import OBJ_STREAM_TEMPLATE

    return OBJ_STREAM_TEMPLATE.format(bucket=topology.object_bucket(run))


def _verify_topology(run: str) -> list[str]:
    """What ensure_topology asks when everything exists: stream and consumer INFO of the whole run."""
    subjects = [f"{API}.INFO"]
    for key, channel in topology.CHANNELS.items():
        stream = topology.stream_name(run, key)
        subjects.append(f"{API}.STREAM.INFO.{stream}")
        if channel.durable:
            subjects.append(f"{API}.CONSUMER.INFO.{stream}.{channel.durable}")
    subjects += [
        f"{API}.STREAM.INFO.{_kv_stream(run)}",
        f"{API}.STREAM.INFO.{_held_stream(run)}",
        f"{API}.STREAM.INFO.{_obj_stream(run)}",
        f"{API}.STREAM.INFO.{_lease_stream(run)}",  # the learner's lease KV is part of the run's topology
    ]
    return subjects


def _consume(run: str, key: str) -> list[str]:
    """Fetch from and ack on the channel's shared durable pull consumer."""
    stream, durable = topology.stream_name(run, key), topology.CHANNELS[key].durable
    return [f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>"]


def _read_stream(stream: str) -> list[str]:
    """Read a stream's messages: get by sequence or last-by-subject (direct or through the API).

    No consumer of any kind: an ephemeral consumer (`CONSUMER.CREATE.<stream>`, what ordered
    consumers, KV watchers and the object store's get and list make) may be a push consumer with
    any deliver_subject, and the server would deliver the stream's messages there (into another
    stream: a forged Scored, a forged dead letter) without checking the user's publish rights.
    """
    return [
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
        f"{API}.CONSUMER.INFO.{stream}.*",
    ]


def weights_wakeups(run: str) -> list[str]:
    """The weights KV's announcement subjects, which an actor hears as core messages: the put of a
    new version wakes its follower (weights/follow.py) without a KV watcher (an ordered consumer)."""
    return [topology.weights_key_subject(run, key) for key in (topology.WEIGHTS_KEY, topology.WEIGHTS_EARLY_KEY)]


def _read_weights(run: str) -> list[str]:
    # The object store's get and list look the stream up by subject first (STREAM.NAMES).
    return [*_read_stream(_kv_stream(run)), *_read_stream(_obj_stream(run)), f"{API}.STREAM.NAMES"]


def _write_weights(run: str) -> list[str]:
    # put/update the KV key; put and delete objects (replacing or deleting an object purges its chunks).
    bucket_kv, bucket_obj = topology.kv_bucket(run), topology.object_bucket(run)
    return [f"$KV.{bucket_kv}.>", f"$O.{bucket_obj}.>", f"{API}.STREAM.PURGE.{_obj_stream(run)}"]


def own_inbox(user: str) -> str:
    """Where `user` receives request replies and pull-consumer deliveries (protocol.connect.inbox_prefix):
    the only inboxes it may subscribe to."""
    return f"{inbox_prefix(user)}.>"


# The roles that consume a channel through a PullWorker, and so dead-letter what they cannot handle
# (protocol.bus): the actor (TASKS), the scorer (TRAJ), the learner (SCORED, and the groups a step
# refused). Nobody else may write a dead letter: the learner acts on them (a letter about a task
# frees its slot and abandons its group), so a service user, shared by every run with run = "*",
# could otherwise end any run's groups with a forged letter.
DEAD_LETTERERS = ("actor", "scorer", "learner")


def _count_held(run: str) -> list[str]:
    """Read and write the held KV: the copies of a message a consumer absorbed while it held it
    (protocol.bus.PullWorker), which its successor does not count against max_deliver."""
    return [f"$KV.{topology.held_bucket(run)}.>", *_read_stream(_held_stream(run))]


# The roles that hold a share of the run's call limits and take the operator's changes to them from the
# control subject; only the admin may publish there (CONTROL_PUBLISHERS), or a role that may publish a
# control could lift its own budget, or stop every other process's calls.
BUDGET_FOLLOWERS = ("actor", "scorer")
CONTROL_PUBLISHERS = ("admin",)


def _everyone(run: str, role: str, user: str) -> tuple[list[str], list[str]]:
    """Every role verifies the topology, sends its own heartbeats and reads everyone's; the consuming
    roles also dead-letter and count the copies they absorb."""
    publish = [
        *_verify_topology(run),
        *([topology.subject(run, "dead"), *_count_held(run)] if role in DEAD_LETTERERS else []),
        topology.status_subject(run, role, "*"),
    ]
    subscribe = [own_inbox(user), topology.status_subject(run, "*", "*")]
    return publish, subscribe


def _role_rules(run: str, role: str, user: str) -> Permissions:
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role in COMBINED:
        parts = [_role_rules(run, r, user) for r in COMBINED[role]]
        merged: Permissions = {
            side: {"allow": _unique(s for p in parts for s in p[side]["allow"])} for side in ("publish", "subscribe")
        }
        if any(p.get("allow_responses") for p in parts):
            merged["allow_responses"] = True
        return merged
    publish, subscribe = _everyone(run, role, user)
    responses = False
    if role in BUDGET_FOLLOWERS:  # the operator's new call limits (`parley auth budget`, services.budget)
        subscribe.append(topology.control_subject(run, "budget"))
    if role == "actor":
        publish += [topology.subject(run, "traj"), *_with_withdrawals(topology.SIM_SUBJECT), *_consume(run, "tasks")]
        publish += _read_weights(run)
        subscribe += weights_wakeups(run)
    elif role == "scorer":
        publish += [topology.subject(run, "scored"), *_consume(run, "traj")]
        publish += _with_withdrawals(*(topology.judge_subject(op) for op in topology.JUDGE_OPS))
        # [policy] reference = "service": one request per trajectory
        publish += _with_withdrawals(topology.REFERENCE_SUBJECTS)
    elif role == "learner":
        publish += [topology.subject(run, "tasks"), *_consume(run, "scored")]
        publish += [*_read_weights(run), *_write_weights(run)]
        # It may re-read what it trained on, read back the tasks it published (a resumed learner adopts
        # those its ledger did not record, learner.feeder.adopt_published), read the dead letters (the
        # fates of the tasks it issued), and see how far every shared consumer has got and how full every
        # stream is (backlog).
        publish += [
            *_read_stream(topology.stream_name(run, "tasks")),
            *_read_stream(topology.stream_name(run, "scored")),
            *_read_stream(topology.stream_name(run, "dead")),
        ]
        publish += [f"{API}.CONSUMER.INFO.{topology.stream_name(run, key)}.*" for key in topology.CHANNELS]
        publish += [f"{API}.STREAM.INFO.{topology.stream_name(run, key)}" for key in topology.CHANNELS]
        # One learner per run (learner.lease): create, renew and delete its key in the lease KV. Purging
        # the run's streams (`parley learner --reset-streams`) is the admin credential's, not the learner's.
        publish += [f"$KV.{topology.lease_bucket(run)}.>", *_read_stream(_lease_stream(run))]
    elif role == "eval":
        publish += [topology.subject(run, "eval"), *_with_withdrawals(topology.SIM_SUBJECT), *_read_weights(run)]
        publish += _with_withdrawals(*(topology.judge_subject(op) for op in topology.JUDGE_OPS))
        publish += _read_stream(topology.stream_name(run, "eval"))
    elif role == "sim":
        subscribe += _with_withdrawals(topology.SIM_SUBJECT)
        responses = True
    elif role == "judge":
        subscribe += _with_withdrawals(*(topology.judge_subject(op) for op in topology.JUDGE_OPS))
        responses = True
    elif role == "reference":
        subscribe += _with_withdrawals(topology.REFERENCE_SUBJECTS)
        responses = True
    else:
        raise ValueError(f"unknown role {role!r}; known: {ROLES}")
    rules: Permissions = {"publish": {"allow": _unique(publish)}, "subscribe": {"allow": _unique(subscribe)}}
    if responses:
        # Services answer on the requester's reply subject only: no blanket publish right on _INBOX.>.
        rules["allow_responses"] = True
    return rules


def forbidden_requests(stream: str = "S") -> list[str]:
    """Concrete subjects of every FORBIDDEN_API request on `stream`, in each form the server accepts."""
    return [
        f"{API}.STREAM.CREATE.{stream}",
        f"{API}.STREAM.UPDATE.{stream}",
        f"{API}.STREAM.RESTORE.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}.name",
        f"{API}.CONSUMER.CREATE.{stream}.name.filter.subject",
        f"{API}.CONSUMER.DURABLE.CREATE.{stream}.name",
    ]


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether NATS subject pattern `pattern` (with * and >) covers the concrete `subject`."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def makes_topology(pattern: str) -> bool:
    """Whether publish-allow `pattern` covers any FORBIDDEN_API request (on any stream, in any form):
    its tokens agree with `$JS.API.<kind>` (wildcards included) and it goes on past it."""
    tokens = pattern.split(".")
    for forbidden in FORBIDDEN_API:
        prefix = [*API.split("."), *forbidden.split(".")]
        for i, token in enumerate(tokens):
            if i >= len(prefix) or token == ">":
                return True
            if token not in ("*", prefix[i]):
                break
    return False


def _refuse_topology_rights(role: str, publish: list[str]) -> None:
    """Privilege by construction: a workload role whose allow-list would let it send a FORBIDDEN_API
    request (directly or through a wildcard) is a bug in this table, refused before any auth.conf is written."""
    bad = sorted(p for p in publish if makes_topology(p))
    if bad:
        raise AssertionError(f"role {role!r} would be allowed to make or change topology through {bad}")


def _with_withdrawals(*subjects: str) -> list[str]:
    """Service subjects and the subjects of their withdrawals (protocol/request.py): a requester
    publishes both (a withdrawal when it stops waiting before its timeout), a service hears both."""
    return [s for subject in subjects for s in (subject, topology.withdraw_subject(subject))]


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def _wildcard_run(subject: str) -> str:
    return ".".join("*" if _ANY_RUN in token else token for token in subject.split("."))


def role_permissions(run: str, users: dict[str, str] | None = None) -> dict[str, Permissions]:
    """Publish/subscribe allow-lists of every role for run `run`, or for every run with run="*".

    run="*" is for users shared by several runs (a service fleet, a cluster-wide admin): each token
    that names the run (`parley.<run>.traj`, `PARLEY_<run>_TRAJ`, `parley_<run>_weights`) becomes `*`,
    which also matches other streams' names in the JetStream API subjects. Each role subscribes to
    the inboxes of its own user only: users[role], by default user_name(run, role).
    """
    name = _ANY_RUN if run == "*" else topology.check_run(run)
    users = {role: user_name(run, role) for role in ROLES} | (users or {})
    perms = {role: _role_rules(name, role, users[role]) for role in ROLES}
    if run == "*":
        for role, rules in perms.items():
            for side in ("publish", "subscribe"):
                rules[side]["allow"] = _unique(_wildcard_run(s) for s in rules[side]["allow"])
    for role, rules in perms.items():
        if role not in TOPOLOGY_OWNERS:
            _refuse_topology_rights(role, rules["publish"]["allow"])
        if role not in CONTROL_PUBLISHERS:
            _refuse_control_rights(role, rules["publish"]["allow"], run)
    return perms


def _refuse_control_rights(role: str, publish: list[str], run: str) -> None:
    """Privilege by construction: a role other than the admin that could publish an operator's control
    (on this run's subject or, through a wildcard, any run's) is a bug in this table."""
    # a user of every run holds its rules with `*` for the run: any concrete run's subject tests them
    subjects = [topology.control_subject(_ANY_RUN if run == "*" else run, what) for what in topology.CONTROLS]
    bad = sorted({p for p in publish for s in subjects if subject_matches(p, s)})
    if bad:
        raise AssertionError(f"role {role!r} would be allowed to publish operator controls through {bad}")


def user_name(run: str, role: str) -> str:
    """parley-<run>-<role>; run "*" gives parley-*-<role>, a user valid on every run."""
    return f"parley-{run}-{role}"


# Beyond the longest request timeout: a service counts its requester's wait from the moment the
# request reached it (protocol/request.py), so its answer may come that much after the request was
# published plus the time in transit and in the client's queue.
RESPONSE_SLACK_S = 60.0


def response_window_s(cfg=None) -> float:
    """How long a service user (sim, judge, reference) may answer a request: the longest request timeout that
    `cfg` (a RunConfig; None = the defaults) gives a requester, plus RESPONSE_SLACK_S. nats-server's own
    default is 2 minutes, shorter than the default timeouts: later replies were refused."""
    if cfg is None:
        from parley.config.run import RunConfig

        cfg = RunConfig()
    # The actor's and the eval's simulator requests, the scorer's, replay's and the eval's judge requests,
    # the scorer's reference requests.
    return max(cfg.actor.sim_timeout_s, cfg.scorer.judge_timeout_s, cfg.scorer.reference_timeout_s) + RESPONSE_SLACK_S
