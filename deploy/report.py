"""`parley report RUN_DIR`: PNG charts of a run's reward terms, KL and eval metrics per version,
and, for a run on a GPU, a timeline of what the GPU did.

Reads what the learner writes (RUN_DIR/metrics.jsonl, one JSON object per step), the evaluated
versions that `parley select` reads (RUN_DIR/eval/v<N>/records.parquet, RUN_DIR/eval/summary.jsonl)
and the GPU samples `parley up` takes (RUN_DIR/gpu/, deploy/gpu_samples.py).
"""

from __future__ import annotations

import json
from pathlib import Path


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """term -> [(step, mean)] from each step's reward_terms (weighted terms) and the total."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        step = int(r.get("step", 0))
        for term, stats in (r.get("reward_terms") or {}).items():
            if isinstance(stats.get("mean"), (int, float)):
                series.setdefault(term, []).append((step, float(stats["mean"])))
        if isinstance(r.get("reward_mean"), (int, float)):
            series.setdefault("total", []).append((step, float(r["reward_mean"])))
    return series


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _integer_x(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def rewards_figure(series: dict[str, list[tuple[int, float]]], *, title: str):
    """One line per weighted reward term and the total, against the training step."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    for name, pts in sorted(series.items()):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean per trajectory (weighted reward term)")
    ax.set_title(title)
    if series:
        ax.legend(fontsize=8)
    _integer_x(ax)
    return fig


# (metrics.jsonl key, axis label): each pair of a panel on its own axes, the second on a twin axis,
# because their scales differ by orders of magnitude (KL is often below 1e-3, entropy near 3).
OPTIM_PANELS = (
    (("kl_mean", "KL to the reference (nats / token)"), ("entropy", "policy entropy (nats / token)")),
    (("loss", "loss (per trained token)"), ("clip_frac", "clipped share of trained tokens (0-1)")),
)


def optim_figure(rows: list[dict], *, title: str):
    """KL and entropy (top), loss and clip fraction (bottom), each quantity on its own y axis; a
    panel whose quantities no row has is left out (None when none has any)."""

    def series(key: str) -> list[tuple[int, float]]:
        return sorted((int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float)))

    panels = [[(key, label, series(key)) for key, label in pair] for pair in OPTIM_PANELS]
    panels = [p for p in panels if any(pts for _, _, pts in p)]
    if not panels:
        return None
    fig, axes = _pyplot().subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), sharex=True, squeeze=False)
    colors = ("tab:blue", "tab:orange")
    for ax, panel in zip(axes[:, 0], panels):
        drawn = [(i, key, label, pts) for i, (key, label, pts) in enumerate(panel) if pts]
        for n, (i, key, label, pts) in enumerate(drawn):
            target = ax if n == 0 else ax.twinx()  # the left axis first, so no axis is left unlabelled
            target.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=colors[i], label=key)
            target.set_ylabel(label, color=colors[i])
            target.tick_params(axis="y", colors=colors[i])
        _integer_x(ax)
    axes[-1, 0].set_xlabel("training step")
    axes[0, 0].set_title(title)
    return fig


# Units of the eval columns that have one beyond their name (the rest are scores or shares).
EVAL_UNITS = {"tokens_k": "thousand tokens", "assistant_words": "words", "assistant_turns": "turns"}


def eval_series(evals, columns) -> dict[str, list[tuple[int, float, float, float]]]:
    """column -> [(version, mean, low, high)]: each evaluated version's mean over its held-out items
    with the 95% t interval that `parley select` reports (nan bounds for a single item)."""
    from parley.evaluation.benchmark import mean_interval

    return {m: [(v.version, *mean_interval(v.values(m))) for v in evals] for m in columns}


def eval_figure(series: dict[str, list[tuple[int, float, float, float]]], *, title: str):
    """One panel per eval column (their scales differ): the mean per policy version with its 95%
    confidence interval as error bars."""
    import math

    names = list(series)
    fig, axes = _pyplot().subplots(len(names), 1, figsize=(7, 2.4 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        pts = sorted(series[name])
        x, mean = [p[0] for p in pts], [p[1] for p in pts]
        err = [
            [0.0 if math.isnan(p[2]) else p[1] - p[2] for p in pts],
            [0.0 if math.isnan(p[3]) else p[3] - p[1] for p in pts],
        ]
        ax.errorbar(x, mean, yerr=err, marker="o", capsize=3, label=f"{name}: mean, 95% CI")
        unit = EVAL_UNITS.get(name)
        ax.set_ylabel(f"{name} ({unit})" if unit else name)
        ax.legend(fontsize=7, loc="best")
        _integer_x(ax)
    axes[-1, 0].set_xlabel("policy version")
    axes[0, 0].set_title(f"{title} (mean over held-out items, 95% CI)")
    return fig


def write_report(run_dir: Path, out_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    rows = _read_jsonl(metrics_path)
    if not rows:
        raise FileNotFoundError(f"{metrics_path} is missing or empty; is {run_dir} a run directory?")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = run_dir.name
    written = [_save(rewards_figure(reward_series(rows), title=f"reward terms — {name}"), out_dir / "rewards.png")]
    optim = optim_figure(rows, title=f"KL and optimisation — {name}")
    if optim is None:  # no optimiser statistics yet: an empty chart with its axes named
        optim = _pyplot().figure(figsize=(7, 3))
        ax = optim.add_subplot()
        ax.set(
            xlabel="training step",
            ylabel="KL to the reference (nats / token)",
            title=f"no optimiser statistics — {name}",
        )
    written.append(_save(optim, out_dir / "kl.png"))
    from parley.evaluation.selection import load_versions, run_environment

    env = run_environment(run_dir)  # the environment the run's evals were played in: its table columns
    evals = load_versions(run_dir, env)  # RUN_DIR/eval/v<N>/records.parquet and summary.jsonl
    if evals:
        fig = eval_figure(eval_series(evals, env.eval.columns), title=f"held-out eval — {name}")
        written.append(_save(fig, out_dir / "eval.png"))
    timeline = gpu_timeline(run_dir, rows, out_dir / "gpu.png", title=f"GPU — {name}")
    if timeline is not None:
        written.append(timeline)
    return written


def gpu_timeline(run_dir: Path, rows: list[dict], path: Path, *, title: str) -> Path | None:
    """Utilization (top) and memory by role (bottom) against seconds since the first sample, with a
    dotted line at each step's end (metrics' ended_at); None when the run has no GPU samples."""
    from parley.deploy.gpu_samples import read_samples

    samples, by_role = read_samples(run_dir)
    if not samples:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0][0]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    top.plot([s[0] - t0 for s in samples], [s[1] for s in samples], lw=0.8, color="tab:blue")
    top.set_ylabel("GPU utilization (%)")
    top.set_ylim(0, 105)
    bottom.plot([s[0] - t0 for s in samples], [s[2] for s in samples], lw=1.2, color="black", label="GPU total")
    for role, pts in sorted(by_role.items()):
        bottom.plot([p[0] - t0 for p in pts], [p[1] for p in pts], lw=1.0, label=role)
    bottom.set_ylabel("GPU memory (GiB)")
    bottom.set_xlabel("time since the first sample (s)")
    bottom.legend(fontsize=7, ncol=3)
    for r in rows:
        if isinstance(r.get("ended_at"), (int, float)) and r["ended_at"] >= t0:
            for ax in (top, bottom):
                ax.axvline(r["ended_at"] - t0, color="grey", ls=":", lw=0.6)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.set_title(f"{title} (dotted: step ends)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
