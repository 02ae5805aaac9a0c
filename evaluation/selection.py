"""Checkpoint selection on the benchmark: which policy version is best by one of the environment's
selectable columns (CollabLLM medium: BLEU, interactivity or MR; by default its `eval.select`), with its
interval and paired comparisons, and a regression test for early stopping. Reads the periodic eval's
files under RUN_DIR/eval (layout in docs/benchmark.md); called by `parley select` and by the learner.
The training reward is refused as a selection metric on purpose.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from parley.config.env import default_environment
from parley.environments.base import Environment
from parley.errors import ConfigError
from parley.evaluation.benchmark import METRICS, PairedStats, item_values, mean_interval, paired_stats
from parley.rewards.reward import REWARD_REFUSED, TRAINING_REWARD_NAMES, mr

# CollabLLM medium's selectable columns (its eval protocol's); another environment's are its eval.selectable
SELECT_METRICS = ("bleu", "interactivity", "mr")
EVAL_DIR = "eval"
RECORDS_FILE = "records.parquet"
SUMMARY_FILE = "summary.jsonl"
CONFIG_FILE = "config.toml"  # RUN_DIR/eval/config.toml: the run's configuration, [env] included (periodic.py)


class SelectionError(ConfigError):
    """A selection request that cannot be answered (bad metric, nothing evaluated)."""


@dataclass
class VersionEval:
    """One version's benchmark values per item: item_id -> metric -> value (bleu, interactivity, tokens_k, mr)."""

    version: int
    items: dict[str, dict[str, float]]
    step: int | None = None
    source: str = ""

    def values(self, metric: str, items: list[str] | None = None) -> list[float]:
        return [self.items[i][metric] for i in (items if items is not None else sorted(self.items))]

    def mean(self, metric: str) -> float:
        return math.fsum(self.values(metric)) / len(self.items)


@dataclass
class Selection:
    metric: str
    version: int
    step: int | None
    mean: float
    ci_low: float
    ci_high: float
    n: int
    vs_first: PairedStats | None  # against the earliest evaluated version (the starting policy)
    first_version: int
    vs_runner_up: PairedStats | None
    runner_up: int | None
    ranking: list[tuple[int, float, int]] = field(default_factory=list)  # (version, mean, n), best first

    def describe(self) -> str:
        def cmp(label: str, s: PairedStats | None) -> str:
            if s is None:
                return ""
            return (
                f"; vs {label}: {s.mean_diff:+.4f} [{s.ci_low:+.4f}, {s.ci_high:+.4f}] t={s.t:.2f} p={s.p:.3g} n={s.n}"
            )

        step = f" (step {self.step})" if self.step is not None else ""
        return (
            f"best by {self.metric}: v{self.version}{step} mean {self.mean:.4f} "
            f"95% CI [{self.ci_low:.4f}, {self.ci_high:.4f}] n={self.n}"
            + cmp(f"v{self.first_version}", self.vs_first)
            + cmp(f"runner-up v{self.runner_up}", self.vs_runner_up)
        )


def check_metric(metric: str, label: str = "--metric", env: Environment | None = None) -> str:
    """`metric` if it is one of the environment's selectable columns (CollabLLM medium's by default);
    the training reward is refused with the reason."""
    env = env or default_environment()
    if metric.lower() in TRAINING_REWARD_NAMES:
        raise SelectionError(f"{label} {metric}: {REWARD_REFUSED}")
    if metric not in env.eval.selectable:
        raise SelectionError(
            f"{label} {metric!r} not allowed; use one of {', '.join(env.eval.selectable)} "
            f"(the selectable columns of environment {env.name!r})"
        )
    return metric


def run_environment(run_dir: str | Path) -> Environment:
    """The environment a run's evals were played in: the [env] section of RUN_DIR/eval/config.toml (the
    periodic eval writes it), CollabLLM medium when there is none (a run from before environments)."""
    import tomllib

    import msgspec

    from parley.config.env import EnvConfig

    path = Path(run_dir) / EVAL_DIR / CONFIG_FILE
    if not path.is_file():
        return default_environment()
    try:
        raw = tomllib.loads(path.read_text()).get("env")
        return default_environment() if raw is None else msgspec.convert(raw, EnvConfig).load()
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError, LookupError) as e:
        raise SelectionError(f"{path}: cannot resolve the run's environment from its [env]: {e}") from None


def _summary_items(raw: dict, where: str, env: Environment) -> dict[str, dict[str, float]]:
    """A summary line's items: every table column of the environment per item. A CollabLLM line written
    before summaries stored every column has no MR; it is computed from the other three."""
    columns = env.eval.columns
    items = {}
    for item, v in (raw.get("items") or {}).items():
        if isinstance(v, dict) and env.eval.columns == METRICS and "mr" not in v:
            try:
                v = {**v, "mr": mr(float(v["bleu"]), float(v["interactivity"]), float(v["tokens_k"]))}
            except (KeyError, TypeError, ValueError):
                pass  # named below
        try:
            items[item] = {c: float(v[c]) for c in columns}
        except (KeyError, TypeError, ValueError):
            needed = [c for c in columns if c != "mr"] if columns == METRICS else list(columns)
            raise SelectionError(
                f"{where}: item {item!r} needs numeric {', '.join(needed[:-1])} and {needed[-1]}, got {v!r}"
            ) from None
    return items


def load_versions(run_dir: str | Path, env: Environment | None = None) -> list[VersionEval]:
    """Every evaluated version of a run, oldest first: RUN_DIR/eval/v<N>/records.parquet, and the
    versions of RUN_DIR/eval/summary.jsonl that have no records file (a later line for a version wins).
    Values are the environment's table columns (`env`: the run's, run_environment)."""
    from parley.evaluation.evallog import read_records

    env = env or run_environment(run_dir)
    root = Path(run_dir) / EVAL_DIR
    found: dict[int, VersionEval] = {}
    summary = root / SUMMARY_FILE
    if summary.exists():
        for lineno, line in enumerate(summary.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{summary}:{lineno}"
            try:
                raw = json.loads(line)
                version = int(raw["version"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise SelectionError(f"{where}: not a summary line (needs JSON with an integer 'version')") from None
            step = raw.get("step")
            found[version] = VersionEval(
                version, _summary_items(raw, where, env), None if step is None else int(step), where
            )
    for path in sorted(root.glob(f"v*/{RECORDS_FILE}")):
        try:
            version = int(path.parent.name[1:])
        except ValueError:
            continue  # not a version directory
        records = [r for r in read_records(path) if r.metrics]  # unscored conversations have no values
        stated = {r.version for r in records} - {-1, version}  # -1: the writer left the version unset
        if stated:
            raise SelectionError(f"{path} holds records of versions {sorted(stated)}, expected only {version}")
        found[version] = VersionEval(
            version, item_values(records, env=env), found.get(version, VersionEval(version, {})).step, str(path)
        )
    return [found[v] for v in sorted(found) if found[v].items]


def _paired(a: VersionEval, b: VersionEval, metric: str) -> PairedStats | None:
    shared = sorted(set(a.items) & set(b.items))
    return paired_stats(a.values(metric, shared), b.values(metric, shared)) if shared else None


def select_best(
    run_dir: str | Path,
    metric: str | None = None,
    versions: list[VersionEval] | None = None,
    env: Environment | None = None,
) -> Selection:
    """The version with the highest mean of `metric` over its eval items (ties: the earliest); `metric`
    None = the environment's default (`env`: the run's, run_environment). `versions`:
    load_versions(run_dir) when the caller has read them already."""
    env = env or run_environment(run_dir)
    metric = check_metric(env.eval.select if metric is None else metric, env=env)
    versions = load_versions(run_dir, env) if versions is None else versions
    if not versions:
        root = Path(run_dir) / EVAL_DIR
        raise SelectionError(f"no evaluated versions under {root} (looked for v<N>/{RECORDS_FILE} and {SUMMARY_FILE})")
    ranked = sorted(versions, key=lambda v: (-v.mean(metric), v.version))
    best = ranked[0]
    mean, lo, hi = mean_interval(best.values(metric))
    first = versions[0]
    runner = ranked[1] if len(ranked) > 1 else None
    return Selection(
        metric=metric,
        version=best.version,
        step=best.step,
        mean=mean,
        ci_low=lo,
        ci_high=hi,
        n=len(best.items),
        vs_first=_paired(best, first, metric) if first is not best else None,
        first_version=first.version,
        vs_runner_up=_paired(best, runner, metric) if runner else None,
        runner_up=runner.version if runner else None,
        ranking=[(v.version, v.mean(metric), len(v.items)) for v in ranked],
    )


@dataclass
class Regression:
    """The latest version against the best earlier one, when it is significantly worse."""

    latest: int
    best: int
    stats: PairedStats  # latest - best, paired over their shared items

    def describe(self, metric: str, alpha: float) -> str:
        s = self.stats
        return (
            f"{metric} of version {self.latest} is below version {self.best}'s by {-s.mean_diff:.4f} "
            f"(95% CI of the difference [{s.ci_low:+.4f}, {s.ci_high:+.4f}], t={s.t:.2f}, one-sided p={s.p / 2:.3g} "
            f"< alpha {alpha}, n={s.n})"
        )


def regression(
    history: list[VersionEval], metric: str, alpha: float = 0.05, env: Environment | None = None
) -> Regression | None:
    """The latest version's regression on `metric` against the best earlier one, if significant:
    paired over shared items, one-sided p < alpha. Fewer than two shared items never count as a regression."""
    check_metric(metric, env=env)
    if len(history) < 2:
        return None
    latest, earlier = history[-1], history[:-1]
    best = max(earlier, key=lambda v: v.mean(metric))
    s = _paired(latest, best, metric)
    if s is None or s.n < 2 or math.isnan(s.p):
        return None
    return Regression(latest.version, best.version, s) if s.mean_diff < 0 and s.p / 2 < alpha else None


def regressed(history: list[VersionEval], metric: str, alpha: float = 0.05, env: Environment | None = None) -> bool:
    """True when `regression` finds one."""
    return regression(history, metric, alpha, env) is not None
