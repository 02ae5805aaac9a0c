"""Every check before any work (issue 59, item 2): bounds on every numeric field, unknown keys with a
suggestion and the source of the bad value, one source of defaults (a file is laid over the embedded
default), and `--dry-run` making every check a real start makes; a refused `parley up` creates
nothing. Through the real `parley` entry point where the exit code and stderr matter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from parley.config.run import ConfigError, default_config_path, load_config, recipe_data

REPO = Path(__file__).resolve().parents[2]


def parley(*args: str, env: dict | None = None, cwd: Path = REPO, timeout: float = 90.0):
    import os

    code = "import sys; sys.argv[0] = 'parley'; from parley.deploy.cli import main; main()"
    full = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full
    )


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# (override, what the one-line error must say): each value was accepted before
BOUNDS = [
    ("learner.lr=-1", "learner.lr = -1: expected a float > 0"),
    ("learner.kl_coef=-1", "learner.kl_coef = -1: expected a float >= 0"),
    ("learner.warmup_steps=-5", "learner.warmup_steps = -5: expected an int >= 0"),
    ("learner.grad_clip=-1", "learner.grad_clip = -1: expected a float >= 0"),
    ("learner.dual_clip=0.5", "dual_clip=0.5"),
    ("learner.steps=-5", "learner.steps = -5: expected an int >= 0"),
    ("learner.weight_decay=-0.1", "learner.weight_decay = -0.1: expected a float >= 0"),
    ("learner.clip_low=1.5", "learner.clip_low = 1.5: expected a float >= 0.0 and < 1.0"),
    ("rollout.max_new_turns=-3", "rollout.max_new_turns = -3: expected an int >= 1"),
    ("rollout.max_tokens=0", "rollout.max_tokens = 0: expected an int >= 1"),
    ("rollout.futures=-1", "rollout.futures = -1: expected an int >= 0"),
    ("up.scorers=0", "up.scorers = 0: expected an int >= 1"),
    ("up.actors=0", "up.actors = 0: expected an int >= 1"),
    ('policy.model=""', "policy.model = '': expected a non-empty str"),
    ("nats.connect_timeout_s=0", "nats.connect_timeout_s = 0: expected a float > 0"),
    ("actor.sim_timeout_s=-1", "actor.sim_timeout_s = -1: expected a float > 0"),
]


@pytest.mark.parametrize("override,needle", BOUNDS, ids=[o for o, _ in BOUNDS])
def test_every_numeric_field_has_its_bounds_and_the_error_names_the_set(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"--set {override}: "), e.value
    assert needle in str(e.value)


def test_an_unknown_key_gets_the_closest_known_one_and_its_source(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^--set learner.lrr=1: learner.lrr: unknown key; did you mean 'learner.lr'\?$"
    ):
        load_config(None, ["learner.lrr=1"])
    f = tmp_path / "mine.toml"
    f.write_text("[learner]\nkl_coeff = 0.0\n")
    with pytest.raises(ConfigError, match=rf"^{f}: learner.kl_coeff: unknown key; did you mean 'learner.kl_coef'\?$"):
        load_config(f)
    # an unknown section: our own line, not msgspec's "Object contains unknown field"
    with pytest.raises(
        ConfigError, match=r"^--set lerner.lr=1: \[lerner\]: unknown section; did you mean 'learner'\?$"
    ):
        load_config(None, ["lerner.lr=1"])
    with pytest.raises(ConfigError, match=r"^--set nosuch.x=1: \[nosuch\]: unknown section; the sections are run, env"):
        load_config(None, ["nosuch.x=1"])


def test_a_bad_value_in_a_file_is_blamed_on_the_file_not_the_default(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text("[rollout]\nn = 1\n")
    with pytest.raises(ConfigError, match=rf"^{f}: rollout.n = 1: expected an int >= 2"):
        load_config(f)


def test_a_config_directory_is_one_line_naming_a_file_in_it():
    with pytest.raises(ConfigError, match=r"is a directory; give a TOML file, e.g. .*default.toml"):
        load_config(REPO / "deploy" / "configs")


def _leaves(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], x


def test_one_source_of_defaults_a_file_says_only_what_differs(tmp_path):
    """A file is laid over the embedded default: every key it does not set has the embedded default's
    value (before, 13 keys silently took the code's other defaults: lr, eval_every, the BLEU variant...)."""
    f = tmp_path / "small.toml"
    f.write_text('[run]\nname = "small"\n')
    default = dict(_leaves(msgspec.to_builtins(load_config(None))))
    small = dict(_leaves(msgspec.to_builtins(load_config(f))))
    differ = {k: (default.get(k), v) for k, v in small.items() if default.get(k) != v}
    assert differ == {"run.name": ("local", "small")}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "deploy" / "configs").glob("*.toml")))
def test_every_shipped_config_loads_and_keeps_the_default_where_it_is_silent(name):
    import tomllib

    path = REPO / "deploy" / "configs" / name
    cfg = msgspec.to_builtins(load_config(path))
    default = dict(_leaves(msgspec.to_builtins(load_config(default_config_path()))))
    data = tomllib.loads(path.read_text())
    written = {k for k, _ in _leaves(data)}
    if recipe := data.get("run", {}).get("recipe"):  # the recipe's keys are the file's (docs/recipe.md)
        written |= {k for k, _ in _leaves(recipe_data(recipe))}
    # what the environment fills in from other keys ([scorer] weights, [env] options, sim_prompt, eval_metric)
    derived = ("env.", "scorer.weights", "rollout.sim_prompt", "learner.eval_metric")
    silent = {
        k: (default.get(k), v)
        for k, v in _leaves(cfg)
        if k in default and not k.startswith(derived) and not any(k == w or k.startswith(w + ".") for w in written)
    }
    assert {k: d for k, d in silent.items() if d[0] != d[1]} == {}


def test_dry_run_refuses_what_a_real_start_refuses():
    for argv, needle in (
        (["--steps", "-5"], "--steps -5: learner.steps = -5: expected an int >= 0"),
        (["--steps", "0"], "learner.steps=0: up stops after the learner's last step; give --steps >= 1"),
        (["--scorers", "0"], "--scorers 0: up.scorers = 0: expected an int >= 1"),
        (
            ["--set", "policy.model=/no/such/model"],
            "policy.model: model '/no/such/model': no such checkpoint directory",
        ),
        (["--set", "data.path=/no/such.parquet"], "data.path='/no/such.parquet': no such file"),
        (["--config", str(REPO / "deploy" / "configs")], "is a directory; give a TOML file"),
    ):
        out = parley("up", *argv, "--dry-run")
        assert out.returncode == 2, (argv, out.stderr)
        assert lines(out.stderr) and len(lines(out.stderr)) == 1, (argv, out.stderr)
        assert needle in out.stderr, (argv, out.stderr)
        assert out.stdout == ""


def test_dry_run_gives_one_line_per_problem():
    out = parley("up", "--set", "policy.model=/no/a", "--set", "actor.engine.model=/no/b", "--dry-run")
    assert out.returncode == 2
    assert [line.split(":")[1].strip() for line in lines(out.stderr)] == ["policy.model", "actor.engine.model"]


def test_a_refused_start_creates_nothing(tmp_path):
    """Before: a missing model passed, then `parley up` made the run directory, started nats-server and
    died with a traceback. Now the start checks refuse it first."""
    run_dir = tmp_path / "run"
    out = parley("up", "--set", "policy.model=/no/such/model", "--run-dir", str(run_dir), "--no-live", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert lines(out.stderr) == [
        "parley up: policy.model: model '/no/such/model': no such checkpoint directory; give an existing one, "
        "one of tiny, smol or a Hub id such as Qwen/Qwen3-0.6B"
    ]
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []


def test_an_environment_variable_is_named_as_the_source():
    out = parley("actor", "--dry-run", env={"PARLEY_RUN": "bad.name"})
    assert out.returncode == 2
    assert lines(out.stderr)[0].startswith("parley: bad configuration: PARLEY_RUN: run.name = 'bad.name'"), out.stderr


def test_eval_replay_and_selfcheck_take_dry_run(tmp_path):
    out = parley("selfcheck", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0 and "[run]" in out.stdout and "selfcheck:" in out.stdout, out.stderr
    out = parley("replay", "--stream", "eval", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0 and "replay: 0 logged records" in out.stdout, out.stderr
    out = parley("eval", "-C", "base=tiny", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0 and "eval: conditions base on" in out.stdout, out.stderr
    out = parley("eval", "-C", "base=/no/such/ckpt", "--dry-run", cwd=tmp_path)
    assert out.returncode == 2 and lines(out.stderr) == [
        "parley eval: --condition base: model '/no/such/ckpt': no such checkpoint directory; give an existing "
        "one, one of tiny, smol or a Hub id such as Qwen/Qwen3-0.6B"
    ], out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written: no runs/, no overlap file
