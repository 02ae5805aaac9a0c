"""Subject names and the JetStream topology of a run: streams, durable consumers, KV, object store.

Every role calls `ensure_topology(js, run, bus)` at start; it is idempotent (create or update) and
only asks the server for changes when something is missing or differs. With access control only the
set-up credential (admin: `parley up`, `parley auth topology`) may make or change anything
(deploy/permissions.py); every role, the learner included, passes once the run is set up and changes nothing.
Nothing outside protocol/ spells a subject, stream or bucket name: use the helpers here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import nats.errors
from nats.js import api
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from parley.errors import StateError
from parley.protocol.settings import RUN_NAME, BusSettings  # noqa: F401 (this module's names too)

# Services are shared by every run on a cluster: one simulator or judge fleet serves them all.
SIM_SUBJECT = "parley.svc.sim"
SIM_QUEUE = "sim"
JUDGE_SUBJECT = "parley.svc.judge"  # + "." + one of JUDGE_OPS
JUDGE_QUEUE = "judge"
# interactivity_3level: the 3-level scale (1 / 0.5 / 0) of CollabLLM's judge, beside the 0..3 rubric.
# interactivity_expected: the 0..3 rubric, scored as the expected level under the judge's own
# distribution over each level token (the reply carries that distribution).
JUDGE_OPS = ("extract", "interactivity", "interactivity_3level", "interactivity_expected")
# The frozen initial policy's log-probs of a trajectory ([policy] reference = "service"): one subject
# per model (reference_subject), so a request reaches only the services that hold the model it names.
# On one shared subject a service of another run's model took its share of the queue group, refused,
# and the scorer spent a delivery and redid the judge work (about 1 in 32 dead-lettered with two runs).
REFERENCE_SUBJECTS = "parley.svc.reference.*"  # every model's subject (permissions)
REFERENCE_QUEUE = "reference"
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# A requester that stops waiting before its timeout (cancelled) withdraws its request on this subject
# (protocol/request.py): every replica serving `subject` listens to it outside the queue group, since
# only the one that received the request knows it. A suffix token, so `withdraw_subject` of a wildcard
# (REFERENCE_SUBJECTS) is the wildcard of the withdrawals, and no service subject matches one.
WITHDRAW_TOKEN = "withdraw"


def withdraw_subject(subject: str) -> str:
    """Where the requests sent to service subject `subject` are withdrawn: <subject>.withdraw."""
    return f"{subject}.{WITHDRAW_TOKEN}"


def reference_subject(model: str) -> str:
    """The subject of the reference service holding `model` (the [learner] model as written: a
    built-in name, or a path). A name that is a valid subject token is used as it is, so the subject
    reads; anything else (a path, dots, spaces) by a digest of the name."""
    import hashlib

    if not model:
        raise ValueError("a reference request names its model; got an empty name")
    token = model if _SUBJECT_TOKEN.match(model) else "m-" + hashlib.blake2b(model.encode(), digest_size=10).hexdigest()
    return f"parley.svc.reference.{token}"


WEIGHTS_KEY = "current"  # KV key holding the encoded WeightVersion actors must serve
# KV key of a delta version announced before its full copy is stored (WeightVersion.full_pending):
# actors holding the base follow it at once; WEIGHTS_KEY names the same version once the full copy is
# there, so actors that read only WEIGHTS_KEY (older ones) never see a version whose file is missing.
WEIGHTS_EARLY_KEY = "current-delta"


@dataclass(frozen=True)
class Channel:
    """A stream of one message type, and the durable consumer its readers share."""

    key: str  # "tasks", "traj", ...
    durable: str | None  # shared durable pull consumer, or None when only replayed


CHANNELS: dict[str, Channel] = {
    "tasks": Channel("tasks", "actor"),  # learner.feeder -> actor       (Task)
    "traj": Channel("traj", "scorer"),  # actor -> scorer               (Trajectory)
    "scored": Channel("scored", "learner"),  # scorer -> learner         (Scored)
    "eval": Channel("eval", None),  # eval -> replay                     (EvalRecord)
    "dead": Channel("dead", None),  # any consumer -> operators          (DeadLetter)
}


def check_run(run: str) -> str:
    if not RUN_NAME.match(run):
        raise ValueError(f"run name {run!r} is not allowed; use 1-64 of A-Z a-z 0-9 _ -")
    return run


def subject(run: str, key: str) -> str:
    """Subject of a channel: parley.<run>.<key>."""
    if key not in CHANNELS:
        raise ValueError(f"unknown channel {key!r}; known: {sorted(CHANNELS)}")
    return f"parley.{check_run(run)}.{key}"


def stream_name(run: str, key: str) -> str:
    return f"PARLEY_{check_run(run)}_{key.upper()}"


def status_subject(run: str, role: str = "*", ident: str = "*") -> str:
    """Core-NATS heartbeats of the roles (not stored): parley.<run>.status.<role>.<id>."""
    return f"parley.{check_run(run)}.status.{role}.{ident}"


# Operator commands to a run's roles (core NATS, not stored): what each may say, and who acts on it
CONTROLS = ("budget",)  # protocol.messages.BudgetUpdate -> actors and scorers (services.budget)


def control_subject(run: str, what: str) -> str:
    """parley.<run>.control.<what>: only the admin user may publish here (deploy/permissions.py), the
    roles that act on `what` subscribe; no workload role can change another's limits."""
    if what not in CONTROLS:
        raise ValueError(f"unknown control {what!r}; known: {CONTROLS}")
    return f"parley.{check_run(run)}.control.{what}"


def judge_subject(op: str) -> str:
    if op not in JUDGE_OPS:
        raise ValueError(f"unknown judge op {op!r}; allowed: {JUDGE_OPS}")
    return f"{JUDGE_SUBJECT}.{op}"


def kv_bucket(run: str) -> str:
    return f"parley_{check_run(run)}_weights"


def object_bucket(run: str) -> str:
    return f"parley_{check_run(run)}_blobs"


def weights_key_subject(run: str, key: str) -> str:
    """The subject a put of weights KV key `key` is published on (NATS ADR-8: $KV.<bucket>.<key>): an
    actor hears announcements there as core messages, with no KV watcher (a consumer it may not make)."""
    return f"$KV.{kv_bucket(run)}.{key}"


def held_bucket(run: str) -> str:
    """KV of the copies a consumer absorbed while it held a message (protocol.bus.PullWorker), keyed
    by held_key: a worker that gets the message after the holder died subtracts them from the server's
    delivery count, as the holder would have."""
    return f"parley_{check_run(run)}_held"


def lease_bucket(run: str) -> str:
    """KV of the run's learner lease (learner.lease): one key, LEASE_KEY, whose revision is the
    holder's fencing token; the bucket's TTL (LEASE_TTL_S) ends the lease of a holder that died."""
    return f"parley_{check_run(run)}_lease"


LEASE_KEY = "learner"
LEASE_TTL_S = 15.0  # a learner that stops renewing (killed) loses the lease this long after its last renewal


def lease_config(run: str, bus: BusSettings) -> api.KeyValueConfig:
    return api.KeyValueConfig(
        bucket=lease_bucket(run),
        history=1,
        ttl=LEASE_TTL_S,
        replicas=bus.replicas,
        storage=api.StorageType.FILE,
        max_bytes=bus.kv_max_bytes,
    )


def held_key(key: str, stream_seq: int) -> str:
    return f"{key}.{stream_seq}"


def stream_config(run: str, key: str, bus: BusSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=stream_name(run, key),
        subjects=[subject(run, key)],
        retention=api.RetentionPolicy.LIMITS,  # kept for replay; work-queue behaviour comes from the consumer
        max_age=bus.max_age_s,
        max_bytes=bus.max_bytes,
        max_msg_size=bus.max_msg_bytes,
        storage=api.StorageType.FILE,
        num_replicas=bus.replicas,
        duplicate_window=bus.duplicate_window_s,
        discard=api.DiscardPolicy.OLD,
    )


def consumer_config(durable: str, bus: BusSettings) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=bus.ack_wait_s,
        # Unlimited on the server: the bus (PullWorker) alone ends a message, by dead-lettering it after
        # bus.max_deliver deliveries. A server-side limit would strand a message whose dead letter could
        # not be stored on the server's last delivery: nak'ed, never delivered again, never in DEAD.
        max_deliver=-1,
        max_ack_pending=bus.max_ack_pending,
    )


DEFAULT_BLOBS_MAX_BYTES = 4 * 1024**3  # BusSettings.blobs_max_bytes = 0 that nothing derived
# The weights object store of a run that stores no versions in it (versions over cuda_ipc, nccl or a
# shared directory; an eval's condition runs): JetStream reserves a bucket's max_bytes on its disk at
# creation, so a model-sized reservation nothing uses can leave no room for the run (a 4B run's ~41 GB
# on the lent GPU machine's 64 GB disk; nats-server here refused 100 GB on a 74 GB disk)
UNUSED_BLOBS_MAX_BYTES = 8 * 1024**2


def blobs_max_bytes(bus: BusSettings) -> int:
    return bus.blobs_max_bytes or DEFAULT_BLOBS_MAX_BYTES


class TopologyError(StateError):
    """The run's topology is missing or differs and this connection could not (or may not) fix it."""


# The settings ensure_topology decides; anything else the server fills in is left alone.
_STREAM_FIELDS = (
    "subjects",
    "retention",
    "max_age",
    "max_bytes",
    "max_msg_size",
    "storage",
    "num_replicas",
    "duplicate_window",
    "discard",
)
_CONSUMER_FIELDS = ("ack_policy", "deliver_policy", "ack_wait", "max_deliver", "max_ack_pending")


def _differs(have, want, fields) -> bool:
    return any(getattr(have, f) != getattr(want, f) for f in fields)


# JetStream's "insufficient storage resources available" (JSStorageResourcesExceededErr) and
# "insufficient resources" (JSInsufficientResourcesErr): the server's store cannot hold what is asked
_NO_ROOM = (10047, 10023)


async def _manage(what: str, call, room: str = ""):
    """`await call` (a JetStream API request), its failures as TopologyErrors that say what to do.
    `room`: what the request reserves on the server's store, named when the store has no room for it."""
    try:
        return await call
    except nats.errors.TimeoutError:
        # A request the user has no permission for is dropped by the server and simply times out.
        raise TopologyError(
            f"{what}: no answer from JetStream; if this NATS user may not do that (only the admin user makes "
            "streams, consumers and buckets, and each user only sees its own run; see docs/operations.md), run "
            "`parley auth topology` with admin.env (or `parley up`) first, or check the run name and credentials"
        ) from None
    except APIError as e:
        if e.err_code not in _NO_ROOM:
            raise
        raise TopologyError(
            f"{what}: JetStream has no room for it ({e.description}){': ' + room if room else ''}. Free disk "
            "space where nats-server keeps its store (`parley up`: RUN_DIR/nats), raise its jetstream "
            "max_file_store, or lower [bus] max_bytes (for example --set bus.max_bytes=268435456)"
        ) from None


async def ensure_topology(
    js, run: str, bus: BusSettings | None = None, *, create: bool = True, stores_versions: bool = True
) -> None:
    """Create or update every stream, durable consumer, the weights and held KVs and the blob store of a run.

    What already exists with the wanted settings is only looked at (INFO requests). create=False
    only checks that everything exists and raises TopologyError naming what is missing.
    stores_versions=False (selfcheck, an eval): a blob store this call creates, with [bus]
    blobs_max_bytes = 0, reserves UNUSED_BLOBS_MAX_BYTES; one that exists keeps its limit.
    """
    bus = bus or BusSettings()
    room = (
        f"the server reserves each stream's [bus] max_bytes = {bus.max_bytes} bytes on its store up front, "
        f"{len(CHANNELS)} streams a run ({len(CHANNELS) * bus.max_bytes / 2**30:.1f} GiB), and [bus] "
        f"kv_max_bytes = {bus.kv_max_bytes} for each of 3 KV buckets and [bus] blobs_max_bytes = "
        f"{blobs_max_bytes(bus)} for the weights object store"
    )
    for key, channel in CHANNELS.items():
        cfg = stream_config(run, key, bus)
        try:
            have = (await _manage(f"looking up stream {cfg.name}", js.stream_info(cfg.name))).config
        except NotFoundError:
            have = None
        if have is None and not create:
            raise TopologyError(
                f"stream {cfg.name} of run {run!r} does not exist; run `parley auth topology` (admin) or `parley up`"
            )
        if create and (have is None or _differs(have, cfg, _STREAM_FIELDS)):
            try:
                await _manage(f"creating stream {cfg.name}", js.add_stream(cfg), room)
            except BadRequestError:
                await _manage(f"updating stream {cfg.name}", js.update_stream(cfg), room)  # exists with other settings
        if channel.durable:
            want = consumer_config(channel.durable, bus)
            try:
                lookup = js.consumer_info(cfg.name, channel.durable)
                have_c = (await _manage(f"looking up consumer {channel.durable}", lookup)).config
            except NotFoundError:
                have_c = None
            if have_c is None and not create:
                raise TopologyError(
                    f"consumer {channel.durable} on {cfg.name} does not exist; run `parley auth topology` (admin) first"
                )
            if create and (have_c is None or _differs(have_c, want, _CONSUMER_FIELDS)):
                await _manage(f"creating consumer {channel.durable} on {cfg.name}", js.add_consumer(cfg.name, want))
    kv_buckets = (  # the weights announcements; the held KV's counts matter while their message is unsettled
        api.KeyValueConfig(
            bucket=kv_bucket(run),
            history=16,
            replicas=bus.replicas,
            storage=api.StorageType.FILE,
            max_bytes=bus.kv_max_bytes,
        ),
        api.KeyValueConfig(
            bucket=held_bucket(run),
            history=1,
            ttl=bus.max_age_s,
            replicas=bus.replicas,
            storage=api.StorageType.FILE,
            max_bytes=bus.kv_max_bytes,
        ),
    )
    if create:  # one learner per run (learner.lease); only the learner uses it, so the others never look it up
        kv_buckets += (lease_config(run, bus),)
    for kv_config in kv_buckets:
        try:
            await _manage(f"looking up KV bucket {kv_config.bucket}", js.key_value(kv_config.bucket))
        except BucketNotFoundError:
            if not create:
                raise TopologyError(
                    f"KV bucket {kv_config.bucket} does not exist; run `parley auth topology` (admin) first"
                ) from None
            await _manage(f"creating KV bucket {kv_config.bucket}", js.create_key_value(kv_config), room)
            continue
        if create:
            await _bound_bucket(js, KV_STREAM_TEMPLATE.format(bucket=kv_config.bucket), kv_config.max_bytes, room)
    ob_name = object_bucket(run)
    try:
        await _manage(f"looking up object store {ob_name}", js.object_store(ob_name))
    except BucketNotFoundError:
        if not create:
            raise TopologyError(
                f"object store {ob_name} does not exist; run `parley auth topology` (admin) first"
            ) from None
        size = blobs_max_bytes(bus) if stores_versions or bus.blobs_max_bytes else UNUSED_BLOBS_MAX_BYTES
        ob_config = api.ObjectStoreConfig(
            bucket=ob_name, replicas=bus.replicas, storage=api.StorageType.FILE, max_bytes=size
        )
        await _manage(f"creating object store {ob_name}", js.create_object_store(ob_name, config=ob_config), room)
    else:
        if create:
            await _bound_bucket(js, OBJ_STREAM_TEMPLATE.format(bucket=ob_name), bus.blobs_max_bytes, room)


async def _bound_bucket(js, stream: str, max_bytes: int, room: str) -> None:
    """A bucket made before it had a limit, or with another one than an explicit `max_bytes`, gets
    it. 0 (a role whose [bus] nothing derived, deploy.common.topology_bus) accepts any limit the
    set-up command gave, and gives DEFAULT_BLOBS_MAX_BYTES to a bucket that has none."""
    have = (await _manage(f"looking up stream {stream}", js.stream_info(stream))).config
    if not max_bytes:
        max_bytes = have.max_bytes if (have.max_bytes or -1) > 0 else DEFAULT_BLOBS_MAX_BYTES
    if have.max_bytes != max_bytes:
        have.max_bytes = max_bytes
        await _manage(f"setting max_bytes={max_bytes} on {stream}", js.update_stream(have), room)
