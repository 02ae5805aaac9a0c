"""Log-probs of a packed batch's trained tokens without full-vocabulary logits: only trained
positions go through lm_head, a chunk at a time. `PackedPolicy` is the module DeepSpeed wraps.
Used by learner.trainer and the tests."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.packing import PackedBatch


def _logp_entropy(lm_head, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    logits = lm_head(hidden).float()  # (n, V) for this chunk only
    logp_all = torch.log_softmax(logits, dim=-1)  # (n, V)
    logp = logp_all.gather(1, targets[:, None])[:, 0]  # (n,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (n,)
    return logp, entropy


def token_logprobs(model, batch: PackedBatch, chunk: int = 1024, grad: bool = True) -> tuple[Tensor, Tensor]:
    """Raw-distribution log-probs (N,) of the trained tokens and the entropy (N,) of the model's
    distribution at those positions (detached), for a transformers causal LM.

    Only the hidden states of trained positions go through lm_head, `chunk` at a time, and with
    grad each chunk is checkpointed: its fp32 (chunk, vocab) logits are recomputed in backward
    instead of being kept, so memory holds one chunk of logits, never (T, vocab).
    Sequences are separated by position_ids alone: learner.attention runs a per-sequence kernel on
    their boundaries, or transformers' SDPA turns the restarts into a block-diagonal causal mask
    (refused at start where it would not: attention.check_packing_isolated).
    """
    with torch.set_grad_enabled(grad):
        return _packed_logprobs(model, batch.input_ids, batch.position_ids, batch.src, batch.targets, chunk, grad)


def _packed_logprobs(model, input_ids, position_ids, src, targets, chunk: int, grad: bool,
                     min_chunks: int = 0) -> tuple[Tensor, Tensor]:
    """`min_chunks`: call lm_head at least that often, the extra calls on one hidden row with no weight
    in the result. ZeRO-3 gathers lm_head's weight at every call (forward, and the checkpointed
    recompute in backward), a collective: every rank must make as many calls (PackedPolicy)."""
    base = model.base_model  # the decoder stack without lm_head (Qwen3Model, LlamaModel, ...)
    lm_head = model.get_output_embeddings()
    hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state  # (1, T, H)
    h = hidden[0].index_select(0, src)  # (N, H)

    def head(hi, ti):
        if grad:
            return torch.utils.checkpoint.checkpoint(_logp_entropy, lm_head, hi, ti, use_reentrant=False)
        return _logp_entropy(lm_head, hi, ti)

    parts_lp, parts_ent = [], []
    for i in range(0, h.shape[0], chunk):
        lp, ent = head(h[i : i + chunk], targets[i : i + chunk])
        parts_lp.append(lp)
        parts_ent.append(ent.detach())
    padding = None
    for _ in range(len(parts_lp), min_chunks):
        lp, _ = head(hidden[0, :1], input_ids[0, :1])
        padding = lp.sum() * 0.0 if padding is None else padding + lp.sum() * 0.0
    if not parts_lp:
        zero = h.new_zeros(0, dtype=torch.float32)
        return (zero + padding if padding is not None else zero), zero
    logp = torch.cat(parts_lp)
    if padding is not None:
        logp = logp + padding  # zero, but it keeps the padding calls in the graph (and in backward)
    return logp, torch.cat(parts_ent)


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

    def forward(self, input_ids: Tensor, position_ids: Tensor, src: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        min_chunks = 0
        if self.equal_chunks:
            count = torch.tensor([-(-src.numel() // self.chunk)], device=src.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            min_chunks = int(count.item())
        return _packed_logprobs(self.model, input_ids, position_ids, src, targets, self.chunk, torch.is_grad_enabled(),
                                min_chunks=min_chunks)
