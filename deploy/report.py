"""`parley report RUN_DIR`: PNG charts of a run's reward terms, KL and eval metrics per version.

Reads what the learner writes (RUN_DIR/metrics.jsonl, one JSON object per step) and what the
periodic / closing eval writes (RUN_DIR/eval/summary.jsonl, one object per version and metric).
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


def write_report(run_dir: Path, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    rows = _read_jsonl(metrics_path)
    if not rows:
        raise FileNotFoundError(f"{metrics_path} is missing or empty; is {run_dir} a run directory?")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for term, pts in sorted(reward_series(rows).items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=term)
    ax.set_xlabel("step")
    ax.set_ylabel("mean (weighted term)")
    ax.set_title(f"reward terms — {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(out_dir / "rewards.png", dpi=110)
    plt.close(fig)
    written.append(out_dir / "rewards.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("kl_mean", "loss", "clip_frac", "entropy"):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_xlabel("step")
    ax.set_title(f"KL and optimisation — {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(out_dir / "kl.png", dpi=110)
    plt.close(fig)
    written.append(out_dir / "kl.png")

    evals = _read_jsonl(run_dir / "eval" / "summary.jsonl")
    if evals:
        fig, ax = plt.subplots(figsize=(7, 4))
        by_metric: dict[str, list[tuple[int, float]]] = {}
        for e in evals:
            by_metric.setdefault(e["metric"], []).append((int(e["version"]), float(e["mean"])))
        for metric, pts in sorted(by_metric.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", label=metric)
        ax.set_xlabel("policy version")
        ax.set_title(f"held-out eval — {run_dir.name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.savefig(out_dir / "eval.png", dpi=110)
        plt.close(fig)
        written.append(out_dir / "eval.png")
    return written
