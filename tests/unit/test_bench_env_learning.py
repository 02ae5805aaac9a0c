"""bench/env_learning.py's settings are a run `parley up` accepts: its `--set` overrides of the
embedded default load, resolve hidden_goal with the options asked for, and pass the checks of a run
that trains (a temperature of 0.7 included); what the benchmark may not do is refused by its parser."""

from __future__ import annotations

import pytest

from bench import env_learning
from parley.config.run import ConfigError, check_training, default_config_path, load_config


def test_the_benchmarks_overrides_are_a_run_that_trains_at_its_temperature():
    args = env_learning.parse_args(
        [
            "--seeds",
            "1",
            "--steps",
            "15",
            "--train-temperature",
            "0.7",
            "--nudge",
            "slots",
            "--answer",
            "mentions",
            "--kl-coef",
            "0",
            "--lr",
            "1e-4",
        ]
    )
    assert args.temperature == 0.7  # the eval samples the distribution that was trained, unless told otherwise
    cfg = load_config(default_config_path(), env_learning.overrides(args, seed=1))
    check_training(cfg)
    assert cfg.env.name == "hidden_goal"
    assert cfg.env.options == {"n_items": 120, "seed": 1, "nudge": "slots", "answer": "mentions"}
    assert (cfg.actor.sampling.temperature, cfg.learner.lr, cfg.learner.kl_coef, cfg.data.split_seed) == (
        0.7,
        1e-4,
        0.0,
        1,
    )
    assert cfg.learner.eval_metric == "goal_match" and cfg.learner.checkpoint_every == 15
    assert env_learning.parse_args(["--temperature", "1.0", "--train-temperature", "0.7"]).temperature == 1.0


def test_a_greedy_training_temperature_is_refused_before_any_work():
    args = env_learning.parse_args(["--train-temperature", "0"])
    with pytest.raises(ConfigError, match="actor.sampling.temperature=0.0: training needs a temperature >= 1e-05"):
        check_training(load_config(default_config_path(), env_learning.overrides(args, seed=0)))


@pytest.mark.parametrize("argv", [["--steps", "31"], ["--steps", "0"], ["--seeds", ","]])
def test_the_parser_refuses_what_the_benchmark_does_not_run(argv):
    with pytest.raises(SystemExit):
        env_learning.parse_args(argv)


def test_the_benchmarks_defaults_train_what_parley_up_env_hidden_goal_trains():
    """The figures in docs/benchmarks.md are of bench/env_learning.py's defaults, read from hidden_goal's
    preset (preset_defaults); the overrides they give `parley up` must train the run the preset does,
    or the doc would describe another one."""
    from parley.environments.hidden_goal import PRESET

    bench = load_config(default_config_path(), env_learning.overrides(env_learning.parse_args([]), seed=0))
    up = load_config(default_config_path(), ['env.name="hidden_goal"', *PRESET])
    for section, keys in {
        "env": ("name", "options"),
        "data": ("eval_fraction", "split_seed"),
        "rollout": ("n", "max_tokens", "max_new_turns"),
        "actor": ("sampling",),
        "policy": ("model",),
        "learner": ("steps", "groups_per_step", "lr", "kl_coef", "seed"),
    }.items():
        for key in keys:
            if (section, key) == ("learner", "steps"):
                continue  # the bench passes --steps to `parley up`, not as an override
            assert getattr(getattr(bench, section), key) == getattr(getattr(up, section), key), f"{section}.{key}"
    assert env_learning.parse_args([]).steps == up.learner.steps
