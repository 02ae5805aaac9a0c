"""recipe = "verl-collabllm": the preset equals the table of docs/recipe.md, row by row, and the
configs that name it resolve to it; how a recipe is laid (over the embedded default, under a file,
under --set) and refused."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec
import pytest

from parley.config.run import ConfigError, load_config, recipe_data

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "recipe.md"
RECIPE = "verl-collabllm"
_ROW = re.compile(r"^\| `([a-z_.]+)` \| `(.+)` \| (.+) \|$")


def doc_rows() -> dict[str, object]:
    """setting -> value of every row of the preset's table that gives a value (TOML in backticks)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"docs/recipe.md lists {m.group(1)} twice"
            rows[m.group(1)] = tomllib.loads(f"v = {m.group(2)}")["v"]
    return rows


def leaves(data: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        # a section is a table of tables or of scalars under a Struct; weights/clamps are values
        if isinstance(v, dict) and key not in ("scorer.weights", "scorer.clamps"):
            out.update(leaves(v, key + "."))
        else:
            out[key] = v
    return out


def resolved(cfg, key: str):
    value = msgspec.to_builtins(cfg)
    for part in key.split("."):
        value = value[part]
    return value


def test_the_table_lists_exactly_the_settings_the_recipe_file_sets():
    rows, preset = doc_rows(), leaves(recipe_data(RECIPE))
    assert len(rows) >= 30
    assert sorted(rows) == sorted(preset)
    assert {k: preset[k] for k in rows} == rows


@pytest.mark.parametrize(
    "how",
    [
        dict(path=None, overrides=[f'run.recipe="{RECIPE}"']),  # parley up --recipe over the embedded default
        dict(path=ROOT / "deploy" / "configs" / "reference-8gpu.toml", overrides=[]),  # the file names it
    ],
    ids=["embedded-default", "reference-8gpu"],
)
def test_the_resolved_config_is_the_table(how):
    cfg = load_config(how["path"], how["overrides"])
    assert cfg.run.recipe == RECIPE
    assert {k: resolved(cfg, k) for k in doc_rows()} == doc_rows()
    # what the scorer settings become: the environment's options (config.env.EnvConfig.scored_as)
    assert cfg.env.options == {
        "bleu_variant": "char",
        "extract": "judge",
        "interactivity": "rubric",
        "token_amount": "future_words",
        "extract_quotes": "single",
    }


def test_the_k8s_configmap_names_the_recipe_and_overrides_none_of_it():
    import yaml

    (cm,) = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text()))
    data = tomllib.loads(cm["data"]["run.toml"])
    assert data["run"]["recipe"] == RECIPE
    assert not set(leaves(data)) & set(doc_rows()), "the ConfigMap sets a recipe key of its own"


def test_a_file_and_set_win_over_the_recipe_and_async_is_one_setting(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(f'[run]\nrecipe = "{RECIPE}"\n[learner]\nclip_high = 0.28\n')
    cfg = load_config(f, ["learner.max_staleness=1"])
    assert (cfg.learner.clip_high, cfg.learner.max_staleness) == (0.28, 1)  # the file's, then --set's
    assert (cfg.learner.updates_per_step, cfg.rollout.mode) == (2, "next_turn")  # the rest is the recipe's
    cfg = load_config(None, [f'run.recipe="{RECIPE}"', "rollout.n=4"])
    assert cfg.rollout.n == 4 and cfg.learner.groups_per_step == 16


def test_an_unknown_recipe_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"run.recipe = 'verl'.*no such recipe.*'verl-collabllm'"):
        load_config(None, ['run.recipe="verl"'])


def test_updates_per_step_must_divide_groups_per_step():
    with pytest.raises(ConfigError, match="updates_per_step=3 must divide groups_per_step=16"):
        load_config(None, [f'run.recipe="{RECIPE}"', "learner.updates_per_step=3"])


def test_a_dumped_recipe_config_loads_back_the_same(tmp_path):
    from parley.config.run import dump_config

    cfg = load_config(None, [f'run.recipe="{RECIPE}"'])
    f = tmp_path / "dumped.toml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg
