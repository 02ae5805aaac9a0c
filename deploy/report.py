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


def _line_chart(
    series: dict[str, list[tuple[int, float]]], path: Path, *, title: str, xlabel: str, ylabel: str = ""
) -> Path:
    """One PNG with a line per series; x values are integers (steps or versions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in sorted(series.items()):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir: Path, out_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    rows = _read_jsonl(metrics_path)
    if not rows:
        raise FileNotFoundError(f"{metrics_path} is missing or empty; is {run_dir} a run directory?")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = run_dir.name
    written = [
        _line_chart(
            reward_series(rows),
            out_dir / "rewards.png",
            title=f"reward terms — {name}",
            xlabel="step",
            ylabel="mean (weighted term)",
        ),
    ]
    optim = {
        key: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        for key in ("kl_mean", "loss", "clip_frac", "entropy")
    }
    written.append(
        _line_chart(
            {k: v for k, v in optim.items() if v},
            out_dir / "kl.png",
            title=f"KL and optimisation — {name}",
            xlabel="step",
        )
    )
    from parley.evaluation.selection import load_versions, run_environment

    env = run_environment(run_dir)  # the environment the run's evals were played in: its table columns
    evals = load_versions(run_dir, env)  # RUN_DIR/eval/v<N>/records.parquet and summary.jsonl
    if evals:
        by_metric = {m: [(v.version, v.mean(m)) for v in evals] for m in env.eval.columns}
        written.append(
            _line_chart(by_metric, out_dir / "eval.png", title=f"held-out eval — {name}", xlabel="policy version")
        )
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
    top.set_ylabel("utilization %")
    top.set_ylim(0, 105)
    bottom.plot([s[0] - t0 for s in samples], [s[2] for s in samples], lw=1.2, color="black", label="GPU total")
    for role, pts in sorted(by_role.items()):
        bottom.plot([p[0] - t0 for p in pts], [p[1] for p in pts], lw=1.0, label=role)
    bottom.set_ylabel("memory GiB")
    bottom.set_xlabel("seconds since the first sample")
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
