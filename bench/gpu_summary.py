"""The figures of a `parley up` run on one GPU (issue 26 2b and 2c), read from its run directory:
steps per hour, trained and generated tokens per second (and beside them the behaviour/learner log-prob
gap: the KV cache's format, logp_mismatch, the importance ratio, the clip's share), the learner's share of the wall time spent
in its step, the GPU's utilization, step end -> serving per version, peak GPU memory (in all and per
role), and the learner's MFU in the live run; with --target, the time from launch to a target reward.

    python3 bench/gpu_summary.py RUN_DIR [--json OUT] [--peak-tflops 989.4] [--target 0.05]

Reads RUN_DIR/metrics.jsonl (each step's `ended_at`, `train_s`, `trained_tokens`,
`model_tflops_per_s`), RUN_DIR/logs/actor-*.log (the actors' "now serving weights version N" and
"... assistant tokens generated so far" lines, with their log times) and RUN_DIR/gpu/ (the samples
`parley up` takes, deploy/gpu_samples.py). Rates are over the steady window from the first step's
end to the last's, so start-up (engines, compile, the first groups) is reported apart, as the time
to the first step. The peak is the H200 SXM's dense bf16 figure from NVIDIA's datasheet (989.4
TFLOPS); pass the measured matmul peak (bench/learner_gpu.py prints it) to divide by that instead.

--target R: the wall time from launch to the first step whose training reward (metrics.jsonl's
`reward_mean`, the weighted total the groups were trained on) reaches R, and, where the periodic eval
ran (RUN_DIR/eval/history.jsonl), to the first evaluated version whose held-out mean of the run's
eval_metric reaches R: both when that version's step ended and when its eval result came in; then
each reward at the end (the last step's, and the last evaluated version's). Launch is the time
`parley up` wrote RUN_DIR/config.toml (before any role starts), or --launched (epoch seconds) where
another clock started the run. A target not reached is null.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parley.deploy.gpu_samples import read_samples  # noqa: E402
from parley.deploy.up import RUN_CONFIG  # noqa: E402  (the resolved config `parley up` writes at launch)
from parley.learner.steplog import PHASES  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.4
_LOGTIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_SERVING = re.compile(r"now serving weights version (\d+)")
_GENERATED = re.compile(r"\((\d+) assistant tokens generated so far\)")


def log_time(line: str) -> float | None:
    m = _LOGTIME.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logging wrote it


def _rows(run: Path) -> list[dict]:
    return _jsonl(run / "metrics.jsonl")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _eval_metric(run: Path) -> str | None:
    """The run's resolved [learner] eval_metric, from the config `parley up` wrote (None without one)."""
    import tomllib

    path = run / RUN_CONFIG
    return tomllib.loads(path.read_text()).get("learner", {}).get("eval_metric") if path.exists() else None


# The gap between the behaviour log-probs the actor's vLLM returned and the learner's, per step
# (learner.trainer's logp_mismatch: mean |learner - behaviour| over trained tokens; learner.grpo's importance
# ratio and the shares of tokens its clip, dual clip or is_cap bound): the off-policy cost of what makes the
# actor faster (lag, [actor.engine] kv_cache_dtype = "fp8", a stale prefix), read beside the tokens/s it buys.
GAP_MEANS = ("logp_mismatch", "ratio_mean", "clip_frac", "dual_clip_frac", "is_cap_frac")


def behaviour_gap(run: Path, steady: list[dict]) -> dict:
    """The run's KV cache format and the gap's figures over the steady steps: each of GAP_MEANS's mean
    (those the steps recorded) and the largest ratio_max."""
    import tomllib

    path = run / RUN_CONFIG
    engine = tomllib.loads(path.read_text()).get("actor", {}).get("engine", {}) if path.exists() else {}
    out: dict = {"kv_cache_dtype": engine.get("kv_cache_dtype", "auto")}
    for key in GAP_MEANS:
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        if vals:
            out[f"{key}_mean"] = round(statistics.mean(vals), 4)
    peaks = [r["ratio_max"] for r in steady if isinstance(r.get("ratio_max"), (int, float))]
    if peaks:
        out["ratio_max"] = round(max(peaks), 3)
    return out


def time_to_target(
    run: Path, rows: list[dict], target: float, launched: float | None = None, eval_metric: str | None = None
) -> dict:
    """Seconds from launch to the first step whose training reward reaches `target`, and to the first
    evaluated version whose held-out `eval_metric` (the run's own by default) reaches it; the rewards
    at the end. `rows`: metrics.jsonl's steps with their ended_at, in order."""
    if launched is None:
        config = run / RUN_CONFIG
        if not config.exists():
            raise ValueError(f"{run}: no {RUN_CONFIG} to date the launch by; pass --launched EPOCH_SECONDS")
        launched = config.stat().st_mtime
    ended = {int(r["step"]): r["ended_at"] for r in rows}
    trained = [r for r in rows if isinstance(r.get("reward_mean"), (int, float))]
    hit = next((r for r in trained if r["reward_mean"] >= target), None)
    out: dict = {
        "target": target,
        "launched": launched,
        "train_reached_step": int(hit["step"]) if hit else None,
        "train_reached_s": round(hit["ended_at"] - launched, 1) if hit else None,
        "train_reward_end": trained[-1]["reward_mean"] if trained else None,
        "train_end_s": round(trained[-1]["ended_at"] - launched, 1) if trained else None,
    }
    metric = eval_metric or _eval_metric(run)
    evals = sorted(
        (e for e in _jsonl(run / "eval" / "history.jsonl") if isinstance(e.get(metric), (int, float))),
        key=lambda e: e["version"],
    )
    if evals:
        # version 0 is the base model: there before any step
        first = next((e for e in evals if e[metric] >= target), None)
        version_s = None
        if first is not None:
            version_s = 0.0 if first["version"] == 0 else ended.get(int(first["version"]))
            version_s = None if version_s is None else round(max(version_s - launched, 0.0), 1)
        out.update(
            eval_metric=metric,
            held_out_reached_version=first["version"] if first else None,
            held_out_reached_s=version_s,  # when the version that reached it had been trained
            held_out_result_s=round(first["created"] - launched, 1) if first else None,  # when its eval came in
            held_out_end=evals[-1][metric],
            held_out_end_version=evals[-1]["version"],
        )
    return out


def summarize(
    run: Path,
    peak_tflops: float = H200_BF16_DENSE_TFLOPS,
    target: float | None = None,
    launched: float | None = None,
    eval_metric: str | None = None,
) -> dict:
    rows = [r for r in _rows(run) if isinstance(r.get("ended_at"), (int, float))]
    out: dict = {"run_dir": str(run), "steps": len(rows)}
    if target is not None:
        out["time_to_target"] = time_to_target(run, rows, target, launched, eval_metric)
    serving: dict[int, list[float]] = {}
    generated: list[tuple[float, int]] = []
    for log in sorted((run / "logs").glob("actor-*.log")):
        per_actor: list[tuple[float, int]] = []
        for line in log.read_text(errors="replace").splitlines():
            t = log_time(line)
            if t is None:
                continue
            if m := _SERVING.search(line):
                serving.setdefault(int(m.group(1)), []).append(t)
            if m := _GENERATED.search(line):
                per_actor.append((t, int(m.group(1))))
        generated.append(per_actor)  # type: ignore[arg-type]
    samples, by_role = read_samples(run)
    if samples:
        out["gpu_memory_peak_gib"] = round(max(s[2] for s in samples), 2)
        out["gpu_memory_peak_by_role_gib"] = {r: round(max(p[1] for p in pts), 2) for r, pts in by_role.items()}
    if len(rows) < 2:
        out["note"] = "fewer than two steps: no steady-state rates"
        return out
    t1, tn = rows[0]["ended_at"], rows[-1]["ended_at"]
    window = tn - t1
    steady = rows[1:]
    trained = sum(r.get("trained_tokens", 0.0) for r in steady)
    out.update(
        window_s=round(window, 1),
        first_step_ended_s_after_first_gpu_sample=round(t1 - samples[0][0], 1) if samples else None,
        steps_per_hour=round(len(steady) / window * 3600, 1),
        trained_tokens_per_s=round(trained / window, 1),
        behaviour_gap=behaviour_gap(run, steady),  # beside the tokens/s: what the speed costs in off-policy-ness
        tokens_per_s_all=round(sum(r.get("tokens", 0.0) for r in steady) / window, 1),
        learner_step_share=round(sum(r.get("train_s", 0.0) for r in steady) / window, 3),
        train_s_median=round(statistics.median(r["train_s"] for r in steady), 2),
        wait_s_median=round(statistics.median(r.get("wait_s", 0.0) for r in steady), 2),
    )
    # where the learner's step goes (learner.steplog.PHASES: host seconds, medians over the window)
    phases = {
        k: round(statistics.median(r[k] for r in steady), 2)
        for k in PHASES
        if all(isinstance(r.get(k), (int, float)) for r in steady)
    }
    if phases:
        out["learner_phase_s_median"] = phases
    tflops = [r["model_tflops_per_s"] for r in steady if isinstance(r.get("model_tflops_per_s"), (int, float))]
    if tflops:
        out.update(
            model_tflops_per_s_median=round(statistics.median(tflops), 1),
            peak_tflops=peak_tflops,
            live_mfu_median=round(statistics.median(tflops) / peak_tflops, 3),
        )
    for key in ("reserved_gib", "peak_allocated_gib", "cache_released_gib"):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            out[f"learner_{key}_max"] = round(max(vals), 2)
    in_window = [s for s in samples if t1 <= s[0] <= tn]
    if in_window:
        out["gpu_util_mean_pct"] = round(statistics.mean(s[1] for s in in_window), 1)
        out["gpu_busy_share"] = round(sum(1 for s in in_window if s[1] > 0) / len(in_window), 3)
    gen_rate = 0.0
    for per_actor in generated:
        pts = [p for p in per_actor if t1 <= p[0] <= tn]
        if len(pts) >= 2:
            gen_rate += (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    out["generated_tokens_per_s"] = round(gen_rate, 1) if gen_rate else None
    ended = {int(r["step"]): r["ended_at"] for r in rows}
    lat = {v: round(max(ts) - ended[v], 3) for v, ts in serving.items() if v in ended}
    out["step_end_to_serving_s"] = lat  # every actor serving it (the last actor's time)
    if lat:
        out["step_end_to_serving_median_s"] = round(statistics.median(lat.values()), 3)
    stale: dict[str, int] = {}
    for r in rows:
        for k, v in (r.get("staleness_hist") or {}).items():
            stale[k] = stale.get(k, 0) + int(v)
    out["staleness_hist"] = stale
    # [actor.engine] prefix_cache_across_versions: trained turns generated over KV older weights computed
    for key in ("stale_prefix_turn_share", "stale_prefix_token_share"):
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        if vals:
            out[f"{key}_mean"] = round(statistics.mean(vals), 3)
    out["groups"] = rows[-1].get("groups")
    out["versions_skipped_held"] = [int(r["step"]) for r in rows if r.get("publish_skipped_held")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    ap.add_argument("--target", type=float, help="a reward: report the time from launch to it")
    ap.add_argument("--launched", type=float, help="launch time, epoch seconds (default: RUN_DIR/config.toml's)")
    ap.add_argument("--eval-metric", help="the held-out column (default: the run's [learner] eval_metric)")
    args = ap.parse_args()
    out = summarize(args.run_dir, args.peak_tflops, args.target, args.launched, args.eval_metric)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
