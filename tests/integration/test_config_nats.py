"""The `[nats]` section of a config file reaches every `parley` command and role (runtime/role.py):
against a real nats-server with per-role users and TLS, a CA given only as `[nats] ca_file` lets
`parley selfcheck`, `parley replay`, `parley top` and `parley scorer` in, and a `[nats] creds` file
given only in the config is the one each command and role tries (it names it when it is refused).
Against a nats-server in operator (JWT) mode, a real `.creds` file given only as `[nats] creds` logs
`parley selfcheck` and `parley replay` in (JetStream included), and without it they are refused.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from parley.deploy.credentials import generate_credentials, read_env_file, server_auth_conf
from parley.deploy.natsserver import NatsServer
from parley.protocol import topology
from parley.protocol.connect import connect
from tests.integration.nats_operator import operator_setup
from tests.integration.test_auth import make_tls

pytestmark = pytest.mark.integration
PARLEY = [sys.executable, "-m", "parley.deploy.cli"]
RUN = "cfgnats"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """A nats-server that takes only its role users and speaks only TLS, its CA in a config file."""
    d = tmp_path_factory.mktemp("cfgnats")
    ca, cert, key = make_tls(d / "tls")
    creds = generate_credentials(RUN, d / "auth")
    tls = f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n'
    server = NatsServer(d / "nats", port=0, extra_conf=server_auth_conf(creds) + tls)
    server.start()
    url = server.url.replace("nats://", "tls://")
    config = d / "run.toml"
    config.write_text(f'[run]\nname = "{RUN}"\n\n[nats]\nurl = "{url}"\nca_file = "{ca}"\nconnect_timeout_s = 5\n')
    yield url, ca, d / "auth", config
    server.stop()


def role_env(auth_dir, role: str) -> dict[str, str]:
    """The process environment of `role`: its user from <role>.env, and no NATS settings of the test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_NATS")}
    env.pop("PARLEY_RUN", None)
    return env | read_env_file(auth_dir / f"{role}.env")


def parley(*args, env, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*PARLEY, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_ca_file_from_the_config_reaches_selfcheck_replay_and_top(tls_server):
    url, _, auth_dir, config = tls_server
    admin = role_env(auth_dir, "admin")
    out = parley("selfcheck", "--external", "--config", str(config), "--run", RUN, env=admin)
    assert out.returncode == 0, out.stderr
    assert "5/5 message types round-tripped" in out.stdout

    # the scored record selfcheck left on the stream, read back and re-weighted
    out = parley("replay", "--stream", "scored", "--config", str(config), env=role_env(auth_dir, "learner"))
    assert out.returncode == 0, out.stderr
    assert "1 conversations" in out.stdout

    top = subprocess.Popen(
        [*PARLEY, "top", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=role_env(auth_dir, "actor"),
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # connected: it watches until told to stop
            top.wait(8)
    finally:
        top.send_signal(signal.SIGINT)
        shown, err = top.communicate(timeout=30)
    assert top.returncode == 0, err
    assert RUN in shown


async def test_ca_file_from_the_config_reaches_a_role(tls_server):
    url, ca, auth_dir, config = tls_server
    # the run's topology, as an admin makes it before the roles start
    out = parley("selfcheck", "--external", "--config", str(config), "--run", RUN, env=role_env(auth_dir, "admin"))
    assert out.returncode == 0, out.stderr
    admin = read_env_file(auth_dir / "admin.env")
    watcher = await connect(
        url, name="watcher", user=admin["PARLEY_NATS_USER"], password=admin["PARLEY_NATS_PASSWORD"], ca_file=ca
    )
    seen = asyncio.Queue()
    await watcher.subscribe(topology.status_subject(RUN, "scorer", "*"), cb=seen.put)
    scorer = subprocess.Popen(
        [*PARLEY, "scorer", "--config", str(config), "--id", "scorer-cfg"],
        stderr=subprocess.PIPE,
        text=True,
        env=role_env(auth_dir, "scorer"),
    )
    try:
        msg = await asyncio.wait_for(seen.get(), timeout=60)
        assert b"scorer-cfg" in msg.data
    finally:
        scorer.send_signal(signal.SIGTERM)
        _, err = scorer.communicate(timeout=30)
        await watcher.close()
    assert scorer.returncode == 0, err


@pytest.mark.parametrize(
    "command",
    [
        ["selfcheck", "--external"],
        # one command of each way in stays in `make test` (a tool, the eval, a role, the learner); the rest
        # connect through the same deploy.common.resolve and runtime.role paths: extended tier
        pytest.param(["replay", "--stream", "scored"], marks=pytest.mark.extended),
        pytest.param(["top"], marks=pytest.mark.extended),
        pytest.param(["auth", "topology", "--wait", "0"], marks=pytest.mark.extended),
        pytest.param(
            ["eval", "--services", "nats", "--condition", "base=tiny", "--n-items", "1"], marks=pytest.mark.extended
        ),
        pytest.param(["scorer", "--id", "scorer-creds"], marks=pytest.mark.extended),
        ["actor", "--id", "actor-creds"],
        pytest.param(["sim", "--id", "sim-creds"], marks=pytest.mark.extended),
        ["learner"],
    ],
    ids=lambda c: c[0],
)
def test_creds_from_the_config_are_the_ones_used(tls_server, tmp_path, command):
    """`[nats] creds` only in the config file: the command connects with that file, not as the
    (valid) user in its environment. The file is not one the server accepts, so the command exits 3
    and its one line names the file."""
    url, ca, auth_dir, config = tls_server
    creds = tmp_path / "cfg-only.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\nnot-a-jwt\n------END NATS USER JWT------\n")
    with_creds = tmp_path / "run.toml"
    with_creds.write_text(config.read_text().replace("[nats]\n", f'[nats]\ncreds = "{creds}"\n'))
    out = parley(*command, "--config", str(with_creds), env=role_env(auth_dir, "admin"), timeout=180)
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr)
    assert str(creds) in out.stderr, out.stderr


OP_RUN = "credsjwt"


@pytest.fixture(scope="module")
def operator_server(tmp_path_factory):
    """A nats-server that trusts only an operator made by the test (tests/integration/nats_operator.py):
    its one JetStream account's user logs in with a .creds file, nobody else gets in."""
    d = tmp_path_factory.mktemp("credsjwt")
    setup = operator_setup()
    creds = setup.write_creds(d / "user.creds")
    server = NatsServer(d / "nats", port=0, extra_conf=setup.server_conf())
    server.start()
    base = f'[run]\nname = "{OP_RUN}"\n\n[nats]\nurl = "{server.url}"\nconnect_timeout_s = 5\n'
    with_creds, without = d / "creds.toml", d / "nocreds.toml"
    with_creds.write_text(base.replace("[nats]\n", f'[nats]\ncreds = "{creds}"\n'))
    without.write_text(base)
    yield with_creds, without, creds
    server.stop()


def bare_env() -> dict[str, str]:
    """The test's environment without any NATS credentials or run: only the config file can log in."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_NATS") and k != "PARLEY_RUN"}


def test_a_creds_file_from_the_config_logs_in_to_an_operator_mode_server(operator_server):
    with_creds, _, creds = operator_server
    out = parley("selfcheck", "--external", "--config", str(with_creds), "--run", OP_RUN, env=bare_env())
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "5/5 message types round-tripped" in out.stdout

    # the scored record selfcheck left on its JetStream stream, read back with the same file
    out = parley("replay", "--stream", "scored", "--config", str(with_creds), env=bare_env())
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "1 conversations" in out.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["selfcheck", "--external", "--run", OP_RUN],
        # the same deploy.common.resolve path as selfcheck: extended tier
        pytest.param(["replay", "--stream", "scored"], marks=pytest.mark.extended),
    ],
    ids=lambda c: c[0],
)
def test_without_the_creds_file_the_operator_mode_server_refuses(operator_server, command):
    _, without, _ = operator_server
    out = parley(*command, "--config", str(without), env=bare_env())
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr)
    assert "authorization violation" in out.stderr.lower(), out.stderr


def test_a_creds_file_of_another_operator_is_refused(operator_server, tmp_path):
    """The server checks the chain: a well-formed .creds file whose account it does not trust is refused."""
    with_creds, _, creds = operator_server
    foreign = operator_setup("elsewhere").write_creds(tmp_path / "foreign.creds")
    config = tmp_path / "foreign.toml"
    config.write_text(with_creds.read_text().replace(str(creds), str(foreign)))
    out = parley("selfcheck", "--external", "--config", str(config), "--run", OP_RUN, env=bare_env())
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr)
    assert str(foreign) in out.stderr, out.stderr
