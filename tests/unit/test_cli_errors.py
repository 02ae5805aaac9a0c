"""Bad configuration and bad command-line values, through the real `parley` entry point: each
fails at once with exit code 2 and exactly one line on stderr that names the field (or option)
and what is allowed, before any engine, DeepSpeed or NATS connection is touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (argv after `parley`, fragments the one stderr line must contain)
CASES = [
    # config values, via --set
    (["actor", "--set", "actor.concurrency=0"], ["--set actor.concurrency=0:", "actor.concurrency = 0", "an int >= 1"]),
    (["learner", "--set", "learner.loss_agg=x"], ["learner.loss_agg = 'x'", "token-mean", "seq-mean-token-sum"]),
    (["learner", "--set", "learner.zero_stage=5"], ["learner.zero_stage = 5", "one of 0, 1, 2, 3"]),
    (["learner", "--set", "weights.kind=ftp"], ["kind='ftp'", "[weights]", "objstore", "nccl"]),
    (["learner", "--set", "learner.stale_policy=keep"], ["learner.stale_policy = 'keep'", "one of 'correct', 'drop'"]),
    (["scorer", "--set", "scorer.bleu_variant=foo"], ["bleu_variant='foo'", "sacrebleu", "char"]),
    (["scorer", "--set", "scorer.weights={fluency=1.0}"], ["'fluency'", "bleu", "interactivity", "token_amount"]),
    (["judge", "--set", "judge.temperature=-1"], ["judge.temperature = -1", "a float >= 0.0", "0 is greedy"]),
    (["actor", "--set", "actor.engine.dtype=int8"], ["actor.engine.dtype = 'int8'", "float32", "bfloat16"]),
    (["actor", "--set", "rollout.n=1"], ["rollout.n = 1", "an int >= 2 and <= 1024", "GRPO needs a group"]),
    # a run that trains recomputes the distribution it sampled from (config.run.check_training)
    (
        ["learner", "--set", "actor.sampling.temperature=0"],
        ["actor.sampling.temperature=0", "temperature >= 1e-05", "greedily"],
    ),
    (
        ["up", "--set", "actor.sampling.top_p=0.9"],
        ["actor.sampling.top_p=0.9", "top_p = 1.0", "actor.sampling.temperature"],
    ),
    (
        ["learner", "--set", "actor.sampling.temperature=0.7", "--set", "policy.reference=service"],
        ["actor.sampling.temperature=0.7", "policy.reference='service'", "raw model", "reference='local'"],
    ),
    (["scorer", "--set", "bus.replicas=2"], ["bus.replicas = 2", "one of 1, 3, 5"]),
    (["actor", "--set", "bus.ack_wait_s=0"], ["bus.ack_wait_s = 0", "a float > 0"]),
    (["actor", "--set", "actor.nope=1"], ["actor.nope: unknown key", "[actor] has engine, concurrency"]),
    (["actor", "--set", "actor.concurrency=abc"], ["actor.concurrency = 'abc'", "expected an int >= 1, got `str`"]),
    (["actor", "--set", "actor.sampling.top_p=2"], ["actor.sampling.top_p = 2", "a float > 0.0 and <= 1.0"]),
    (["actor", "--set", "actor"], ["'actor'", "section.key=value"]),
    (["actor", "--run", "bad.name"], ["run.name = 'bad.name'", "A-Z a-z 0-9 _ -"]),
    (["actor", "--config", "/nonexistent/parley.toml"], ["/nonexistent/parley.toml", "does not exist"]),
    # values given as options of a role command
    (["sim", "--backend", "foo"], ["sim.backend = 'foo'", "one of 'openai', 'vllm'"]),
    (["sim", "--backend", "openai"], ["backend='openai'", "base_url"]),
    (["sim", "--backend", "openai", "--base-url", "http://127.0.0.1:9/v1"], ["sim.model_name", "--model-name"]),
    (["sim", "--user-sim-prompt", "shouty"], ["sim.prompt = 'shouty'", "lazy_full", "lazy_summary", "cooperative"]),
    (["actor", "--concurrency", "0"], ["actor.concurrency = 0", ">= 1"]),
    (["actor", "--set", "actor.engine.model=no-such-model"], ["actor.engine.model='no-such-model'", "tiny", "smol"]),
    (["services", "--set", "sim.engine.model=tiny"], ["sim.engine.model='tiny'", "judge.engine.model='smol'"]),
    # option parsing itself (typer): one line too, naming the option
    (["actor", "--concurrency", "abc"], ["parley actor", "'--concurrency'", "integer"]),
    (["learner", "--steps", "many"], ["parley learner", "'--steps'", "integer"]),
    (["actor", "--bogus"], ["parley actor", "--bogus"]),
    (["nats", "--port", "http"], ["parley nats", "'--port'", "integer"]),
]


def parley(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    # The same entry point as the `parley` script; prog name set so messages read "parley <role>".
    code = "import sys; sys.argv[0] = 'parley'; from parley.deploy.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("argv,fragments", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_value_is_one_line_naming_the_field(argv, fragments):
    out = parley(*argv)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, f"exit {out.returncode}; stderr:\n{out.stderr}"
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{out.stderr}"
    missing = [f for f in fragments if f not in lines[0]]
    assert not missing, f"{missing} not in: {lines[0]}"
    assert out.stdout == ""


def test_a_key_no_release_ever_had_is_refused_as_unknown():
    """Nothing was released before actor.sampling: its earlier name is an unknown key, one line, exit 2."""
    out = parley("learner", "--set", "actor.temperature=0")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "actor.temperature" in lines[0]


def test_bad_values_fail_before_heavy_imports():
    """The error comes from option parsing and config validation alone: no torch, vLLM or DeepSpeed."""
    code = (
        "import atexit, sys\n"
        "heavy = ('torch', 'vllm', 'deepspeed', 'transformers')\n"
        "atexit.register(lambda: print('heavy:', sorted(m for m in heavy if m in sys.modules)))\n"
        "sys.argv = ['parley', *sys.argv[1:]]\n"
        "from parley.deploy.cli import main\n"
        "main()\n"
    )
    for argv in (
        ["actor", "--set", "actor.engine.model=no-such-model"],
        ["learner", "--set", "learner.loss_agg=x"],
        ["sim", "--backend", "foo"],
        ["scorer", "--set", "scorer.bleu_variant=foo"],
    ):
        out = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert "heavy: []" in out.stdout, f"{argv}: {out.stdout}"


def test_good_values_still_work():
    """The one-line error path does not swallow success, --help or a role's own exit code."""
    assert parley("actor", "--dry-run", "--set", "actor.concurrency=3").returncode == 0
    # an actor alone may sample otherwise: the eval fleet's actors play at the eval's temperature
    assert parley("actor", "--dry-run", "--set", "actor.sampling.temperature=0.7").returncode == 0
    # and a run that trains may sample at 0.7: the learner recomputes softmax(logits / 0.7)
    assert parley("learner", "--dry-run", "--set", "actor.sampling.temperature=0.7").returncode == 0
    assert parley("--help").returncode == 0
    # exit code 3 and the NATS URL when the server is unreachable (deploy.common.run_main)
    out = parley("scorer", "--nats", "nats://127.0.0.1:1", "--set", "nats.connect_timeout_s=1")
    assert out.returncode == 3 and "nats://127.0.0.1:1" in out.stderr, out.stderr


def test_a_role_crash_is_not_mistaken_for_a_usage_error():
    """An exception inside a command keeps its own traceback and a non-zero exit."""
    code = (
        "import sys\n"
        "sys.argv = ['parley', 'boom']\n"
        "from parley.deploy.cli import app, main\n"
        "@app.command('boom')\n"
        "def boom():\n"
        "    raise RuntimeError('kaboom')\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.rstrip().endswith("RuntimeError: kaboom"), out.stderr[-2000:]
