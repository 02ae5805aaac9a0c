"""The learner's step with [policy] reference = "local" against "service", on CPU, interleaved in one
process so both see the same machine load. Run by hand (bench/README.md); nothing imports it.

Two Trainers of one model (`--model`, default the embedded toy; "smol" for SmolLM2-135M) train on the
same CollabLLM-like packed batch (bench/learner_gpu.py's draw_samples); the "service" one gets each
sample's reference log-probs beforehand from services.reference.server.ReferenceModel, the reference
service's own model class (that time is reported apart: it is spent off the learner). The steps
alternate local, service, local, ... and the medians and their ratio are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, smol or a checkpoint dir (as [policy] model)")
    p.add_argument("--budget-tokens", type=int, default=512, help="micro-batch token budget")
    p.add_argument("--step-tokens", type=int, default=2048, help="tokens drawn for one step")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up each)")
    p.add_argument("--kl-coef", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import numpy as np
    import torch

    from bench.learner_gpu import draw_samples
    from parley.config.learner import LearnerConfig
    from parley.engines.models import build_tiny, ensure_model
    from parley.learner.trainer import Trainer
    from parley.services.reference.server import ReferenceModel

    model_dir = (
        build_tiny(Path(tempfile.mkdtemp(prefix="parley_refbench_")) / "tiny")
        if args.model == "tiny"
        else ensure_model(args.model)
    )
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    ns = argparse.Namespace(seed=args.seed, budget_tokens=args.budget_tokens, step_tokens=args.step_tokens)
    local_samples = draw_samples(ns, vocab)
    service_samples = draw_samples(ns, vocab)

    ref = ReferenceModel(args.model, model_dir, dtype="float32")
    t0 = time.perf_counter()
    for s in service_samples:
        s.ref = np.concatenate([np.zeros(1, np.float32), ref.logprobs(s.token_ids)])
    ref_s = time.perf_counter() - t0
    del ref

    def trainer(reference: str) -> Trainer:
        return Trainer(
            LearnerConfig(
                kl_coef=args.kl_coef, lr=1e-6, micro_batch_tokens=args.budget_tokens, seed=args.seed, dtype="float32"
            ),
            model_dir,
            reference=reference,
        )

    trainers = {"local": trainer("local"), "service": trainer("service")}
    batches = {"local": local_samples, "service": service_samples}
    times: dict[str, list[float]] = {"local": [], "service": []}
    for i in range(args.steps + 1):
        for name in ("local", "service"):
            t0 = time.perf_counter()
            trainers[name].train_step(batches[name])
            if i:  # the first of each is a warm-up
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = sum(len(s.token_ids) for s in local_samples)
    print(
        json.dumps(
            {
                "model": args.model,
                "tokens_per_step": tokens,
                "sequences": len(local_samples),
                "threads": torch.get_num_threads(),
                "step_s": times,
                "median_s": med,
                "service_over_local": med["service"] / med["local"],
                "reference_service_s_for_the_batch": ref_s,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
