"""Benchmark statistics: per-condition means of the environment's table columns (CollabLLM medium's:
BLEU, interactivity, tokens (k) and MR), and paired t statistics of every condition against a baseline
over the same items; Markdown, CSV and PNG output. Called by `parley eval`, `parley replay` and
evaluation.selection; pure apart from write_table's files.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from parley.config.env import default_environment
from parley.environments.base import Environment
from parley.protocol.messages import EvalRecord

# The columns of the reference table (CollabLLM medium's eval protocol), in its order. Values are per
# item (records of one item in one condition are averaged first, e.g. several simulator seeds), then
# averaged over items. Another environment's columns are its `eval.columns`.
METRICS = ("bleu", "interactivity", "tokens_k", "mr")
LABELS = {"bleu": "BLEU", "interactivity": "interactivity", "tokens_k": "tokens (k)", "mr": "MR", "reward": "reward"}
CONFIDENCE = 0.95


class PairedStats(msgspec.Struct, frozen=True):
    """Paired comparison a - b over n pairs: mean difference, Student t, two-sided p, 95% interval."""

    mean_diff: float
    t: float
    df: int
    p: float
    ci_low: float
    ci_high: float
    n: int


def _t_dist():
    # scipy is needed only for the t distribution's quantile and tail; imported late so that the CLI
    # modules that import this one stay light.
    from scipy.stats import t as student_t

    return student_t


def _as_array(name: str, values: Sequence[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat list of numbers, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(
            f"{name} holds {int(np.sum(~np.isfinite(arr)))} non-finite values; drop or re-score those items"
        )
    return arr


def paired_stats(a: Sequence[float], b: Sequence[float]) -> PairedStats:
    """Paired t test of a against b (a[i] and b[i] are the same item), as scipy.stats.ttest_rel(a, b).

    t = mean(d) / (sd(d, ddof=1) / sqrt(n)) with d = a - b, df = n - 1, p two-sided, and the interval
    mean(d) +- t_{0.975, n-1} * sd / sqrt(n). With one pair only the mean is defined (the rest is nan).
    Where every difference is the same value, sd = 0: we report t = 0, p = 1 for d = 0 (scipy gives
    nan) and t = +-inf, p = 0 otherwise, with a zero-width interval, so identical runs read as "no change".
    """
    x, y = _as_array("a", a), _as_array("b", b)
    if x.shape != y.shape:
        raise ValueError(f"paired_stats needs equal lengths (same items), got {x.size} and {y.size}")
    n = int(x.size)
    if n == 0:
        raise ValueError("paired_stats needs at least one pair, got none")
    d = x - y
    mean = float(np.mean(d))
    if n == 1:
        return PairedStats(mean_diff=mean, t=math.nan, df=0, p=math.nan, ci_low=math.nan, ci_high=math.nan, n=1)
    df = n - 1
    sd = float(np.std(d, ddof=1))
    se = sd / math.sqrt(n)
    # Differences that are all equal up to float noise have sd ~ 1e-17, not 0; treat them as exactly constant.
    if se <= 1e-12 * max(1.0, abs(mean)):
        if mean == 0.0 or abs(mean) <= 1e-12:
            return PairedStats(mean_diff=mean, t=0.0, df=df, p=1.0, ci_low=mean, ci_high=mean, n=n)
        return PairedStats(
            mean_diff=mean, t=math.copysign(math.inf, mean), df=df, p=0.0, ci_low=mean, ci_high=mean, n=n
        )
    t = mean / se
    dist = _t_dist()
    p = float(2.0 * dist.sf(abs(t), df))
    half = float(dist.ppf(0.5 + CONFIDENCE / 2, df)) * se
    return PairedStats(mean_diff=mean, t=t, df=df, p=p, ci_low=mean - half, ci_high=mean + half, n=n)


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its one-sample 95% t interval (nan bounds for n < 2)."""
    arr = _as_array("values", values)
    if arr.size == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = float(np.mean(arr))
    if arr.size < 2:
        return mean, math.nan, math.nan
    half = float(_t_dist().ppf(0.5 + CONFIDENCE / 2, arr.size - 1)) * float(np.std(arr, ddof=1)) / math.sqrt(arr.size)
    return mean, mean - half, mean + half


def record_value(rec: EvalRecord, metric: str, env: Environment | None = None) -> float:
    """One record's value of a table column, as the environment's eval protocol computes it (CollabLLM
    medium's by default: tokens (k) from the stored assistant token count, MR from BLEU, interactivity
    and tokens); a stored metric otherwise (e.g. replay's "reward")."""
    env = env or default_environment()
    try:
        return env.eval.value(metric, rec.metrics, rec)
    except (KeyError, ValueError):  # a derived column raises KeyError for the metric it lacks
        lacking = (
            metric
            if metric not in env.eval.derived
            else next((m for m in env.reward.names if m not in rec.metrics), metric)
        )
        raise ValueError(
            f"record {rec.eval_id!r} (condition {rec.condition!r}, item {rec.item_id!r}) has no {lacking!r} metric "
            f"(has {sorted(rec.metrics)}); it was not scored: re-score it with `parley replay --judge ...`"
        ) from None


def item_values(
    records: Iterable[EvalRecord], metrics: Sequence[str] | None = None, env: Environment | None = None
) -> dict[str, dict[str, float]]:
    """item_id -> column -> value, averaging the records of one item (one condition's records only).
    `metrics` defaults to the environment's table columns."""
    env = env or default_environment()
    metrics = env.eval.columns if metrics is None else metrics
    sums: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    for rec in records:
        row = sums.setdefault(rec.item_id, dict.fromkeys(metrics, 0.0))
        for m in metrics:
            row[m] += record_value(rec, m, env)
        counts[rec.item_id] = counts.get(rec.item_id, 0) + 1
    return {item: {m: v / counts[item] for m, v in row.items()} for item, row in sums.items()}


class ConditionRow(msgspec.Struct, kw_only=True):
    """One condition of the table. `diffs` is empty for the baseline."""

    condition: str
    n: int  # items
    records: int  # conversations (>= n when items were run with several seeds)
    means: dict[str, float]
    intervals: dict[str, tuple[float, float]]  # one-sample 95% interval of each mean
    diffs: dict[str, PairedStats] = {}  # condition - baseline over the items both have
    models: list[str] = []


class Table(msgspec.Struct, kw_only=True):
    baseline: str
    metrics: list[str]
    rows: list[ConditionRow]

    def row(self, condition: str) -> ConditionRow:
        for r in self.rows:
            if r.condition == condition:
                return r
        raise KeyError(f"condition {condition!r} not in the table; have {[r.condition for r in self.rows]}")


def summarize(
    records: list[EvalRecord], baseline: str, metrics: Sequence[str] | None = None, env: Environment | None = None
) -> Table:
    """Group records by condition, average per item then over items, and compare each condition with
    `baseline` by a paired t test over the items both conditions have. Baseline comes first, the
    others in order of first appearance. `metrics`: the environment's table columns unless given."""
    env = env or default_environment()
    metrics = env.eval.columns if metrics is None else metrics
    by_cond: dict[str, list[EvalRecord]] = {}
    for rec in records:
        by_cond.setdefault(rec.condition, []).append(rec)
    if not by_cond:
        raise ValueError("no eval records to summarize")
    if baseline not in by_cond:
        raise ValueError(f"baseline condition {baseline!r} has no records; conditions are {sorted(by_cond)}")
    per_item = {c: item_values(recs, metrics, env) for c, recs in by_cond.items()}
    base_items = per_item[baseline]
    rows = []
    for cond in [baseline, *(c for c in by_cond if c != baseline)]:
        items = per_item[cond]
        means, intervals = {}, {}
        for m in metrics:
            mean, lo, hi = mean_interval([v[m] for v in items.values()])
            means[m], intervals[m] = mean, (lo, hi)
        diffs = {}
        shared = sorted(set(items) & set(base_items))
        if cond != baseline and shared:
            diffs = {
                m: paired_stats([items[i][m] for i in shared], [base_items[i][m] for i in shared]) for m in metrics
            }
        models = sorted({r.model for r in by_cond[cond]})
        rows.append(
            ConditionRow(
                condition=cond,
                n=len(items),
                records=len(by_cond[cond]),
                means=means,
                intervals=intervals,
                diffs=diffs,
                models=models,
            )
        )
    return Table(baseline=baseline, metrics=list(metrics), rows=rows)


LOWER_BETTER = {"tokens_k"}  # the columns where less is better
TOKEN_WEIGHT = 0.1  # MR = BLEU + interactivity - 0.1 x tokens (k) (rewards.reward.mr)
_MR_TERMS = ("bleu", "interactivity", "tokens_k", "mr")
DOMINANT_SHARE = 0.5  # a positive MR gain is flagged when more than this share of it is the token term


def flags(table: Table) -> dict:
    """Which arm wins each metric; for each arm against the baseline, how much of MR's difference is the
    token term's (-0.1 x d tokens) and whether it dominates (more than half of a positive MR gain: a gain
    bought by writing less, not by better documents or more interaction)."""
    wins = {}
    for m in table.metrics:
        best = (min if m in LOWER_BETTER else max)(table.rows, key=lambda r: r.means[m])
        wins[m] = best.condition
    token = {}
    for r in table.rows:
        if not all(m in r.diffs for m in _MR_TERMS):
            continue
        d_mr = r.diffs["mr"].mean_diff
        tok = -TOKEN_WEIGHT * r.diffs["tokens_k"].mean_diff
        rest = r.diffs["bleu"].mean_diff + r.diffs["interactivity"].mean_diff
        token[r.condition] = {
            "mr_diff": d_mr,
            "token_term": tok,
            "bleu_plus_interactivity": rest,
            "token_share": tok / d_mr if d_mr != 0 else math.nan,
            "dominated_by_tokens": bool(d_mr > 0 and tok > DOMINANT_SHARE * d_mr),
        }
    arms = {r.condition: [m for m, c in wins.items() if c == r.condition] for r in table.rows}
    return {"wins_by_metric": wins, "metrics_won_by_arm": arms, "mr_token_term": token}


def flags_markdown(table: Table) -> str:
    """`flags` as text under the table: each metric's winner and, where the table has MR and its terms,
    MR's difference to the baseline split into BLEU + interactivity and the token term, flagged where
    the token term dominates a gain. "" for a table with one condition."""
    if len(table.rows) < 2:
        return ""
    f = flags(table)
    wins = ", ".join(
        f"{LABELS.get(m, m)} `{c}`" + (" (lowest)" if m in LOWER_BETTER else "") for m, c in f["wins_by_metric"].items()
    )
    lines = [f"Best mean of each metric: {wins}."]
    if f["mr_token_term"]:
        lines += [
            "",
            f"MR's difference to `{table.baseline}` by term (token term = -{TOKEN_WEIGHT:g} x d tokens (k)):",
            "",
            "| condition | MR diff | BLEU + interactivity | token term | token share | flag |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for cond, t in f["mr_token_term"].items():
            share = "nan" if math.isnan(t["token_share"]) else f"{100 * t['token_share']:.0f}%"
            flag = "MR gain dominated by the token term" if t["dominated_by_tokens"] else ""
            lines.append(
                f"| {cond} | {_signed(t['mr_diff'])} | {_signed(t['bleu_plus_interactivity'])} "
                f"| {_signed(t['token_term'])} | {share} | {flag} |"
            )
    return "\n".join(lines) + "\n"


def _num(x: float, digits: int = 4) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}f}"


def _signed(x: float, digits: int = 4) -> str:
    return _num(x, digits) if math.isnan(x) or x < 0 else "+" + _num(x, digits)


def _p(p: float) -> str:
    return "nan" if math.isnan(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def to_markdown(table: Table) -> str:
    """The reference table's layout, then every metric's paired difference to the baseline."""
    labels = [LABELS.get(m, m) for m in table.metrics]
    lines = [
        "| condition | n | " + " | ".join(labels) + " |",
        "|---|---:|" + "---:|" * len(labels),
    ]
    for r in table.rows:
        digits = {"interactivity": 3, "tokens_k": 3}
        cells = [_num(r.means[m], digits.get(m, 4)) for m in table.metrics]
        lines.append(f"| {r.condition} | {r.n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Paired differences to `{table.baseline}` (condition - baseline, same items), 95% t interval:",
        "",
        "| condition | metric | diff | 95% CI | t | df | p | n |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in table.rows:
        for m in table.metrics if r.diffs else ():
            s = r.diffs[m]
            lines.append(
                f"| {r.condition} | {LABELS.get(m, m)} | {_signed(s.mean_diff)} | [{_num(s.ci_low)}, {_num(s.ci_high)}] "
                f"| {_num(s.t, 2)} | {s.df} | {_p(s.p)} | {s.n} |"
            )
    return "\n".join(lines) + "\n"


CSV_FIELDS = (
    "condition",
    "metric",
    "n",
    "mean",
    "mean_ci_low",
    "mean_ci_high",
    "diff",
    "diff_ci_low",
    "diff_ci_high",
    "t",
    "df",
    "p",
    "n_paired",
)


def write_csv(table: Table, path: Path) -> None:
    """Long format: one row per condition and metric (diff columns empty for the baseline)."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in table.rows:
            for m in table.metrics:
                lo, hi = r.intervals[m]
                s = r.diffs.get(m)
                diff = [s.mean_diff, s.ci_low, s.ci_high, s.t, s.df, s.p, s.n] if s else [""] * 7
                w.writerow([r.condition, m, r.n, repr(r.means[m]), repr(lo), repr(hi), *diff])


def write_chart(table: Table, path: Path) -> None:
    """One panel per metric: each condition's mean with its 95% interval; the baseline bar is grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.2 * len(table.metrics), 3.6), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, without touching pyplot's global backend
    axes = fig.subplots(1, len(table.metrics), squeeze=False)[0]
    names = [r.condition for r in table.rows]
    colors = ["0.6" if r.condition == table.baseline else "tab:blue" for r in table.rows]
    for ax, m in zip(axes, table.metrics):
        means = np.array([r.means[m] for r in table.rows])
        lows = np.array([r.intervals[m][0] for r in table.rows])
        highs = np.array([r.intervals[m][1] for r in table.rows])
        err = np.nan_to_num(np.vstack([means - lows, highs - means]))
        ax.bar(range(len(names)), means, yerr=err, color=colors, capsize=3)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(LABELS.get(m, m))
        for i, r in enumerate(table.rows):
            s = r.diffs.get(m)
            if s is not None and not math.isnan(s.p) and s.p < 1 - CONFIDENCE:
                ax.annotate("*", (i, highs[i] if np.isfinite(highs[i]) else means[i]), ha="center", va="bottom")
    fig.suptitle(
        f"mean and 95% interval per condition; * = paired p < {1 - CONFIDENCE:.2f} vs {table.baseline}", fontsize=9
    )
    fig.savefig(path, dpi=120)


def write_table(table: Table, out_dir: str | Path) -> dict[str, Path]:
    """Write table.md, table.csv and chart.png into out_dir (created); returns their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "table.md", "csv": out / "table.csv", "png": out / "chart.png"}
    paths["md"].write_text(to_markdown(table))
    write_csv(table, paths["csv"])
    write_chart(table, paths["png"])
    return paths
