"""bench/collab_gpu.sh (issue 60, item 7) checked on the CPU without running anything heavy: its
--dry-run prints the commands and runs `parley up --dry-run` and `parley eval --protocol card --dry-run`
on them (so the eval it would run parses and its held-out split holds the items asked for); its size
checks refuse with one line; the recipe config it trains is the recipe but for the sizes it names; and
bench/collab_table.py's per-seed summary and seed pairing on hand-made records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from bench import collab_table
from parley.config.run import load_config, recipe_data
from tests.factories import eval_record

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "collab_gpu.sh"
RECIPE_CONFIG = ROOT / "deploy" / "configs" / "gpu-1-collab-recipe.toml"
CURRENT_CONFIG = ROOT / "deploy" / "configs" / "gpu-1-collab.toml"


def script(tmp_path, *args, **env):
    full = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "OUT": str(tmp_path / "out"),
        "RUN_DIR": str(tmp_path / "run"),
        "SUMMARIES": str(tmp_path / "summaries"),
        **env,
    }
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.extended  # two parley dry runs in a subprocess: 5-12 s on 2 cores, past make test's room
def test_dry_run_of_a_seed_checks_the_card_eval_it_would_run(tmp_path):
    r = script(tmp_path, "--dry-run", "seed", "3", SMOKE="1", N_ITEMS="24")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # parley's own dry run of the eval, with the protocol's arms (proact added on the base model)
    assert "# protocol card: the simulator (lazy_full) opens, 14 messages, 4096 tokens" in out
    assert "24 items (one per reference document)" in out and "arms base, final, proact; baseline base" in out
    assert "learner.seed=3" in out and "--steps 60" in out
    eval_line = next(line for line in out.splitlines() if "would run eval" in line)
    assert "--protocol card" in eval_line and "-C base=smol" in eval_line and "--n-items 24" in eval_line
    assert not (tmp_path / "run-s3").exists()  # a dry run trains nothing


def test_a_held_out_split_smaller_than_the_default_size_is_refused(tmp_path):
    # N_ITEMS = 60 against the bundled 150 items at 0.1 held out: 15
    r = script(tmp_path, "--dry-run", "train", "1", EVAL_FRACTION="0.1")
    assert r.returncode == 2
    assert "holds 15 eval items" in r.stderr and "N_ITEMS, DATA, EVAL_FRACTION" in r.stderr


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["seed"], {}, "seed needs a seed"),
        (["seed", "1"], {"N_ITEMS": "30"}, "N_ITEMS=30: the decision needs at least 60"),
        (["phase2"], {}, "usage: bash bench/collab_gpu.sh"),
    ],
)
def test_bad_arguments_are_refused_with_one_line(tmp_path, args, env, says):
    r = script(tmp_path, "--dry-run", *args, **env)
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_the_recipe_config_is_the_recipe_but_for_the_sizes_it_names():
    cfg = msgspec.to_builtins(load_config(RECIPE_CONFIG))
    assert cfg["run"]["recipe"] == "verl-collabllm"
    sizes = {"learner.groups_per_step": 2, "rollout.max_tokens": 256}
    for section, values in recipe_data("verl-collabllm").items():
        for key, want in values.items():
            name = f"{section}.{key}"
            got = cfg[section][key]
            if isinstance(want, dict) and name not in ("scorer.weights", "scorer.clamps"):
                got, want = {k: got[k] for k in want}, want
            if isinstance(got, list | tuple) or isinstance(want, list | tuple):
                got, want = json.loads(json.dumps(got)), json.loads(json.dumps(want))
            if name in sizes:
                assert got == sizes[name], name
            else:
                assert got == want, (name, got, want)


def test_both_configurations_split_the_data_alike():
    # the eval of either training configuration runs under one EVAL_CONFIG: its held-out items must be
    # the ones each run held out
    assert load_config(RECIPE_CONFIG).data == load_config(CURRENT_CONFIG).data


def records(shift: dict[str, float], items: int = 6, wobble: float = 0.0):
    out = []
    for i in range(items):
        for arm, d in shift.items():
            bleu = 0.2 + 0.01 * i + d + wobble * ((i % 3) - 1)
            out.append(eval_record(arm, f"item{i}", bleu, 0.4, 400))
    return out


def summary(seed: int, final: float, proact: float, config: str = "c.toml"):
    recs = records({"base": 0.0, "final": final, "proact": proact}, wobble=0.01 * seed)
    run = {"config": config, "eval_config": "e.toml", "final_version": 60}
    return collab_table.seed_summary(recs, seed=seed, protocol={"name": "card", "n_items": 6}, run=run)


def test_a_seed_summary_compares_training_with_base_and_with_proact():
    s = summary(1, final=0.10, proact=0.04)
    assert [r["condition"] for r in s["table"]] == ["base", "final", "proact"]
    assert s["compare"]["final_vs_base"]["bleu"]["diff"] == pytest.approx(0.10)
    assert s["compare"]["final_vs_proact"]["mr"]["diff"] == pytest.approx(0.06)
    assert s["compare"]["final_vs_proact"]["mr"]["n"] == 6
    assert set(s["items"]["final"]) == {f"item{i}" for i in range(6)}
    json.dumps(s)  # what the script writes


def test_a_seed_without_an_arm_is_refused():
    with pytest.raises(ValueError, match=r"no record of arm\(s\) \['proact'\]"):
        collab_table.seed_summary(records({"base": 0.0, "final": 0.1}), seed=1, protocol={}, run={})


def test_seeds_are_paired_by_seed():
    out = collab_table.combine([summary(2, 0.08, 0.03), summary(1, 0.10, 0.04), summary(3, 0.12, 0.05)])
    assert out["seeds"] == [1, 2, 3]
    fvp = out["across_seeds"]["final_vs_proact"]["mr"]
    assert fvp["n"] == 3 and fvp["diff"] == pytest.approx(0.06)
    assert out["pooled_items"]["final_vs_base"]["bleu"]["n"] == 18
    assert out["by_seed"]["2"]["means"]["final"]["bleu"] == pytest.approx(
        out["by_seed"]["2"]["means"]["base"]["bleu"] + 0.08
    )
    assert out["training_beats_proact"] is True
    one = collab_table.combine([summary(1, 0.10, 0.04)], expect=[1, 2, 3])
    assert one["training_beats_proact"] is False and one["missing_seeds"] == [2, 3]  # one seed decides nothing


def test_combine_refuses_mixed_configurations_and_repeated_seeds():
    with pytest.raises(ValueError, match="combine one configuration's seeds at a time"):
        collab_table.combine([summary(1, 0.1, 0.0), summary(2, 0.1, 0.0, config="other.toml")])
    with pytest.raises(ValueError, match=r"seeds \[1, 1\] repeat"):
        collab_table.combine([summary(1, 0.1, 0.0), summary(1, 0.1, 0.0)])


def test_the_scripts_summary_commands_read_what_parley_eval_writes(tmp_path):
    """`collab_table.py seed` on an eval directory as `parley eval --protocol card` leaves it (records.parquet,
    protocol.json), then `combine` over two seeds: what bench/collab_gpu.sh runs after each eval."""
    from parley.evaluation import protocols
    from parley.evaluation.evallog import write_parquet
    from parley.evaluation.runner import Condition

    paths = []
    for seed in (1, 2):
        ev = tmp_path / f"eval{seed}"
        ev.mkdir()
        write_parquet(records({"base": 0.0, "final": 0.05 * seed, "proact": 0.02}, wobble=0.01), ev / "records.parquet")
        arms = [Condition(name=a, model="smol") for a in ("base", "final", "proact")]
        protocols.write_record(protocols.CARD, arms, "base", 6, ev)
        out = tmp_path / f"seed{seed}.json"
        collab_table.main(
            ["seed", "--run", "r", "--eval", str(ev), "--seed", str(seed), "--config", str(RECIPE_CONFIG)]
            + ["--version", "60", "--steps", "60", "--json", str(out)]
        )
        paths.append(str(out))
    s = json.loads(Path(paths[0]).read_text())
    assert s["run"]["recipe"] == "verl-collabllm" and s["run"]["eval_scoring"]["bleu_variant"] == "char"
    assert s["protocol"]["name"] == "card" and s["protocol"]["max_new_turns"] == 14 and s["protocol"]["n_items"] == 6
    combined = tmp_path / "combined.json"
    collab_table.main(["combine", "--json", str(combined), *paths])
    c = json.loads(combined.read_text())
    assert c["seeds"] == [1, 2] and c["across_seeds"]["final_vs_base"]["bleu"]["diff"] == pytest.approx(0.075)
