"""What one decoder layer keeps for backward, per token: the bytes deploy.memory's
Shape.layer_activation_bytes plans, counted. Builds a Qwen3 model of one and of two decoder layers at a
shape of bench.common.QWEN3_SHAPES (random weights, bf16, on the CPU), optionally with the learner's
LoRA adapter (learner.lora.add_adapters) and compiled layers (learner.trainer.compile_layers), runs a
packed forward through the learner's varlen attention path and counts the storages autograd saves
(torch.autograd.graph.saved_tensors_hooks; parameters and buffers left out, each storage once). The
two-layer count less the one-layer count is one layer's. Flash attention is a test double here
(FlashDouble: it saves what flash varlen saves: q, k, v, the output and the fp32 log-sum-exp), since
the real kernel needs CUDA. Nothing in parley imports this file.

    PYTHONPATH=$PWD python bench/layer_activations.py --shape 4b   # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import QWEN3_SHAPES  # noqa: E402


class FlashDouble(torch.autograd.Function):
    """Test double of flash varlen attention: the output by SDPA, and the tensors flash keeps saved."""

    @staticmethod
    def forward(ctx, q, k, v):  # (T, H, D) each; one causal sequence is enough for counting
        with torch.no_grad():
            rep = q.shape[1] // k.shape[1]
            kk, vv = (x.repeat_interleave(rep, 1).transpose(0, 1) for x in (k, v))
            out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True).transpose(0, 1)
            out = out.contiguous()
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)  # (Hq, T) fp32, as flash's
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def saved_bytes(shape: dict, layers: int, tokens: int, lora_rank: int, compiled: bool) -> int:
    """Bytes of the storages a forward of `tokens` packed tokens saves for backward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from parley.config.learner import LoraSettings
    from parley.learner import attention
    from parley.learner.lora import add_adapters
    from parley.learner.trainer import compile_layers

    torch.manual_seed(0)
    config = Qwen3Config(**{**shape, "num_hidden_layers": layers, "vocab_size": 512, "tie_word_embeddings": True})
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    if lora_rank:
        add_adapters(model, LoraSettings(enabled=True, rank=lora_rank, alpha=2.0 * lora_rank))
        model.to(torch.bfloat16)  # what DeepSpeed's bf16 engine does to the module, the adapter included
    attention._kernel.update(name="varlen", fn=lambda q, k, v, cu, n, s: FlashDouble.apply(q, k, v), why="double")
    attention.use(model, attention.VARLEN)
    compile_layers(model, "layers" if compiled else "off", torch.device("cpu"), 2)
    ids = torch.randint(0, 512, (1, tokens))
    positions = torch.cat([torch.arange(tokens // 2), torch.arange(tokens - tokens // 2)])[None]  # two sequences
    held = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in held:
            seen[s.data_ptr()] = s.nbytes()
        return t

    for _ in range(2):  # the first forward compiles
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.model(input_ids=ids, position_ids=positions).last_hidden_state
        del out
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4b", choices=sorted(QWEN3_SHAPES))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=16, help="the adapter's rank for the LoRA rows")
    args = p.parse_args()
    shape = {k: v for k, v in QWEN3_SHAPES[args.shape].items() if k != "num_hidden_layers"}
    print(f"| shape {args.shape} | layer | adapter | B a token a layer |\n|---|---|---|---|")
    for compiled in (False, True):
        for rank in (0, args.lora_rank):
            one, two = (saved_bytes(shape, n, args.tokens, rank, compiled) for n in (1, 2))
            kind = "compiled" if compiled else "eager"
            print(f"| | {kind} | {f'rank {rank}' if rank else 'none'} | {(two - one) / args.tokens:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
