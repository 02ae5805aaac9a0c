"""[env] in the run config: the environment's defaults fill in what the sections leave empty, the
sections that name its parts are checked against it at load, and the resolved config dumps and
loads back the same (what `parley up` hands its children)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from parley.config.run import ConfigError, convert_config, dump_config, load_config

TINY = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "tiny.toml"


def test_the_embedded_default_is_collabllm_scored_as_its_scorer_section_says():
    cfg = load_config()
    assert cfg.env.name == "collabllm_medium"
    # default.toml's [scorer]: the embedded judge cannot copy documents out (docs/rewards.md)
    assert cfg.env.options == {
        "bleu_variant": "char",
        "extract": "last_document",
        "interactivity": "rubric_expected",
        "token_amount": "assistant_tokens_k",
        "extract_quotes": "keep",
    }
    assert cfg.scorer.weights == {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1}
    assert (cfg.rollout.sim_prompt, cfg.learner.eval_metric) == ("lazy_full", "mr")
    env = cfg.env.load()
    assert [m.name for m in env.reward.metrics] == ["bleu", "interactivity", "token_amount"]
    assert env.reward.judge_ops == ("interactivity_expected",)  # last_document: no extract call


def test_the_embedded_default_trains_hidden_goal_by_name():
    # [scorer]'s CollabLLM keys are not hidden_goal's; its weights are left out, so they are the environment's
    cfg = load_config(None, ["env.name=hidden_goal"])
    assert cfg.scorer.weights == {"goal_match": 1.0, "assistant_turns": -0.05} and cfg.env.options == {}


def test_hidden_goal_takes_its_own_defaults():
    cfg = load_config(TINY, ["env.name=hidden_goal", "env.options={n_items = 40, seed = 2}"])
    assert cfg.scorer.weights == {"goal_match": 1.0, "assistant_turns": -0.05}
    assert cfg.rollout.sim_prompt == ""  # a programmatic user: no simulator prompt
    assert cfg.learner.eval_metric == "goal_match"
    assert cfg.env.options == {"n_items": 40, "seed": 2}  # CollabLLM's scoring keys are not its options
    assert convert_config(tomllib.loads(dump_config(cfg))) == cfg


def test_explicit_values_are_kept_when_the_environment_allows_them():
    cfg = load_config(
        None,
        [
            "env.name=hidden_goal",
            "scorer.weights={goal_match = 2.0}",
            "learner.eval_metric=exact",
            "scorer.clamps={assistant_turns = [0.0, 3.0]}",
        ],
    )
    assert cfg.scorer.weights == {"goal_match": 2.0} and cfg.learner.eval_metric == "exact"
    assert convert_config(tomllib.loads(dump_config(cfg))) == cfg


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["env.name=no_such_env"], r"unknown environment 'no_such_env'; known: collabllm_medium, hidden_goal"),
        (
            ["env.name=hidden_goal", "scorer.weights={bleu = 1.0, goal_match = 1.0}"],
            r"scorer.weights: unknown reward metric 'bleu' for environment 'hidden_goal'; its metrics are "
            r"\['goal_match', 'exact', 'assistant_turns'\]",
        ),
        (
            ["scorer.clamps={goal_match = [0.0, 1.0]}"],
            r"scorer.clamps: unknown reward metric 'goal_match' for "
            r"environment 'collabllm_medium'",
        ),
        (
            ["env.name=hidden_goal", "rollout.sim_prompt=lazy_full"],
            r"rollout.sim_prompt='lazy_full': environment 'hidden_goal' plays a programmatic user",
        ),
        (
            ["env.name=hidden_goal", "learner.eval_metric=mr"],
            r"learner.eval_metric='mr' is not a selectable metric of environment 'hidden_goal'; use one of "
            r"\['goal_match', 'exact'\]",
        ),
        (
            ["learner.eval_metric=tokens_k"],
            r"learner.eval_metric='tokens_k' is not a selectable metric of environment "
            r"'collabllm_medium'; use one of \['bleu', 'interactivity', 'mr'\]",
        ),
        (
            ['env.options={bleu_variant = "sacrebleu"}'],
            r"env.options.bleu_variant='sacrebleu' differs from "
            r"scorer.bleu_variant='char'.*remove env.options.bleu_variant",
        ),
        (["env.name=hidden_goal", "env.options={n_items = 500}"], r"n_items=500 must be in 1..203"),
        (
            ["env.name=hidden_goal", "env.options={rounds = 2}"],
            r"environment 'hidden_goal' .* rejected options \{'rounds': 2\}",
        ),
    ],
)
def test_bad_environment_settings_fail_at_load_naming_the_value(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_up_takes_the_environment_by_name():
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    out = CliRunner().invoke(app, ["up", "--config", str(TINY), "--env", "hidden_goal", "--dry-run"])
    assert out.exit_code == 0, out.output
    dumped = tomllib.loads(out.output)
    assert dumped["env"] == {"name": "hidden_goal", "options": {}}
    assert dumped["scorer"]["weights"] == {"goal_match": 1.0, "assistant_turns": -0.05}


def test_up_starts_the_simulator_and_judge_only_when_the_environment_needs_them(tmp_path):
    from parley.deploy.up import plan_children
    from parley.runtime.supervisor import Supervisor

    sup = Supervisor(tmp_path)
    names = lambda cfg: [n for n, _ in plan_children(cfg, sup, tmp_path / "config.toml")]  # noqa: E731
    assert names(load_config(TINY)) == ["services", "actor-0", "scorer-0", "learner"]  # sim + judge in one process
    assert names(load_config(TINY, ["sim.engine.model=smol"])) == ["sim", "judge", "actor-0", "scorer-0", "learner"]
    assert names(load_config(TINY, ["env.name=hidden_goal"])) == ["actor-0", "scorer-0", "learner"]


def test_up_with_env_alone_lays_the_environments_preset_over_the_default_and_set_wins():
    """`parley up --env hidden_goal` with no --config trains under hidden_goal's preset (the settings
    under which the benchmark measured learning); a --set beats the preset; --config leaves it out."""
    from typer.testing import CliRunner

    from parley.deploy.cli import app
    from parley.environments.hidden_goal import PRESET

    out = CliRunner().invoke(app, ["up", "--env", "hidden_goal", "--dry-run", "--set", "learner.lr=5e-5"])
    assert out.exit_code == 0, out.output
    assert "environment hidden_goal's preset" in out.stderr and "actor.sampling.temperature=0.7" in out.stderr
    dumped = tomllib.loads(out.stdout)
    assert dumped["env"]["options"] == {"n_items": 120, "seed": 0, "nudge": "slots", "answer": "mentions"}
    assert dumped["actor"]["sampling"]["temperature"] == 0.7 and dumped["rollout"]["n"] == 8
    assert (dumped["learner"]["steps"], dumped["learner"]["eval_every"], dumped["learner"]["eval_items"]) == (15, 5, 24)
    assert dumped["learner"]["lr"] == 5e-5  # the user's --set, over the preset's 1e-4
    assert "learner.lr=1e-4" in PRESET

    plain = CliRunner().invoke(app, ["up", "--config", str(TINY), "--env", "hidden_goal", "--dry-run"])
    assert "preset" not in plain.stderr and tomllib.loads(plain.stdout)["actor"]["sampling"]["temperature"] == 1.0

    unknown = CliRunner().invoke(app, ["up", "--env", "no_such_env", "--dry-run"])
    assert unknown.exit_code == 2 and "--env no_such_env: unknown environment 'no_such_env'" in unknown.stderr


def test_an_environment_that_needs_options_has_no_preset_and_is_left_to_the_config(monkeypatch):
    """A plug-in whose factory needs options cannot be built before --set gives them: `parley up --env`
    takes no preset for it instead of refusing the run (the config's load builds it with the options)."""
    from parley.deploy.up_cli import env_preset
    from parley.environments import registry

    def needs_options(name, options=None):
        raise ValueError(f"environment {name!r} (pkg:factory) rejected options {{}}: missing 'size'")

    monkeypatch.setattr(registry, "load", needs_options)
    assert env_preset("sized") == ()
