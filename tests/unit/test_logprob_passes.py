"""The passes the learner's log-probs make over a chunk's (chunk, vocab) logits (engines.logprobs, issue
56: where the learner's step goes). At the 4B shape a chunk's fp32 log-probs are 0.62 GB and a step has
~96 chunks: the (detached) entropy's exp, product and sum, ~3.7 GB of memory traffic a chunk, are not
computed again by the checkpoint's recompute in backward. The values and gradients are the previous
computation's, exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parley.engines.logprobs import packed_logprobs

VOCAB = 1000


class OpLog(TorchDispatchMode):
    """Test double of a profiler: every aten op with its first output's shape and dtype."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
        self.ops.append((str(func.overloadpacket.__name__), shape, getattr(first, "dtype", None)))
        return out


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16).train()


def _batch(n: int = 24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, n), generator=g)
    pos = torch.arange(n)[None]
    src = torch.arange(0, n - 1)
    return ids, pos, src, ids[0, 1:]


def _with_graph(lm_head, hidden, targets, inv_temp=None):
    """The head before: the entropy computed with a graph (so saved for backward, and recomputed there)."""
    logits = lm_head(hidden).float()
    if inv_temp is not None:
        logits = logits * inv_temp[:, None]
    logp_all = torch.log_softmax(logits, dim=-1)
    return logp_all.gather(1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def test_backward_does_not_compute_the_entropy_again(model):
    ids, pos, src, targets = _batch()
    n = src.numel()
    log = OpLog()
    with log:
        logp, _ = packed_logprobs(model, ids, pos, src, targets, chunk=8, grad=True)
        n_forward = len(log.ops)
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    forward, backward = log.ops[:n_forward], log.ops[n_forward:]
    chunk_rows = {(8, VOCAB), (n - 16, VOCAB)}
    # the entropy's exp once a chunk in forward; the recompute in backward stops at the gather
    assert sum(op[0] == "exp" and op[1] in chunk_rows for op in forward) == 3
    assert [op for op in backward if op[0] == "exp" and op[1] in chunk_rows] == []
    # the recompute still runs the head (the log-softmax whose output backward needs)
    assert sum(op[0] == "_log_softmax" and op[1] in chunk_rows for op in backward) == 3


@pytest.mark.parametrize("tempered", [False, True])
def test_values_and_gradients_are_the_previous_computations(model, monkeypatch, tempered):
    import parley.engines.logprobs as lp

    ids, pos, src, targets = _batch()
    inv_temp = torch.linspace(0.6, 1.5, src.numel()) if tempered else None
    logp, entropy = packed_logprobs(model, ids, pos, src, targets, chunk=8, grad=True, inv_temp=inv_temp)
    (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(lp, "_logp_entropy", _with_graph)
    want_lp, want_ent = packed_logprobs(model, ids, pos, src, targets, chunk=8, grad=True, inv_temp=inv_temp)
    (want_lp * torch.linspace(-1, 1, want_lp.numel())).sum().backward()
    assert logp.dtype == torch.float32 and torch.equal(logp.detach(), want_lp.detach())
    assert torch.equal(entropy, want_ent)
    for k, p in model.named_parameters():
        assert torch.equal(grads[k], p.grad), k
    model.zero_grad(set_to_none=True)
