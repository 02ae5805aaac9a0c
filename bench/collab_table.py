"""The card's table for a CollabLLM-medium run, from the outputs of `parley eval`, `parley select` and
`parley replay`; and the judge's discrimination on the run, from the learner's archive of trained groups.
The statistics are evaluation.benchmark's; this only arranges them.

    python bench/collab_table.py plan RUN_DIR                 # versions to evaluate: 0, 25/50/75/100 %, selected
    python bench/collab_table.py pick RECORDS COND OUT        # one condition's records, for `parley replay`
    python bench/collab_table.py build --run RUN_DIR --eval EVAL_DIR [--replay DIR] --json OUT.json
    python bench/collab_table.py seed --run RUN_DIR --eval EVAL_DIR --seed S --config C --json OUT.json
    python bench/collab_table.py combine --json OUT.json SEED.json...   # the seeds paired by seed
    python bench/collab_table.py trained --run RUN_DIR --rc RC --wall-s S --budget-s B --steps N --json OUT.json
    python bench/collab_table.py pair --mode train --seed S --side A,TAG,CONFIG,RC,RUN_DIR ... --json OUT.json

`seed`, `combine`, `trained` and `pair` are bench/collab_gpu.sh's (issue 60): one training seed's
`parley eval --protocol card` (arms base, final, proact), the seeds together, how far a training got
(the steps it trained, and whether the wall budget stopped it before its steps) and the two
configurations that shared one GPU in one call.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from itertools import combinations
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parley.evaluation.benchmark import (  # noqa: E402
    METRICS,
    Table,
    flags,
    item_values,
    paired_stats,
    summarize,
)

FRACTIONS = (0.25, 0.5, 0.75, 1.0)
# lower is better for tokens (k); higher for the others
TIE_EPS = 1e-9
# The rubric's grid: three criteria of 0..3 levels, summed and divided by 9. Under rubric_expected a
# conversation's value is an expectation, so exact ties are rare; the rounded ties say how often the
# judge's most likely total level is the same.
LEVELS = 9


def fraction_versions(available: list[int], last: int, fractions=FRACTIONS) -> dict[str, int]:
    """'25%' -> the newest available version at or below round(f x last); the version the run ended on is 100 %."""
    out = {}
    for f in fractions:
        target = round(f * last)
        below = [v for v in available if v <= target]
        if not below:
            raise ValueError(f"no kept version at or below {target} ({f:.0%} of {last}); kept: {sorted(available)}")
        out[f"{round(f * 100)}%"] = max(below)
    return out


def table_json(table: Table) -> list[dict]:
    rows = []
    for r in table.rows:
        rows.append(
            {
                "condition": r.condition,
                "n": r.n,
                "models": r.models,
                "means": r.means,
                "intervals": {m: list(v) for m, v in r.intervals.items()},
                "diff_vs_base": {
                    m: {
                        "diff": s.mean_diff,
                        "ci_low": s.ci_low,
                        "ci_high": s.ci_high,
                        "t": s.t,
                        "df": s.df,
                        "p": s.p,
                        "n": s.n,
                    }
                    for m, s in r.diffs.items()
                },
            }
        )
    return rows


def leakage(eval_dir: Path) -> dict:
    """`parley eval` refuses shared reference targets (exit 1) and writes overlap.json when it goes on with any."""
    path = eval_dir / "overlap.json"
    if not path.is_file():
        return {"passed": True, "overlap": None}
    overlap = json.loads(path.read_text())
    return {"passed": not overlap.get("references"), "overlap": {k: len(v) for k, v in overlap.items()}}


def discrimination(groups_by_step: dict[int, list[list[dict[str, float]]]]) -> dict:
    """groups_by_step: step -> its groups, each a list of per-sample metric dicts. Per step: the mean over
    groups of each term's within-group std (population, as the learner's diagnostics), the share of the
    group's sample pairs whose interactivity is the same value (also after rounding to the rubric's grid of
    ninths), and the share of groups all at one value."""
    steps, pair_ties, rounded_ties, pairs, flat, ngroups = [], 0, 0, 0, 0, 0
    for step in sorted(groups_by_step):
        groups = groups_by_step[step]
        terms = sorted({k for g in groups for s in g for k in s})
        std = {t: float(np.mean([np.std([s[t] for s in g]) for g in groups])) for t in terms}
        st_ties = st_rounded = st_pairs = st_flat = 0
        for g in groups:
            vals = [s["interactivity"] for s in g]
            for a, b in combinations(vals, 2):
                st_pairs += 1
                st_ties += abs(a - b) <= TIE_EPS
                st_rounded += round(a * LEVELS) == round(b * LEVELS)
            st_flat += max(vals) - min(vals) <= TIE_EPS
        steps.append(
            {
                "step": step,
                "groups": len(groups),
                "within_group_std": std,
                "interactivity_pair_ties": st_ties / st_pairs if st_pairs else math.nan,
                "interactivity_flat_groups": st_flat / len(groups),
            }
        )
        pair_ties, rounded_ties, pairs = pair_ties + st_ties, rounded_ties + st_rounded, pairs + st_pairs
        flat, ngroups = flat + st_flat, ngroups + len(groups)
    terms = sorted({t for s in steps for t in s["within_group_std"]})
    return {
        "interactivity_pair_ties": pair_ties / pairs if pairs else math.nan,
        "pairs": pairs,
        "interactivity_pair_ties_rounded": rounded_ties / pairs if pairs else math.nan,
        "interactivity_flat_groups": flat / ngroups if ngroups else math.nan,
        "groups": ngroups,
        "within_group_std_mean": {t: float(np.mean([s["within_group_std"][t] for s in steps])) for t in terms},
        "steps_without_signal": {t: sum(s["within_group_std"][t] <= TIE_EPS for s in steps) for t in terms},
        "per_step": steps,
    }


def archive_groups(run_dir: Path) -> dict[int, list[list[dict[str, float]]]]:
    """The learner's archive (RUN_DIR/learner/archive/stepNNNNNN-trained.parquet): each step's trained groups."""
    from parley.evaluation.evallog import read_log
    from parley.learner.checkpoint import archive_dir

    out = {}
    for path in sorted(archive_dir(run_dir).glob("step*-trained.parquet")):
        step = int(re.match(r"step(\d+)-", path.name).group(1))
        groups = defaultdict(list)
        for s in read_log(path):
            groups[s.task_id].append(dict(s.metrics))
        out[step] = list(groups.values())
    return out


def replay_compare(original: list, replayed: list, condition: str) -> dict:
    """Per item, the run's judge against the second judge configuration on the same conversations."""
    a = item_values([r for r in original if r.condition == condition])
    b = item_values([r for r in replayed if r.condition == condition])
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError(f"no item of condition {condition!r} in both the eval and the replay")
    out = {"condition": condition, "n": len(shared)}
    for m in METRICS:
        x, y = [b[i][m] for i in shared], [a[i][m] for i in shared]
        s = paired_stats(x, y)
        corr = float(np.corrcoef(x, y)[0, 1]) if len(shared) > 1 and np.std(x) > 0 and np.std(y) > 0 else math.nan
        out[m] = {
            "original": float(np.mean(y)),
            "replayed": float(np.mean(x)),
            "diff": s.mean_diff,
            "ci_low": s.ci_low,
            "ci_high": s.ci_high,
            "p": s.p,
            "pearson_r": corr,
        }
    return out


def _plan(args) -> None:
    from parley.evaluation.selection import select_best
    from parley.learner.checkpoint import available_versions

    run = Path(args.run_dir)
    kept = available_versions(run)
    last = max(kept)
    fr = fraction_versions(kept, last)
    sel = select_best(run, "mr").version
    versions = sorted({0, *fr.values(), sel})
    (Path(args.json) if args.json else run / "collab_plan.json").write_text(
        json.dumps({"last": last, "fractions": fr, "selected_mr": sel, "versions": versions}, indent=1)
    )
    print(" ".join(str(v) for v in versions))


def _pick(args) -> None:
    from parley.evaluation.evallog import read_records, write_parquet

    recs = [r for r in read_records(args.records) if r.condition == args.condition]
    if not recs:
        raise SystemExit(f"collab_table pick: no record of condition {args.condition!r} in {args.records}")
    write_parquet(recs, args.out)


def _build(args) -> None:
    from parley.evaluation.evallog import read_records

    run, ev = Path(args.run), Path(args.eval)
    plan = json.loads((run / "collab_plan.json").read_text())
    records = read_records(ev / "records.parquet")
    table = summarize(records, "v0")
    out = {
        "plan": plan,
        "table": table_json(table),
        "flags": {**flags(table), "leakage": leakage(ev)},
        "discrimination": discrimination(archive_groups(run)),
    }
    if args.replay:
        out["replay"] = replay_compare(records, read_records(Path(args.replay) / "records.parquet"), f"v{plan['last']}")
    Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    print(json.dumps({k: out[k] for k in ("plan", "flags")}, indent=1, default=float))


# bench/collab_gpu.sh's arms (evaluation.protocols.CARD: base, the versions given, proact) and the
# comparisons that decide: does training gain over the base model, and over prompting it
ARMS = ("base", "final", "proact")
COMPARISONS = {
    "final_vs_base": ("final", "base"),
    "proact_vs_base": ("proact", "base"),
    "final_vs_proact": ("final", "proact"),
}


def _stats(s) -> dict:
    return {"diff": s.mean_diff, "ci_low": s.ci_low, "ci_high": s.ci_high, "p": s.p, "n": s.n}


def compare_items(items: dict[str, dict[str, dict[str, float]]], metrics=METRICS) -> dict:
    """arm -> item -> metric values: each comparison's paired difference over the items both arms have."""
    out = {}
    for name, (a, b) in COMPARISONS.items():
        shared = sorted(set(items.get(a, {})) & set(items.get(b, {})))
        if not shared:
            raise ValueError(f"{name}: no item scored in both arms {a!r} and {b!r}; arms present: {sorted(items)}")
        out[name] = {
            m: _stats(paired_stats([items[a][i][m] for i in shared], [items[b][i][m] for i in shared])) for m in metrics
        }
    return out


def seed_summary(records: list, *, seed: int, protocol: dict, run: dict) -> dict:
    """One training seed's card eval: the table, its flags, the per-item values of each arm (what
    `combine` pairs) and the comparisons that decide."""
    table = summarize(records, "base")
    by_arm = defaultdict(list)
    for r in records:
        by_arm[r.condition].append(r)
    missing = [a for a in ARMS if a not in by_arm]
    if missing:
        raise ValueError(f"seed {seed}: no record of arm(s) {missing}; the eval has {sorted(by_arm)}")
    items = {a: item_values(by_arm[a], METRICS) for a in ARMS}
    return {
        "seed": seed,
        "run": run,
        "protocol": {
            k: protocol.get(k)
            for k in (
                "name",
                "environment",
                "sim_prompt",
                "max_new_turns",
                "assistant_max_tokens",
                "enable_thinking",
                "seeds",
                "n_items",
            )
        },
        "table": table_json(table),
        "flags": flags(table),
        "compare": compare_items(items),
        "items": items,
    }


def steps_done(run_dir: str | Path) -> int:
    """The last step the learner wrote to RUN_DIR/metrics.jsonl (one line a step, numbered from 1); 0
    for a run that trained no step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def training_record(
    run_dir: str | Path, *, rc: int, wall_s: float, budget_s: float, steps: int, shared: bool = False, sets=()
) -> dict:
    """How a `parley up` of bench/collab_gpu.sh ended: the steps it trained of those asked, and why it
    stopped: "steps" (all of them), "budget" (the wall budget's SIGINT, or the step's limit, came first:
    timeout's 124, up's own 130 on SIGINT), "failed" (any other exit). A run stopped by its budget is
    shorter than asked; its summary says so rather than reading as a run of `steps` steps (two runs
    sharing one GPU step more slowly than one alone)."""
    done = steps_done(run_dir)
    if done >= steps > 0:
        stopped = "steps"
    elif rc in (124, 130):
        stopped = "budget"
    else:
        stopped = "failed"
    return {
        "steps_asked": steps,
        "steps_done": done,
        "stopped": stopped,
        "up_rc": rc,
        "wall_s": wall_s,
        "budget_s": budget_s,
        "shared_gpu": shared,
        "up_sets": list(sets),
    }


def training_line(t: dict) -> str:
    head = f"training: {t['steps_done']} of {t['steps_asked']} steps in {t['wall_s']:.0f} s"
    if t["stopped"] == "steps":
        return head + f"{' (on a GPU shared with another run)' if t['shared_gpu'] else ''}"
    if t["stopped"] == "budget":
        return (
            f"{head}: the wall budget (BUDGET_S {t['budget_s']:.0f} s) stopped it "
            f"{t['steps_asked'] - t['steps_done']} steps short of STEPS{' on a shared GPU' if t['shared_gpu'] else ''}"
            "; its summary says stopped = budget"
        )
    return f"{head}: parley up failed (exit code {t['up_rc']})"


def combine(summaries: list[dict], expect: list[int] | None = None) -> dict:
    """The seeds paired by seed: per comparison and metric, the per-seed differences of the arms' means
    and a paired t over the seeds (df = seeds - 1), plus the item pairs of every seed pooled (items are
    paired within a seed only). Refuses summaries of different configurations, protocols or item sets."""
    if not summaries:
        raise ValueError("combine: no seed summary given")
    first = summaries[0]
    seeds = [s["seed"] for s in summaries]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"combine: seeds {seeds} repeat; give each seed's summary once")
    for s in summaries[1:]:
        for key in ("config", "eval_config"):
            if s["run"].get(key) != first["run"].get(key):
                raise ValueError(
                    f"combine: seed {s['seed']} ran {key} {s['run'].get(key)!r}, seed {first['seed']} "
                    f"{first['run'].get(key)!r}; combine one configuration's seeds at a time"
                )
        if s["protocol"] != first["protocol"]:
            raise ValueError(
                f"combine: seed {s['seed']}'s protocol {s['protocol']} differs from seed {first['seed']}'s {first['protocol']}"
            )
        if set(s["items"]["base"]) != set(first["items"]["base"]):
            raise ValueError(f"combine: seed {s['seed']} was evaluated on other items than seed {first['seed']}")
    summaries = sorted(summaries, key=lambda s: s["seed"])
    out = {
        "seeds": [s["seed"] for s in summaries],
        "run": first["run"],
        "protocol": first["protocol"],
        "by_seed": {},
        "across_seeds": {},
        "pooled_items": {},
    }
    means = {
        s["seed"]: {a: {m: float(np.mean([v[m] for v in s["items"][a].values()])) for m in METRICS} for a in ARMS}
        for s in summaries
    }
    for s in summaries:
        out["by_seed"][str(s["seed"])] = {
            "means": means[s["seed"]],
            "compare": s["compare"],
            "final_version": s["run"].get("final_version"),
            "training": s["run"].get("training"),
        }
    for name, (a, b) in COMPARISONS.items():
        out["across_seeds"][name] = {
            m: _stats(paired_stats([means[s][a][m] for s in out["seeds"]], [means[s][b][m] for s in out["seeds"]]))
            for m in METRICS
        }
        pooled = {}
        for m in METRICS:
            x, y = [], []
            for s in summaries:
                for i in sorted(set(s["items"][a]) & set(s["items"][b])):
                    x.append(s["items"][a][i][m])
                    y.append(s["items"][b][i][m])
            pooled[m] = _stats(paired_stats(x, y))
        out["pooled_items"][name] = pooled
    # the seeds asked for (SEEDS) that have no summary yet: a combination of fewer is provisional
    out["missing_seeds"] = sorted(set(expect or []) - set(out["seeds"]))
    # seeds whose training stopped before its steps (the wall budget, a failure): shorter runs, named
    out["short_seeds"] = [
        s["seed"] for s in summaries if (s["run"].get("training") or {}).get("stopped", "steps") != "steps"
    ]
    fvp = out["across_seeds"]["final_vs_proact"]["mr"]
    out["training_beats_proact"] = bool(len(summaries) > 1 and fvp["ci_low"] > 0)
    return out


def _seed(args) -> None:
    from parley.config.run import load_config
    from parley.evaluation.evallog import read_records

    ev = Path(args.eval)
    protocol = json.loads((ev / "protocol.json").read_text())
    cfg = load_config(args.config)
    eval_cfg = load_config(args.eval_config or args.config)
    sc = eval_cfg.scorer
    run = {
        "config": args.config,
        "recipe": cfg.run.recipe,
        "eval_config": args.eval_config or args.config,
        "eval_scoring": {"bleu_variant": sc.bleu_variant, "extract": sc.extract, "interactivity": sc.interactivity},
        "steps_asked": args.steps,
        "final_version": args.version,
        "run_dir": args.run,
        "leakage": leakage(ev),
    }
    if args.train and Path(args.train).is_file():  # written by `trained` after the run's `parley up`
        run["training"] = json.loads(Path(args.train).read_text())
    out = seed_summary(read_records(ev / "records.parquet"), seed=args.seed, protocol=protocol, run=run)
    Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    print(
        json.dumps(
            {"seed": args.seed, "compare_mr": {k: v["mr"] for k, v in out["compare"].items()}}, indent=1, default=float
        )
    )


def _combine(args) -> None:
    expect = [int(x) for x in args.expect.split()] if args.expect else None
    out = combine([json.loads(Path(p).read_text()) for p in args.summaries], expect)
    Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    keys = ("seeds", "missing_seeds", "short_seeds", "across_seeds", "training_beats_proact")
    print(json.dumps({k: out[k] for k in keys}, indent=1, default=float))


def _trained(args) -> None:
    t = training_record(
        args.run,
        rc=args.rc,
        wall_s=args.wall_s,
        budget_s=args.budget_s,
        steps=args.steps,
        shared=args.shared,
        sets=args.sets.split(),
    )
    Path(args.json).write_text(json.dumps(t, indent=1))
    print(f"[collab_gpu] {training_line(t)}")


def pair_report(mode: str, seed: int, sides: list[dict], **facts) -> dict:
    """Both sides of a pair call (bench/collab_gpu.sh train-pair / eval-pair): each one's configuration,
    exit code and training record (RUN_DIR/collab_train.json, where its training wrote one)."""
    out = {"mode": mode, "seed": seed, **facts, "sides": {}}
    for side in sides:
        record = Path(side["run_dir"]) / "collab_train.json"
        side = {**side, "training": json.loads(record.read_text()) if record.is_file() else None}
        out["sides"][side.pop("name")] = side
    return out


def _pair(args) -> None:
    sides = []
    for spec in args.side:
        name, tag, config, rc, run_dir = spec.split(",", 4)
        sides.append({"name": name, "tag": tag, "config": config, "rc": int(rc), "run_dir": run_dir})
    facts = {
        "wall_s": args.wall_s,
        "gpu_gib": args.gpu_gib,
        "share_gib": args.share_gib,
        "up_sets": args.up_sets.split(),
    }
    out = pair_report(args.mode, args.seed, sides, **facts)
    Path(args.json).write_text(json.dumps(out, indent=1))
    for name, side in out["sides"].items():
        t = side["training"]
        how = training_line(t) if t else "training: no record (no run trained in its run directory)"
        how = "a dry run: nothing trained or evaluated" if args.dry else how
        print(f"[collab_gpu] {args.mode} seed {args.seed} side {name} {side['tag']}: exit code {side['rc']}; {how}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("plan")
    a.add_argument("run_dir")
    a.add_argument("--json", default="")
    a.set_defaults(fn=_plan)
    a = sub.add_parser("pick")
    a.add_argument("records")
    a.add_argument("condition")
    a.add_argument("out")
    a.set_defaults(fn=_pick)
    a = sub.add_parser("build")
    a.add_argument("--run", required=True)
    a.add_argument("--eval", required=True)
    a.add_argument("--replay", default="")
    a.add_argument("--json", required=True)
    a.set_defaults(fn=_build)
    a = sub.add_parser("seed")
    a.add_argument("--run", required=True)
    a.add_argument("--eval", required=True)
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--config", required=True)
    a.add_argument("--eval-config", default="")
    a.add_argument("--version", type=int, required=True)
    a.add_argument("--steps", type=int, default=0)
    a.add_argument("--train", default="", help="the run's training record (`trained`), where it has one")
    a.add_argument("--json", required=True)
    a.set_defaults(fn=_seed)
    a = sub.add_parser("trained")
    a.add_argument("--run", required=True)
    a.add_argument("--rc", type=int, required=True)
    a.add_argument("--wall-s", type=float, required=True)
    a.add_argument("--budget-s", type=float, required=True)
    a.add_argument("--steps", type=int, required=True)
    a.add_argument("--shared", action="store_true", help="the run shared its GPU with another (a pair call)")
    a.add_argument("--sets", default="", help="the --set arguments its parley up had beside the config's")
    a.add_argument("--json", required=True)
    a.set_defaults(fn=_trained)
    a = sub.add_parser("pair")
    a.add_argument("--mode", required=True)
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--side", action="append", required=True, help="NAME,TAG,CONFIG,RC,RUN_DIR (once a side)")
    a.add_argument("--wall-s", type=float, default=0.0)
    a.add_argument("--gpu-gib", type=float, default=0.0)
    a.add_argument("--share-gib", type=float, default=0.0)
    a.add_argument("--up-sets", default="")
    a.add_argument("--dry", action="store_true", help="the pair's dry run: its sides ran nothing")
    a.add_argument("--json", required=True)
    a.set_defaults(fn=_pair)
    a = sub.add_parser("combine")
    a.add_argument("--json", required=True)
    a.add_argument("--expect", default="", help='the seeds asked for, e.g. "1 2 3" (those missing are listed)')
    a.add_argument("summaries", nargs="+")
    a.set_defaults(fn=_combine)
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
