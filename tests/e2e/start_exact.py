"""Does the learner start from the saved weights? Before its first optimizer step, the log-probs of
two packed trajectories by the policy under DeepSpeed, by the frozen reference, and by a plain
transformers forward of the saved weights over each trajectory alone. Used in-process by
tests/e2e/test_learner_exact.py and, for several ranks, run by it under torch.distributed.run
(rank 0 writes the figures to OUT/start.json). Not a test module itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LENGTHS = (300, 180)  # long enough that a RoPE computed in bf16 moves the log-probs visibly


def trajectories(vocab: int, lengths=LENGTHS):
    from parley.learner.packing import Sample

    out = []
    for i, n in enumerate(lengths):
        ids = [(37 * i + 11 * k + k * k) % (vocab - 3) + 3 for k in range(n)]
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        out.append(Sample(f"t{i}", ids, mask, [0.0] * n, 1.0))
    return out


def plain_logprobs(model_dir, samples, dtype, device):
    """The saved weights through transformers alone: one forward per trajectory, full logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    parts = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.token_ids], device=device)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # (n, V)
            trained = [p for p in range(1, len(s.token_ids)) if s.loss_mask[p]]
            parts.append(logp[[p - 1 for p in trained], [s.token_ids[p] for p in trained]])
    del model
    return torch.cat(parts)


def start_figures(model_dir, zero: int, dtype_name: str, lengths=LENGTHS) -> dict:
    """Max and mean |policy - reference| and |policy - plain| over the trained tokens, the k3 KL of
    policy to reference as the step reports it, and whether lm_head is still the embedding."""
    import torch

    from parley.config.learner import LearnerConfig
    from parley.learner.grpo import kl_k3
    from parley.learner.logprobs import token_logprobs
    from parley.learner.packing import build_batch
    from parley.learner.trainer import Trainer, resolve_dtype

    dtype = resolve_dtype(dtype_name)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from transformers import AutoConfig

    samples = trajectories(AutoConfig.from_pretrained(model_dir).vocab_size, lengths)
    # before the Trainer: while a ZeRO-3 Trainer lives, from_pretrained partitions what it loads
    plain = plain_logprobs(model_dir, samples, dtype, device)
    trainer = Trainer(LearnerConfig(zero_stage=zero, kl_coef=0.001, dtype=dtype_name, logit_chunk_tokens=64), model_dir)
    try:
        batch = build_batch(samples, trainer.device)
        trainer.engine.eval()
        with torch.no_grad():
            policy, _ = trainer.engine(batch.input_ids, batch.position_ids, batch.src, batch.targets)
            reference, _ = token_logprobs(trainer.reference, batch, 64, grad=False)
        model = trainer.module
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    finally:
        trainer.close()
    policy, reference, plain = policy.float().cpu(), reference.float().cpu(), plain.float().cpu()
    return {
        "tokens": int(policy.numel()),
        "policy_vs_reference_max": float((policy - reference).abs().max()),
        "policy_vs_plain_max": float((policy - plain).abs().max()),
        "policy_vs_plain_mean": float((policy - plain).abs().mean()),
        "kl_mean": float(kl_k3(policy, reference).mean()),
        "tied": bool(tied),
    }


def main(model_dir: str, zero: int, dtype_name: str, out: str) -> None:
    import torch

    figures = start_figures(model_dir, zero, dtype_name)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, figures)
    if torch.distributed.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "start.json").write_text(json.dumps(gathered))
    from parley.learner.ranks import leave_together

    leave_together()  # what the learner's ranks do last


if __name__ == "__main__":
    from parley.learner.ranks import leave_process

    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
    leave_process(0)  # as learner.service.run ends a launched rank
