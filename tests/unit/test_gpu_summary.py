"""bench/gpu_summary.py on a hand-made run directory: the steady window is first step end to last,
step end -> serving is the last actor's log time minus the step's ended_at, generated tokens/s comes
from the actors' running totals, MFU from the learner's model FLOPs."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gpu_summary import summarize  # noqa: E402


def stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_figures_of_a_small_run(tmp_path):
    t0 = 1_800_000_000.0
    rows = [
        {
            "step": s,
            "ended_at": t0 + 10 * s,
            "train_s": 4.0,
            "trained_tokens": 1000.0,
            "tokens": 1500.0,
            "wait_s": 1.0,
            "model_tflops_per_s": 494.7,
            "staleness_hist": {"1": 4},
            "publish_skipped_held": float(s == 2),
            "forward_s": 1.0 + s,
            "optimizer_s": 0.5,
            "logp_mismatch": 0.01 * s,
            "ratio_max": 1.5 + s,
            "clip_frac": 0.1,
        }
        for s in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "actor-0.log").write_text(
        f"{stamp(t0 + 10.25)} actor INFO parley.weights.payloads: now serving weights version 1 (was 0, step 1, cuda_ipc)\n"
        f"{stamp(t0 + 12)} actor INFO parley.actors.actor: task t1: 8 samples stored in 3.0s (1000 assistant tokens generated so far)\n"
        f"{stamp(t0 + 30.5)} actor INFO parley.weights.payloads: now serving weights version 3 (was 1, step 3, cuda_ipc)\n"
        f"{stamp(t0 + 28)} actor INFO parley.actors.actor: task t2: 8 samples stored in 3.0s (5000 assistant tokens generated so far)\n"
    )
    out = summarize(tmp_path, peak_tflops=989.4)
    assert out["steps"] == 3 and out["window_s"] == 20.0 and out["steps_per_hour"] == 360.0
    assert out["trained_tokens_per_s"] == 100.0 and out["learner_step_share"] == 0.4
    assert out["step_end_to_serving_s"] == {1: 0.25, 3: 0.5}
    assert out["generated_tokens_per_s"] == 250.0  # 4000 tokens in 16 s
    assert out["live_mfu_median"] == 0.5 and out["versions_skipped_held"] == [2]
    assert out["staleness_hist"] == {"1": 12}
    # the phases the steps recorded, medians over the window (steps 2 and 3); absent ones left out
    assert out["learner_phase_s_median"] == {"forward_s": 3.5, "optimizer_s": 0.5}
    # the behaviour/learner gap over the window (steps 2 and 3), beside the tokens/s; no config: "auto" KV
    assert out["behaviour_gap"] == {
        "kv_cache_dtype": "auto",
        "logp_mismatch_mean": 0.025,
        "clip_frac_mean": 0.1,
        "ratio_max": 4.5,
    }
    keys = list(out)
    assert keys.index("behaviour_gap") == keys.index("trained_tokens_per_s") + 1


def test_time_to_target_from_launch_in_training_and_held_out(tmp_path):
    """Launch is config.toml's time; the first step (and the first evaluated version) at or above the
    target gives the time; the rewards at the end are the last step's and the last eval's."""
    import os

    import pytest

    t0 = 1_800_000_000.0
    (tmp_path / "config.toml").write_text('[learner]\neval_metric = "low_share"\n')
    os.utime(tmp_path / "config.toml", (t0, t0))
    rewards = {1: 0.01, 2: 0.03, 3: 0.06, 4: 0.05, 5: 0.08}
    rows = [{"step": s, "ended_at": t0 + 60 + 10 * s, "train_s": 4.0, "reward_mean": r} for s, r in rewards.items()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval").mkdir()
    evals = [(0, 0.004, 65), (2, 0.03, 95), (4, 0.055, 120)]  # version, held-out low_share, result time
    (tmp_path / "eval" / "history.jsonl").write_text(
        "".join(
            json.dumps({"version": v, "step": v, "n": 20, "low_share": m, "assistant_words": 9.0, "created": t0 + c})
            + "\n"
            for v, m, c in evals
        )
    )
    out = summarize(tmp_path, target=0.05)["time_to_target"]
    assert out["launched"] == pytest.approx(t0)
    assert (out["train_reached_step"], out["train_reached_s"]) == (3, 90.0)  # step 3 ended 90 s after launch
    assert (out["train_reward_end"], out["train_end_s"]) == (0.08, 110.0)
    assert out["eval_metric"] == "low_share" and out["held_out_reached_version"] == 4
    assert (out["held_out_reached_s"], out["held_out_result_s"]) == (100.0, 120.0)
    assert (out["held_out_end"], out["held_out_end_version"]) == (0.055, 4)

    # not reached: null times, the ends still reported; another clock's launch
    out = summarize(tmp_path, target=0.5, launched=t0 + 10)["time_to_target"]
    assert out["train_reached_s"] is None and out["held_out_reached_s"] is None and out["train_end_s"] == 100.0
    assert out["held_out_end"] == 0.055
    # without config.toml the launch must be given
    (tmp_path / "config.toml").unlink()
    with pytest.raises(ValueError, match="pass --launched"):
        summarize(tmp_path, target=0.05)


def test_the_gap_names_the_runs_kv_cache_format(tmp_path):
    from gpu_summary import RUN_CONFIG, behaviour_gap

    (tmp_path / RUN_CONFIG).write_text('[actor.engine]\nkv_cache_dtype = "fp8"\n')
    steady = [{"logp_mismatch": 0.02, "is_cap_frac": 0.001, "ratio_max": 2.0}]
    assert behaviour_gap(tmp_path, steady) == {
        "kv_cache_dtype": "fp8",
        "logp_mismatch_mean": 0.02,
        "is_cap_frac_mean": 0.001,
        "ratio_max": 2.0,
    }
