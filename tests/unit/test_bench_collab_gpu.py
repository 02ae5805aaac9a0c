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


# -- the pair modes: both configurations at one seed on the one GPU ------------------------------------


def up_lines(out: str) -> dict[str, str]:
    """side tag -> the `parley up` command its dry run would start."""
    found = {}
    for line in out.splitlines():
        if "would run up " in line:
            found[line.split("]", 1)[0].split()[-1]] = line
    return found


@pytest.mark.extended  # four parley dry runs in two subprocesses: seconds on 2 cores
def test_dry_run_of_a_train_pair_plans_each_side_on_half_the_gpu(tmp_path):
    r = script(tmp_path, "--dry-run", "train-pair", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    ups = up_lines(out)
    assert set(ups) == {"gpu-1-collab-recipe", "gpu-1-collab"}
    recipe, current = ups["gpu-1-collab-recipe"], ups["gpu-1-collab"]
    assert (
        f"--config {RECIPE_CONFIG.relative_to(ROOT)}" in recipe
        and f"--config {CURRENT_CONFIG.relative_to(ROOT)}" in current
    )
    # each its own run directory (its nats-server's store and port are the run's own: `parley up` picks them)
    assert (
        f"--run-dir {tmp_path}/run-gpu-1-collab-recipe-s4 " in recipe
        and f"--run-dir {tmp_path}/run-gpu-1-collab-s4 " in current
    )
    assert load_config(RECIPE_CONFIG).run.name != load_config(CURRENT_CONFIG).run.name
    # without a GPU here each half is an H100's: 79.19 / 2; plain time-slicing; seed and steps on both
    assert "H100 80 GB's 79.19 GiB" in r.stderr
    for line in (recipe, current):
        assert "--set up.gpu_memory_gib=39.59" in line and r"up.gpu_share=\"plain\"" in line
        assert "--set learner.eval_every=0" in line and "learner.seed=4" in line and "--steps 60" in line
        assert "timeout -s INT 480" in line
    # parley's own plan of each half, stated and fitting
    plans = [line for line in out.splitlines() if "# GPU memory plan" in line]
    assert len(plans) == 2 and all("GPU total 39.6 GiB (up.gpu_memory_gib)" in p for p in plans)
    assert sum("to spare" in line for line in out.splitlines() if "all processes" in line) == 2
    assert out.count("# protocol card:") == 2  # both evals it will get, checked before training
    assert "would bring back 2 files" in out
    assert not list(tmp_path.glob("run-*"))  # a dry run trains nothing


@pytest.mark.extended
def test_dry_run_of_an_eval_pair_keeps_todays_file_names_within_eight(tmp_path):
    r = script(tmp_path, "--dry-run", "eval-pair", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    evals = [line for line in out.splitlines() if "would run eval " in line]
    assert len(evals) == 2
    for tag in ("gpu-1-collab-recipe", "gpu-1-collab"):
        line = next(e for e in evals if e.startswith(f"[{'A' if 'recipe' in tag else 'B'} {tag}]"))
        # one scoring for both (the recipe config's), each side's own trained model and output
        assert f"--config {RECIPE_CONFIG.relative_to(ROOT)}" in line
        assert f"final=/tmp/collab-models-{tag}-s2/final" in line and f"--out /tmp/collab-eval-{tag}-s2" in line
        assert f"would combine {tmp_path}/summaries/{tag}/{tag}_seed*.json" in out
    brought = next(line for line in out.splitlines() if "would bring back" in line)
    names = brought.split(": ", 1)[1].split()
    assert len(names) <= 8
    for tag in ("gpu-1-collab-recipe", "gpu-1-collab"):  # the names `combine` and the single modes use
        assert {f"{tag}_seed2.json", f"{tag}_table_s2.md", f"{tag}_combined.json"} <= set(names)
    assert "gpu_memory_gib" not in out  # the evals keep their engines' sizes


@pytest.mark.extended
def test_a_side_that_does_not_fit_its_half_fails_alone(tmp_path):
    big = tmp_path / "big.toml"  # gpu-1-collab.toml with a KV cache no half of an 80 GB card holds
    big.write_text(CURRENT_CONFIG.read_text().replace("kv_cache_bytes = 6442450944", "kv_cache_bytes = 42949672960"))
    r = script(tmp_path, "--dry-run", "train-pair", "1", CONFIG_B=str(big))
    assert r.returncode == 1
    assert "side A exit code 0, side B 2" in r.stderr
    assert "[B big] [collab_gpu] parley up --dry-run refused the run" in r.stdout
    assert "would run up " in up_lines(r.stdout)["gpu-1-collab-recipe"]  # side A went on to its end


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["train-pair"], {}, "train-pair needs a seed"),
        (["eval-pair", "one"], {}, "eval-pair needs a seed, a whole number (got 'one')"),
        (
            ["train-pair", "1"],
            {"CONFIG_B": str(RECIPE_CONFIG)},
            "CONFIG_A and CONFIG_B are both named gpu-1-collab-recipe",
        ),
        (["train-pair", "1"], {"GPU_GIB": "80GB"}, "GPU_GIB=80GB: a number of GiB"),
    ],
)
def test_bad_pair_arguments_are_refused_with_one_line(tmp_path, args, env, says):
    r = script(tmp_path, "--dry-run", *args, **env)
    assert r.returncode == 2 and says in r.stderr, r.stderr


def metrics(run, steps: int):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(1, steps + 1))
    )


@pytest.mark.parametrize(
    ("steps", "rc", "stopped"),
    [
        (60, 0, "steps"),
        (60, 124, "steps"),
        (47, 124, "budget"),
        (47, 130, "budget"),
        (12, 1, "failed"),
        (0, 2, "failed"),
    ],
)
def test_a_training_record_says_whether_the_budget_stopped_it_short(tmp_path, steps, rc, stopped):
    metrics(tmp_path / "run", steps)
    t = collab_table.training_record(tmp_path / "run", rc=rc, wall_s=481, budget_s=480, steps=60, shared=True)
    assert t["steps_done"] == steps and t["stopped"] == stopped and t["shared_gpu"] is True
    line = collab_table.training_line(t)
    assert line.startswith(f"training: {steps} of 60 steps in 481 s")
    if stopped == "budget":
        assert f"(BUDGET_S 480 s) stopped it {60 - steps} steps short of STEPS on a shared GPU" in line


def test_a_budget_stopped_seed_is_named_in_its_summary_and_the_combination(tmp_path):
    metrics(tmp_path / "run", 47)
    record = tmp_path / "collab_train.json"
    collab_table.main(
        ["trained", "--run", str(tmp_path / "run"), "--rc", "124", "--wall-s", "483", "--budget-s", "480"]
        + ["--steps", "60", "--shared", "--sets", "--set up.gpu_memory_gib=39.59", "--json", str(record)]
    )
    t = json.loads(record.read_text())
    assert t["stopped"] == "budget" and t["up_sets"] == ["--set", "up.gpu_memory_gib=39.59"]
    short, full = summary(1, 0.1, 0.04), summary(2, 0.1, 0.04)
    short["run"]["training"] = t
    full["run"]["training"] = {**t, "steps_done": 60, "stopped": "steps"}
    out = collab_table.combine([short, full, summary(3, 0.1, 0.04)])  # seed 3: no record (an older run)
    assert out["short_seeds"] == [1]
    assert out["by_seed"]["1"]["training"]["steps_done"] == 47


def test_a_pair_report_gives_each_sides_exit_code_and_training(tmp_path):
    metrics(tmp_path / "a", 60)
    (tmp_path / "a" / "collab_train.json").write_text(
        json.dumps(collab_table.training_record(tmp_path / "a", rc=0, wall_s=450, budget_s=480, steps=60, shared=True))
    )
    out = tmp_path / "pair.json"
    collab_table.main(
        ["pair", "--mode", "train-pair", "--seed", "1", "--side", f"A,rcp,r.toml,0,{tmp_path / 'a'}"]
        + ["--side", f"B,cur,c.toml,1,{tmp_path / 'b'}", "--share-gib", "39.59", "--json", str(out)]
    )
    p = json.loads(out.read_text())
    assert p["sides"]["A"]["rc"] == 0 and p["sides"]["A"]["training"]["stopped"] == "steps"
    assert p["sides"]["B"]["rc"] == 1 and p["sides"]["B"]["training"] is None  # it trained nothing
    assert p["share_gib"] == 39.59


# A test double of `parley up` (and of the model build) behind the script's PYTHON: every other call goes
# to the real interpreter. Its run trains STUB_STEPS steps: with STUB_WAIT it waits for the wall
# budget's SIGINT first and exits as up does on it (130); a config named in STUB_FAIL fails at once.
STUB_PYTHON = """#!{python}
import os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
if args[:3] == ["-m", "parley.deploy.cli", "up"] and "--dry-run" not in args:
    run, config = Path(args[args.index("--run-dir") + 1]), args[args.index("--config") + 1]
    if Path(config).stem == os.environ.get("STUB_FAIL"):
        sys.exit(1)
    stopped = []
    signal.signal(signal.SIGINT, lambda *_: stopped.append(1))
    deadline = time.time() + 30
    while os.environ.get("STUB_WAIT") and not stopped and time.time() < deadline:
        time.sleep(0.05)
    (run / "learner").mkdir(parents=True)
    steps = int(os.environ.get("STUB_STEPS", "60"))
    (run / "metrics.jsonl").write_text("".join('{{"step": %d}}\\n' % s for s in range(1, steps + 1)))
    sys.exit(130 if stopped else 0)
if args[:1] == ["-c"] and "ensure_model" in args[1]:
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *args])
"""


@pytest.mark.extended  # four parley dry runs (the preflights) and the double's two runs: seconds
def test_a_train_pair_reports_each_side_and_brings_back_its_files_within_eight(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON.format(python=sys.executable))
    stub.chmod(0o755)
    env = {"PYTHON": str(stub), "GPU_GIB": "79.19", "BUDGET_S": "2", "LIMIT_S": "40"}
    r = script(tmp_path, "train-pair", "5", STUB_WAIT="1", STUB_STEPS="47", STUB_FAIL="gpu-1-collab", **env)
    assert r.returncode == 1, r.stdout + r.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["logs_train-pair5.tar.gz", "pair_train-pair5.json"]
    pair = json.loads((out / "pair_train-pair5.json").read_text())
    a, b = pair["sides"]["A"], pair["sides"]["B"]
    # side A ran to its budget beside the failing side B: stopped by the budget, 13 steps short, said so
    assert a["rc"] == 0 and a["training"]["stopped"] == "budget" and a["training"]["steps_done"] == 47
    assert a["training"]["up_rc"] == 124 and a["training"]["shared_gpu"] is True
    assert "up.gpu_memory_gib=39.59" in a["training"]["up_sets"]
    assert b["rc"] == 1 and b["training"]["stopped"] == "failed"
    assert "side A gpu-1-collab-recipe: exit code 0; training: 47 of 60 steps" in r.stdout
    assert "stopped it 13 steps short of STEPS on a shared GPU" in r.stdout
    assert json.loads((tmp_path / "run-gpu-1-collab-recipe-s5" / "collab_train.json").read_text())["steps_done"] == 47
    import tarfile

    with tarfile.open(out / "logs_train-pair5.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("collab-logs-gpu-1-collab-recipe-train5/collab_train.json") for n in names)
    assert any(n.endswith("collab-logs-gpu-1-collab-train5/times.txt") for n in names)
