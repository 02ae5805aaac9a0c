"""The deploy files match the code: every parley command a container or job starts in compose, k8s
and Slurm (deploy/; the Helm values configure the NATS chart and start no parley command) is run
through the CLI with --dry-run, in the environment the file gives it and on the run file it mounts,
and must succeed; commands without --dry-run are parsed by the CLI's own parser. Every role gets the
environment the roles read (its NATS user and password, the eval role's for the learner, the metrics
port) and, where it has its own network, the metrics port it serves."""

from __future__ import annotations

import functools
import os
import re
import shlex
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml

from parley.deploy.common import METRICS_PORT_ENV
from parley.deploy.credentials import generate_credentials, read_env_file
from parley.evaluation.periodic import EVAL_PASSWORD_ENV, EVAL_USER_ENV
from parley.protocol.connect import PASSWORD_ENV, USER_ENV

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
REFERENCE_RUN = DEPLOY / "configs" / "reference-8gpu.toml"
ROLE_COMMANDS = ("sim", "judge", "actor", "scorer", "learner", "services", "reference")


def role_env(role: str) -> set[str]:
    """What a role's process reads to log in and serve metrics."""
    return {USER_ENV, PASSWORD_ENV, METRICS_PORT_ENV} | (
        {EVAL_USER_ENV, EVAL_PASSWORD_ENV} if role == "learner" else set()
    )


def parley_argv(words: list[str]) -> list[str] | None:
    """The arguments of the `parley` CLI inside a command line (`parley X ...`, `--module parley.deploy.cli X ...`)."""
    for i, w in enumerate(words):
        if w == "parley" or (w == "parley.deploy.cli" and i and words[i - 1] == "--module"):
            return words[i + 1 :]
    return None


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def compose_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    services = load(DEPLOY / "compose.yaml")[0]["services"]
    out = []
    for name, svc in services.items():
        command = svc.get("command")
        if not command or not str(svc.get("image", "")).startswith("${PARLEY_IMAGE"):
            continue
        if command[:2] == ["sh", "-c"]:  # the actor's GPU claim script: its parley line
            (line,) = [ln for ln in command[2].replace("\\\n", " ").splitlines() if "parley " in ln]
            words = shlex.split(line.replace("$$", "$"))
        else:
            words = list(command)
        out.append((f"compose {name}", parley_argv(words), {k: str(v) for k, v in svc["environment"].items()}))
    return out


def k8s_commands() -> list[tuple[str, list[str], dict[str, str], dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for d in load(path):
            if d.get("kind") not in ("Deployment", "StatefulSet", "Job"):
                continue
            for c in d["spec"]["template"]["spec"]["containers"]:
                argv = parley_argv(c.get("command", []) + c.get("args", []))
                if argv is not None:
                    env = {e["name"]: e.get("value", "<from the Secret>") for e in c.get("env", [])}
                    out.append((f"k8s {path.name}/{c['name']}", argv, env, {"doc": d, "container": c}))
    return out


def slurm_commands() -> list[tuple[str, list[str], str]]:
    """(name, argv, the role whose user runs it) of every `start NAME as_role ROLE ... parley ...` line."""
    text = (DEPLOY / "slurm" / "run.sbatch").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:start (\S+) )?as_role (\S+) (.*)", line)
        if m and (argv := parley_argv(shlex.split(m.group(3)))) is not None:
            out.append((f"slurm {m.group(1) or m.group(2)}", argv, m.group(2)))
    return out


_MODELS = re.compile(r"/models/([A-Za-z0-9._-]+)")


@functools.cache
def _models_root() -> Path:
    """A folder standing in for the deployments' /models volume: each model named there as a
    directory with a minimal transformers config.json (the start checks read model_type)."""
    root = Path(tempfile.gettempdir()) / f"parley-test-models-{os.getpid()}"
    for text in [
        REFERENCE_RUN.read_text(),
        *(f.read_text() for f in DEPLOY.rglob("*") if f.suffix in (".yaml", ".sbatch")),
    ]:
        for name in _MODELS.findall(text):
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / "config.json").write_text('{"model_type": "qwen3"}')
    return root


def _local_models(run_file: Path) -> Path:
    text = _MODELS.sub(lambda m: str(_models_root() / m.group(1)), run_file.read_text())
    out = _models_root() / f"run-{run_file.parent.name}-{run_file.name}"
    out.write_text(text)
    return out


def dry_run(argv: list[str], run_file: Path, env: dict[str, str]) -> None:
    """Run `parley ARGV` with --dry-run (or, for a command without it, parse it) on `run_file` for
    /config/run.toml and the shell's $CONFIG, $MP; fails with the CLI's message."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    # The deployments read their models from /models (a volume there); the start checks want each one
    # to exist with a config.json, so here they are laid out under a folder of the test's.
    run_file = _local_models(run_file)
    argv = [_MODELS.sub(lambda m: str(_models_root() / m.group(1)), a) for a in argv]
    argv = [str(run_file) if a in ("/config/run.toml", "$CONFIG") else "9400" if a == "$MP" else a for a in argv]
    group = get_command(app)
    ctx = group.make_context("parley", list(argv), resilient_parsing=True)
    cmd = group.get_command(ctx, argv[0])
    assert cmd is not None, f"`parley {argv[0]}` is not a parley command"
    if any(p.name == "dry" for p in cmd.params):
        out = CliRunner().invoke(app, [*argv, "--dry-run"], env=env)
        assert out.exit_code == 0, f"parley {shlex.join(argv)} --dry-run: {out.output[-2000:]}"
        tomllib.loads(out.output)  # the resolved run file
    else:  # a group (`auth topology`) or a command without --dry-run: the parser alone
        sub, rest = cmd, argv[1:]
        while hasattr(sub, "get_command"):
            sub, rest = sub.get_command(ctx, rest[0]), rest[1:]
        sub.make_context(argv[0], rest, parent=ctx)


@pytest.fixture(scope="module")
def k8s_run_file(tmp_path_factory) -> Path:
    (cm,) = load(K8S / "configmap.yaml")
    path = tmp_path_factory.mktemp("k8s") / "run.toml"
    path.write_text(cm["data"]["run.toml"])
    return path


def test_the_deploy_files_start_every_role():
    started = {argv[0] for _, argv, *_ in compose_commands() + k8s_commands() + slurm_commands()}
    assert {"sim", "judge", "actor", "scorer", "learner"} <= started


@pytest.mark.parametrize("name, argv, env", compose_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_compose_commands_run_dry(name, argv, env):
    dry_run(argv, REFERENCE_RUN, env)


@pytest.mark.parametrize("name, argv, env, where", k8s_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_k8s_commands_run_dry(name, argv, env, where, k8s_run_file):
    dry_run(argv, k8s_run_file, env)


@pytest.mark.parametrize("name, argv, role", slurm_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_slurm_commands_run_dry(name, argv, role):
    dry_run(argv, REFERENCE_RUN, {})


def test_a_command_the_cli_refuses_fails_the_check():
    with pytest.raises(AssertionError, match="--dry-run"):
        dry_run(["actor", "--config", "$CONFIG", "--no-such-option"], REFERENCE_RUN, {})
    with pytest.raises(AssertionError, match="--dry-run"):
        dry_run(["scorer", "--config", "$CONFIG", "--set", "scorer.no_such_key=1"], REFERENCE_RUN, {})


def test_compose_roles_get_what_they_read(tmp_path):
    generate_credentials("reference", tmp_path)
    services = load(DEPLOY / "compose.yaml")[0]["services"]
    for name, argv, env in compose_commands():
        role = argv[0]
        if role not in ROLE_COMMANDS:
            continue
        svc = services[name.split()[1]]
        (env_file,) = [svc["env_file"]] if isinstance(svc["env_file"], str) else svc["env_file"]
        # `export KEY=VALUE` lines: compose's env_file drops the `export` as read_env_file does
        generated = read_env_file(tmp_path / Path(env_file).name)
        missing = role_env(role) - set(env) - set(generated)
        assert not missing, f"{name} does not get {sorted(missing)}"
        assert env[METRICS_PORT_ENV] in {str(p) for p in svc.get("expose", [])}, (
            f"{name} does not expose its metrics port"
        )
        assert "PARLEY_NATS_URL" in env


def test_k8s_roles_get_what_they_read():
    for name, argv, env, where in k8s_commands():
        role = argv[0]
        if role not in ROLE_COMMANDS:
            continue
        missing = role_env(role) - set(env)
        assert not missing, f"{name} does not get {sorted(missing)}"
        keys = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in where["container"]["env"] if "valueFrom" in e}
        assert keys[USER_ENV] == f"{role}-user" and keys[PASSWORD_ENV] == f"{role}-password", name
        ports = {p["name"]: p["containerPort"] for p in where["container"].get("ports", [])}
        assert str(ports.get("metrics")) == env[METRICS_PORT_ENV], (
            f"{name}: no container port 'metrics' = {env[METRICS_PORT_ENV]}"
        )
        annotations = where["doc"]["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/port") == env[METRICS_PORT_ENV], (
            f"{name}: the pod does not say where to scrape"
        )


def test_slurm_roles_run_as_their_user_on_their_own_metrics_port():
    text = (DEPLOY / "slurm" / "run.sbatch").read_text()
    for name, argv, role in slurm_commands():
        if argv[0] not in ROLE_COMMANDS:
            continue
        assert role == argv[0], f"{name} runs `parley {argv[0]}` as the {role} user"
        assert argv[argv.index("--metrics-port") + 1] == "$MP", f"{name} serves no metrics"
        assert f"next_port {name.split()[1]}\n" in text, f"{name} takes no metrics port of its own"
