"""Log-probs of a packed batch's trained tokens without full-vocabulary logits (the computation is
engines.logprobs.packed_logprobs, shared with the reference service). `PackedPolicy` is the module
DeepSpeed wraps. Used by learner.trainer and the tests."""

from __future__ import annotations

import torch
from torch import Tensor

from parley.engines.logprobs import packed_logprobs
from parley.learner.packing import PackedBatch


def token_logprobs(model, batch: PackedBatch, chunk: int = 1024, grad: bool = True) -> tuple[Tensor, Tensor]:
    """Log-probs (N,) of the trained tokens under the distribution they were sampled from (the raw
    model's, or at each sample's temperature: batch.inv_temp) and the entropy (N,) of that
    distribution at those positions (detached), for a transformers causal LM.

    Only the hidden states of trained positions go through lm_head, `chunk` at a time, and with
    grad each chunk is checkpointed: its fp32 (chunk, vocab) logits are recomputed in backward
    instead of being kept, so memory holds one chunk of logits, never (T, vocab).
    Sequences are separated by position_ids alone: learner.attention runs a per-sequence kernel on
    their boundaries, or transformers' SDPA turns the restarts into a block-diagonal causal mask
    (refused at start where it would not: attention.check_packing_isolated).
    """
    with torch.set_grad_enabled(grad):
        return packed_logprobs(
            model, batch.input_ids, batch.position_ids, batch.src, batch.targets, chunk, grad, inv_temp=batch.inv_temp
        )


class PackedPolicy(torch.nn.Module):
    """What DeepSpeed wraps: the HF causal LM, with a forward that returns the log-probs and
    entropies of a packed batch's trained tokens. The forward must go through engine(...):
    ZeRO-3 counts micro-steps in engine.forward and accumulates gradients only across counted
    ones (calling the model directly kept just the last micro-batch's gradient)."""

    def __init__(self, model, chunk: int, equal_chunks: bool = False):
        super().__init__()
        self.model = model
        self.chunk = chunk
        # ZeRO-3 on several ranks: lm_head calls are collectives (a parameter all-gather each), and the
        # ranks' micro-batches hold different numbers of trained tokens, so of lm_head chunks. Every
        # rank pads to the largest count; without it the ranks' collectives mismatch (gloo aborts
        # "collective mismatch", NCCL hangs).
        self.equal_chunks = equal_chunks

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, src: Tensor, targets: Tensor, inv_temp: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        min_chunks = 0
        if self.equal_chunks:
            count = torch.tensor([-(-src.numel() // self.chunk)], device=src.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            min_chunks = int(count.item())
        return packed_logprobs(
            self.model,
            input_ids,
            position_ids,
            src,
            targets,
            self.chunk,
            torch.is_grad_enabled(),
            min_chunks=min_chunks,
            inv_temp=inv_temp,
        )
