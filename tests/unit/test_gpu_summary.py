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
        }
        for s in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "actor-0.log").write_text(
        f"{stamp(t0 + 10.25)} actor INFO parley.actor: now serving weights version 1 (was 0, step 1, cuda_ipc)\n"
        f"{stamp(t0 + 12)} actor INFO parley.actor: task t1: 8 samples stored in 3.0s (1000 assistant tokens generated so far)\n"
        f"{stamp(t0 + 30.5)} actor INFO parley.actor: now serving weights version 3 (was 1, step 3, cuda_ipc)\n"
        f"{stamp(t0 + 28)} actor INFO parley.actor: task t2: 8 samples stored in 3.0s (5000 assistant tokens generated so far)\n"
    )
    out = summarize(tmp_path, peak_tflops=989.4)
    assert out["steps"] == 3 and out["window_s"] == 20.0 and out["steps_per_hour"] == 360.0
    assert out["trained_tokens_per_s"] == 100.0 and out["learner_step_share"] == 0.4
    assert out["step_end_to_serving_s"] == {1: 0.25, 3: 0.5}
    assert out["generated_tokens_per_s"] == 250.0  # 4000 tokens in 16 s
    assert out["live_mfu_median"] == 0.5 and out["versions_skipped_held"] == [2]
    assert out["staleness_hist"] == {"1": 12}
