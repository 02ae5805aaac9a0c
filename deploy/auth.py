"""NATS access control: which subjects each role may publish and subscribe to, and per-run credentials.

`role_permissions(run)` derives every subject from protocol/topology.py (and nats.py's own KV and
object-store stream names); `generate_credentials` writes the server's auth.conf and one env file
per role. `parley up`, the deploy files and `python -m deploy.auth` (see docs/operations.md) use them.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from pathlib import Path

from deploy.natsserver import write_private
from protocol import topology
from protocol.connect import inbox_prefix

ROLES = ("actor", "scorer", "learner", "sim", "judge", "services", "reference", "eval", "admin")
# `services` is one process serving both sim and judge (what `parley up` starts when they share a model).
COMBINED = {"services": ("sim", "judge")}
# Only these may create or change streams, consumers and buckets; the others only verify them
# (ensure_topology looks first and changes nothing that is already right).
TOPOLOGY_OWNERS = ("admin", "learner")

API = "$JS.API"  # nats.js.api.DEFAULT_PREFIX, spelled here so that importing this module stays light
# Sentinel run name used to build the permissions of run="*": topology names are spelled with it, then
# every subject token that contains it is turned into a `*` wildcard.
_ANY_RUN = "zzAnyRunzz"

Permissions = dict[str, object]  # {"publish": {"allow": [...]}, "subscribe": {"allow": [...]}, "allow_responses": bool}


def _kv_stream(run: str) -> str:
    from nats.js.client import KV_STREAM_TEMPLATE

    return KV_STREAM_TEMPLATE.format(bucket=topology.kv_bucket(run))


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
    subjects += [f"{API}.STREAM.INFO.{_kv_stream(run)}", f"{API}.STREAM.INFO.{_obj_stream(run)}"]
    return subjects


def _consume(run: str, key: str) -> list[str]:
    """Fetch from and ack on the channel's shared durable pull consumer."""
    stream, durable = topology.stream_name(run, key), topology.CHANNELS[key].durable
    return [f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>"]


def _read_stream(stream: str) -> list[str]:
    """Read a stream's messages: get by sequence or last-by-subject, and ordered (ephemeral) consumers.

    `CONSUMER.CREATE.<stream>` without a name token only creates ephemeral consumers (the server
    refuses a durable name there), so a reader cannot reconfigure a role's shared durable consumer.
    Flow-control replies of ordered consumers go to `$JS.FC.<stream>.>`.
    """
    return [
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def _read_weights(run: str) -> list[str]:
    # The object store's get and list look the stream up by subject first (STREAM.NAMES).
    return [*_read_stream(_kv_stream(run)), *_read_stream(_obj_stream(run)), f"{API}.STREAM.NAMES"]


def _write_weights(run: str) -> list[str]:
    # put/update the KV key; put and delete objects (replacing or deleting an object purges its chunks).
    bucket_kv, bucket_obj = topology.kv_bucket(run), topology.object_bucket(run)
    return [f"$KV.{bucket_kv}.>", f"$O.{bucket_obj}.>", f"{API}.STREAM.PURGE.{_obj_stream(run)}"]


def _own_topology(run: str) -> list[str]:
    """Create and update the run's streams, their durable consumers, the KV bucket and the object store."""
    subjects = []
    streams = [topology.stream_name(run, key) for key in topology.CHANNELS] + [_kv_stream(run), _obj_stream(run)]
    for stream in streams:
        subjects += [f"{API}.STREAM.CREATE.{stream}", f"{API}.STREAM.UPDATE.{stream}"]
    for key, channel in topology.CHANNELS.items():
        if channel.durable:
            stream = topology.stream_name(run, key)
            subjects += [
                f"{API}.CONSUMER.CREATE.{stream}.{channel.durable}",
                f"{API}.CONSUMER.CREATE.{stream}.{channel.durable}.>",  # with a filter subject
                f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{channel.durable}",  # nats.py's form for durable_name
            ]
    return subjects


def own_inbox(user: str) -> str:
    """Where `user` receives request replies and pull-consumer deliveries (protocol.connect.inbox_prefix):
    the only inboxes it may subscribe to."""
    return f"{inbox_prefix(user)}.>"


def _everyone(run: str, role: str, user: str) -> tuple[list[str], list[str]]:
    """Every role verifies the topology, dead-letters, sends its own heartbeats and reads everyone's."""
    publish = [
        *_verify_topology(run),
        topology.subject(run, "dead"),
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
    if role == "actor":
        publish += [topology.subject(run, "traj"), topology.SIM_SUBJECT, *_consume(run, "tasks"), *_read_weights(run)]
    elif role == "scorer":
        publish += [topology.subject(run, "scored"), *_consume(run, "traj")]
        publish += [topology.judge_subject(op) for op in topology.JUDGE_OPS]
        publish += [topology.REFERENCE_SUBJECT]  # [policy] reference = "service": one request per trajectory
    elif role == "learner":
        publish += [topology.subject(run, "tasks"), *_consume(run, "scored")]
        publish += [*_read_weights(run), *_write_weights(run)]
        # It may re-read what it trained on, read the dead letters (the fates of the tasks it issued),
        # and see how far every shared consumer has got and how full every stream is (backlog).
        publish += [*_read_stream(topology.stream_name(run, "scored")), *_read_stream(topology.stream_name(run, "dead"))]
        publish += [f"{API}.CONSUMER.INFO.{topology.stream_name(run, key)}.*" for key in topology.CHANNELS]
        publish += [f"{API}.STREAM.INFO.{topology.stream_name(run, key)}" for key in topology.CHANNELS]
    elif role == "eval":
        publish += [topology.subject(run, "eval"), topology.SIM_SUBJECT, *_read_weights(run)]
        publish += [topology.judge_subject(op) for op in topology.JUDGE_OPS]
        publish += _read_stream(topology.stream_name(run, "eval"))
    elif role == "sim":
        subscribe += [topology.SIM_SUBJECT]
        responses = True
    elif role == "judge":
        subscribe += [topology.judge_subject(op) for op in topology.JUDGE_OPS]
        responses = True
    elif role == "reference":
        subscribe += [topology.REFERENCE_SUBJECT]
        responses = True
    else:
        raise ValueError(f"unknown role {role!r}; known: {ROLES}")
    if role in TOPOLOGY_OWNERS:
        publish += _own_topology(run)
    rules: Permissions = {"publish": {"allow": _unique(publish)}, "subscribe": {"allow": _unique(subscribe)}}
    if responses:
        # Services answer on the requester's reply subject only: no blanket publish right on _INBOX.>.
        rules["allow_responses"] = True
    return rules


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
    return perms


def user_name(run: str, role: str) -> str:
    """parley-<run>-<role>; run "*" gives parley-*-<role>, a user valid on every run."""
    return f"parley-{run}-{role}"


# Beyond the longest request timeout: for clocks of different hosts that disagree (a service
# answers only before the deadline its requester sent, protocol/request.py).
RESPONSE_SLACK_S = 60.0


def response_window_s(cfg=None) -> float:
    """How long a service user (sim, judge, reference) may answer a request: the longest request timeout that
    `cfg` (a RunConfig; None = the defaults) gives a requester, plus RESPONSE_SLACK_S. nats-server's own
    default is 2 minutes, shorter than the default timeouts: later replies were refused."""
    if cfg is None:
        from config.run import RunConfig

        cfg = RunConfig()
    # The actor's and the eval's simulator requests, the scorer's, replay's and the eval's judge requests,
    # the scorer's reference requests.
    return max(cfg.actor.sim_timeout_s, cfg.scorer.judge_timeout_s, cfg.scorer.reference_timeout_s) + RESPONSE_SLACK_S


def server_auth_conf(creds: dict[str, tuple[str, str]], run: str | None = None, *,
                     response_window: float | None = None) -> str:
    """The `authorization { users = [...] }` block for nats-server, one user per role of `creds`.

    `run` defaults to the run named in the user names that generate_credentials made;
    `response_window` (seconds a service may take to answer) to response_window_s() of the defaults.
    """
    if run is None:
        run = _run_of(creds)
    window = response_window_s() if response_window is None else response_window
    if not window > 0:
        raise ValueError(f"response_window={window} must be > 0 (seconds a service may take to answer)")
    perms = role_permissions(run, {role: user for role, (user, _) in creds.items()})
    users = []
    for role, (user, password) in creds.items():
        rules = perms[role]
        body = {
            "publish": {"allow": rules["publish"]["allow"]},
            "subscribe": {"allow": rules["subscribe"]["allow"]},
        }
        if rules.get("allow_responses"):
            # One reply per request, allowed for the whole window (not the server's default 2 minutes).
            body["allow_responses"] = {"max": 1, "expires": f"{math.ceil(window)}s"}
        # JSON strings are valid nats-server config strings; quoting keeps `$JS...` from reading as a variable.
        fields = f"user: {json.dumps(user)}, password: {json.dumps(password)}, permissions: {json.dumps(body)}"
        users.append(f"    {{{fields}}}")
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def _run_of(creds: dict[str, tuple[str, str]]) -> str:
    user, _ = next(iter(creds.values()))
    role = next(iter(creds))
    prefix, suffix = "parley-", f"-{role}"
    if not (user.startswith(prefix) and user.endswith(suffix)):
        raise ValueError(f"cannot tell the run from user {user!r}; pass run= explicitly")
    return user[len(prefix) : -len(suffix)]


def generate_credentials(run: str, out_dir: str | Path, roles: tuple[str, ...] = ROLES, *,
                         response_window: float | None = None) -> dict[str, tuple[str, str]]:
    """Make a fresh user and password per role for `run` (or "*": every run); write auth.conf and
    <role>.env (mode 0600). `response_window`: see server_auth_conf (pass response_window_s(cfg)).

    auth.conf is the server side (include it in a nats-server config or pass it as NatsServer's
    extra_conf); <role>.env holds PARLEY_NATS_USER / PARLEY_NATS_PASSWORD for that role's processes
    (learner.env also the eval role's, as PARLEY_EVAL_NATS_USER / PASSWORD, for its periodic eval child).
    Returns {role: (user, password)}.
    """
    if run != "*":
        topology.check_run(run)
    for role in roles:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known: {ROLES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    creds = {role: (user_name(run, role), secrets.token_urlsafe(24)) for role in roles}
    write_private(out / "auth.conf", server_auth_conf(creds, run, response_window=response_window))
    for role, (user, password) in creds.items():
        text = f"PARLEY_NATS_USER={user}\nPARLEY_NATS_PASSWORD={password}\n"
        if role == "learner" and "eval" in creds:
            text += f"PARLEY_EVAL_NATS_USER={creds['eval'][0]}\nPARLEY_EVAL_NATS_PASSWORD={creds['eval'][1]}\n"
        write_private(out / f"{role}.env", text)
    return creds


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines of a <role>.env file, for starting a role with its credentials."""
    env = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


K8S_SECRET = "parley-nats-credentials"


def k8s_secret(auth_dir: str | Path, name: str = K8S_SECRET) -> str:
    """A Secret manifest with auth.conf (for the NATS pods) and <role>-user / <role>-password keys
    (for the role pods' PARLEY_NATS_USER / PARLEY_NATS_PASSWORD), from generate_credentials' files."""
    auth_dir = Path(auth_dir)
    data = {"auth.conf": (auth_dir / "auth.conf").read_text()}
    for role in ROLES:
        env_file = auth_dir / f"{role}.env"
        if env_file.exists():
            env = read_env_file(env_file)
            data[f"{role}-user"] = env["PARLEY_NATS_USER"]
            data[f"{role}-password"] = env["PARLEY_NATS_PASSWORD"]
    manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque", "stringData": data}
    return json.dumps(manifest, indent=2) + "\n"  # JSON is YAML; no YAML writer needed


def main(argv: list[str] | None = None) -> int:
    """`python -m deploy.auth credentials RUN DIR` | `topology [--config F] [--set k=v]` | `k8s-secret DIR`
    | `permissions RUN`.

    `topology` creates the run's streams as the admin user (PARLEY_NATS_USER/PASSWORD from admin.env),
    so that the other roles, which may only verify it, can start in any order after it.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m deploy.auth", description=main.__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("credentials", help="write auth.conf and <role>.env for a run")
    c.add_argument("run")
    c.add_argument("out_dir")
    c.add_argument("--config", default=None, help="the run config whose request timeouts the services' reply window covers")
    c.add_argument("--set", dest="sets", action="append", default=[])
    t = sub.add_parser("topology", help="create the run's streams, consumers and buckets (as admin)")
    t.add_argument("--config", default=None)
    t.add_argument("--set", dest="sets", action="append", default=[])
    t.add_argument("--wait", type=float, default=120.0, help="seconds to keep retrying while NATS/JetStream starts")
    p = sub.add_parser("permissions", help="print the permissions of every role as JSON")
    p.add_argument("run")
    k = sub.add_parser("k8s-secret", help="print a Kubernetes Secret of a credentials dir (see deploy/k8s/secret.yaml)")
    k.add_argument("auth_dir")
    k.add_argument("--name", default=K8S_SECRET)
    args = parser.parse_args(argv)
    if args.cmd == "k8s-secret":
        print(k8s_secret(args.auth_dir, args.name), end="")
        return 0
    if args.cmd == "credentials":
        from config.run import ConfigError, load_config

        try:
            cfg = load_config(args.config, args.sets)
        except ConfigError as e:
            print(f"deploy.auth: bad configuration: {e}", file=sys.stderr)
            return 2
        creds = generate_credentials(args.run, args.out_dir, response_window=response_window_s(cfg))
        print(f"wrote {Path(args.out_dir) / 'auth.conf'} and {', '.join(f'{r}.env' for r in creds)}")
        return 0
    if args.cmd == "permissions":
        print(json.dumps(role_permissions(args.run), indent=2))
        return 0
    return _topology(args.config, args.sets, args.wait)


def _topology(config: str | None, sets: list[str], wait: float) -> int:
    import asyncio
    import time

    from nats.js.errors import APIError

    from config.run import ConfigError, load_config
    from protocol.connect import NatsUnreachable, connect

    # Same environment overrides as the role commands' --nats / --run options.
    env = [f'nats.url="{os.environ["PARLEY_NATS_URL"]}"'] if os.environ.get("PARLEY_NATS_URL") else []
    env += [f'run.name="{os.environ["PARLEY_RUN"]}"'] if os.environ.get("PARLEY_RUN") else []
    try:
        cfg = load_config(config, env + sets)
    except ConfigError as e:
        print(f"deploy.auth: bad configuration: {e}", file=sys.stderr)
        return 2

    async def run() -> None:
        nc = await connect(
            cfg.nats.url, name="parley-topology", first_timeout=cfg.nats.connect_timeout_s,
            creds=cfg.nats.creds or None, ca_file=cfg.nats.ca_file or None,
        )  # fmt: skip
        try:
            await topology.ensure_topology(nc.jetstream(), cfg.run.name, cfg.bus)
        finally:
            await nc.drain()

    deadline = time.monotonic() + wait
    while True:
        try:
            asyncio.run(run())
            break
        except (NatsUnreachable, topology.TopologyError, APIError) as e:
            # A cluster that is still electing its JetStream leader answers 503 for a few seconds.
            if time.monotonic() > deadline:
                print(f"deploy.auth: {e}", file=sys.stderr)
                return 3
            print(f"deploy.auth: not yet ({e}); retrying", file=sys.stderr)
            time.sleep(2.0)
    print(f"topology of run {cfg.run.name!r} is in place on {cfg.nats.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
