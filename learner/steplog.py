"""Per-step records of the learner: run_dir/metrics.jsonl (every metric of a step as one JSON
line), run_dir/tb (the numeric ones as TensorBoard scalars, the staleness histogram), the same
numbers to Weights & Biases with `[log] wandb` (a runtime.tracking.Tracker, with each evaluated
version's means) and run_dir/trained.jsonl (the resume ledger of which trajectories each step trained).
Written by learner.stepper (truncated by learner.resume); read by the live view, reports and the resume test.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from parley.learner.checkpoint import truncate_jsonl
from parley.runtime.durable import fsync_dir

TRAINED_FILE = "trained.jsonl"  # in the run directory; `parley trace` reads it too

# where a step's train_s goes, host seconds, each a metric of the step (learner.trainer train_step):
# building each micro-batch and its forward, loss and loss statistics (these read values back, so the
# forward's GPU work is inside); backward; reading the micro-batch's statistics back (waits for the
# backward's GPU work); the optimizer step; handing the cache back. Their sum is train_s less the
# step's sharding and packing.
PHASES = ("forward_s", "backward_s", "readback_s", "optimizer_s", "release_s")


def behaviour_gap(stats: dict, alarm: float) -> str | None:
    """Why a step's behaviour log-probs cannot be the trained model's ([learner] behaviour_gap_alarm),
    or None: its logp_mismatch (mean |learner - behaviour| over trained tokens) above `alarm` nats."""
    gap = stats.get("logp_mismatch")
    if not alarm or gap is None or not gap > alarm:
        return None
    return (
        f"the actor's behaviour log-probs differ from the learner's by {gap:.2f} nats a token on average "
        f"(behaviour_gap_alarm {alarm:g}): the actor sampled from another model than the one trained; check "
        "the actor engine's settings (kv_cache_dtype, its vLLM compilation) and that its weight updates apply"
    )


def _flatten(prefix: str, value, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out[prefix] = float(value)


class StepLog:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, tracker=None):
        self.dir = Path(run_dir)
        self.tracker = tracker  # runtime.tracking.Tracker, or None
        self._evals_logged: set[int] = set()
        if tracker is not None:
            tracker.axis("eval/*", "eval/version")  # an eval finishes steps after its version was trained
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.trained_path = self.dir / TRAINED_FILE
        self._new_file = not self.trained_path.exists()  # its directory entry is made durable once
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tb"))

    def reported(self) -> set[str]:
        """Every task a kept trained.jsonl line reports not trained (on resume, after truncate)."""
        out: set[str] = set()
        if self.trained_path.is_file():
            for line in self.trained_path.read_text().splitlines():
                if line.strip():
                    out.update(json.loads(line).get("not_trained", {}))
        return out

    def truncate(self, step: int) -> None:
        """On resume: forget steps after the checkpointed one (they are trained again)."""
        for path in (self.metrics_path, self.trained_path):
            truncate_jsonl(path, step)

    def write(self, step: int, metrics: dict, trained: dict) -> None:
        """metrics: nested dict of numbers (and lists/strings, JSONL only); trained: ledger entry."""
        with self.trained_path.open("a") as f:
            f.write(json.dumps({"step": step, **trained}) + "\n")
            f.flush()
            os.fsync(f.fileno())  # durable before the ledger write that vouches for the step
        if self._new_file:
            fsync_dir(self.dir)
            self._new_file = False
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
        flat: dict[str, float] = {}
        _flatten("", {k: v for k, v in metrics.items() if k != "staleness_hist"}, flat)
        if self.tracker is not None:
            self.tracker.log(flat, step=step)
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, step)
            hist = metrics.get("staleness_hist") or {}
            values = [int(lag) for lag, count in hist.items() for _ in range(int(count))]
            if values:
                import numpy as np

                self._tb.add_histogram("staleness", np.array(values), step)
            self._tb.flush()

    def log_evals(self, finished: list[tuple[int, dict[str, float]]]) -> None:
        """Send each evaluated version's means (version, {column: mean}) to the tracker once."""
        if self.tracker is None:
            return
        for version, means in finished:
            if version not in self._evals_logged:
                self._evals_logged.add(version)
                self.tracker.log({"eval/version": version, **{f"eval/{m}": v for m, v in means.items()}})

    def close(self, finished: list[tuple[int, dict[str, float]]] = ()) -> None:
        if self._tb is not None:
            self._tb.close()
        if self.tracker is not None:
            self.log_evals(list(finished))
            self.tracker.finish()
