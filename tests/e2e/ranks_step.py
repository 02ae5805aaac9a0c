"""Run by tests/e2e/test_learner_ranks.py under torch.distributed.run: one GRPO step of the toy model on
several gloo ranks, the ranks' shards holding different numbers of trained tokens (so of lm_head
chunks). Rank 0 writes the step's stats and the trained weights to OUT. Not a test module itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def step_samples():
    """Sequences of unequal length and trained share; behaviour log-probs near the model's (about -7.6)."""
    from parley.learner.packing import Sample

    spec = [(120, 100, 1.0), (60, 3, -1.0), (60, 2, 0.5), (40, 30, -0.5)]  # (length, trained tokens, advantage)
    out = []
    for i, (length, trained, adv) in enumerate(spec):
        ids = [(31 * i + 7 * k) % 1900 + 5 for k in range(length)]
        mask = [0] * (length - trained) + [1] * trained
        out.append(Sample(f"s{i}", ids, mask, [-7.6 - 0.01 * (k % 5) for k in range(length)], adv))
    return out


def main(model_dir: str, zero: int, out: str) -> None:
    import torch

    from parley.config.learner import LearnerConfig
    from parley.learner.trainer import Trainer

    cfg = LearnerConfig(
        zero_stage=zero, lr=1e-3, kl_coef=0.0, micro_batch_tokens=64, logit_chunk_tokens=8, dtype="float32"
    )
    trainer = Trainer(cfg, model_dir)
    stats = trainer.train_step(step_samples())
    trainer.save_weights(Path(out) / "weights")  # every rank joins the ZeRO-3 gather; rank 0 writes
    # only the writing rank copies the whole model to the CPU
    copied = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(copied, len(trainer.hf_state_dict()))
    if torch.distributed.get_rank() == 0:
        (Path(out) / "stats.json").write_text(json.dumps({**stats, "state_dict_sizes": copied}))
    from parley.learner.ranks import leave_together

    leave_together()  # what the learner's ranks do last


if __name__ == "__main__":
    from parley.learner.ranks import leave_process

    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    leave_process(0)  # as learner.service.run ends a launched rank
