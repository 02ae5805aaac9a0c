"""The card's table for a CollabLLM-medium run (issue 31, bench/collab_gpu.sh phase 2), from the outputs
of `parley eval`, `parley select` and `parley replay`; and the judge's discrimination on the run, from the
learner's archive of trained groups. The statistics are evaluation.benchmark's; this only arranges them.

    python bench/collab_table.py plan RUN_DIR                 # versions to evaluate: 0, 25/50/75/100 %, selected
    python bench/collab_table.py pick RECORDS COND OUT        # one condition's records, for `parley replay`
    python bench/collab_table.py build --run RUN_DIR --eval EVAL_DIR [--replay DIR] --json OUT.json
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
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
