"""Log-probs of chosen tokens under a transformers causal LM without full-vocabulary logits: only
the positions that predict them go through lm_head, a chunk at a time. The one definition shared by
the learner (its policy and its local reference, learner/logprobs.py) and the reference service
(services/reference/server.py), so both compute a reference log-prob the same way."""

from __future__ import annotations

import torch
from torch import Tensor


def _logp_entropy(lm_head, hidden: Tensor, targets: Tensor, inv_temp: Tensor | None = None) -> tuple[Tensor, Tensor]:
    logits = lm_head(hidden).float()  # (n, V) for this chunk only
    if inv_temp is not None:
        logits = logits * inv_temp[:, None]  # the sampling distribution at temperature T: softmax(logits / T)
    logp_all = torch.log_softmax(logits, dim=-1)  # (n, V)
    logp = logp_all.gather(1, targets[:, None])[:, 0]  # (n,)
    # Reported, never trained: without a graph it saves nothing for backward, so the checkpoint's
    # recompute in backward stops after the gather (its last saved tensor) instead of computing the
    # exp, product and sum over the (n, V) fp32 log-probs again
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # (n,)
    return logp, entropy


def packed_logprobs(
    model,
    input_ids: Tensor,
    position_ids: Tensor,
    src: Tensor,
    targets: Tensor,
    chunk: int,
    grad: bool,
    min_chunks: int = 0,
    inv_temp: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probs (N,) of `targets` read from the logits at packed positions `src` (the position
    before each target), and the entropy (N,) of the distribution there (detached). The
    distribution is the raw model's, or with `inv_temp` (N,) the one sampled at temperature
    1 / inv_temp: log_softmax(logits * inv_temp), what vLLM reports as processed_logprobs.

    input_ids, position_ids: (1, T), sequences concatenated with positions restarting at 0 for each.
    With grad each lm_head chunk is checkpointed: its fp32 (chunk, vocab) logits are recomputed in
    backward instead of being kept, so memory holds one chunk of logits, never (T, vocab).
    `min_chunks`: call lm_head at least that often, the extra calls on one hidden row with no weight
    in the result. ZeRO-3 gathers lm_head's weight at every call (forward, and the checkpointed
    recompute in backward), a collective: every rank must make as many calls (learner.logprobs.PackedPolicy)."""
    base = model.base_model  # the decoder stack without lm_head (Qwen3Model, LlamaModel, ...)
    lm_head = model.get_output_embeddings()
    hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state  # (1, T, H)
    h = hidden[0].index_select(0, src)  # (N, H)

    def head(hi, ti, si=None):
        if grad:
            return torch.utils.checkpoint.checkpoint(_logp_entropy, lm_head, hi, ti, si, use_reentrant=False)
        return _logp_entropy(lm_head, hi, ti, si)

    parts_lp, parts_ent = [], []
    for i in range(0, h.shape[0], chunk):
        lp, ent = head(h[i : i + chunk], targets[i : i + chunk], None if inv_temp is None else inv_temp[i : i + chunk])
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


def sequence_logprobs(model, token_ids: Tensor, chunk: int) -> Tensor:
    """(T-1,) float32: the log-prob of every token of one sequence (T,) given its prefix (token 0
    has none), forward only. What the reference service answers."""
    n = int(token_ids.numel())
    ids = token_ids.reshape(1, n).to(torch.long)
    pos = torch.arange(n, device=ids.device)[None]
    src = torch.arange(max(n - 1, 0), device=ids.device)
    with torch.inference_mode():
        logp, _ = packed_logprobs(model, ids, pos, src, ids[0, 1:], chunk, grad=False)
    return logp.float()
