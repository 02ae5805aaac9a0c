"""The physical floor of a one-GPU workload: a step's training at the datasheet's dense rate plus its
decode at the HBM roofline, one after the other (the learner and the actor share the card).

docs/gpu.md ("Throughput against the floor") derives the formulas; this script is that arithmetic,
so the doc's figures and a new workload's (more groups a step, a larger decode batch, LoRA) come from
one place:

    python bench/floor.py                                   # gpu-1-4b.toml's workload, both cards
    python bench/floor.py --groups 8 --batch 128 --lora     # 8 groups a step, 128 sequences a decode step
    python bench/floor.py --json floor.json

Training counts 6 N FLOP a token through the model (forward 2 N, backward 4 N) plus causal attention's
6 L Hq d T^2 a sequence; with LoRA the frozen base needs no weight gradients, so 4 N a token (the
adapter's own FLOP are under 1% at rank 16 and left out: a floor). Recomputation is not counted.
Decode reads the weights once per decode step and the KV of every sequence in the batch at its mean
context. MFU figures elsewhere use the same denominator: the datasheet's dense bf16 rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from parley.engines.models import MODEL_SHAPES

# Datasheet figures: dense bf16 TFLOP/s (SXM parts) and HBM bandwidth, TB/s
CARDS = {"h100": (989.4, 3.35), "h200": (989.4, 4.8)}
# The chat template's tokens around the opening user message (random_qwen3's tokenizer, ChatML): the
# doc's mean context counts them once per conversation
OPENING_OVERHEAD = 24
# <|im_start|>, the role and its newline; <|im_end|> and its newline: a message's 3 tokens more on its own
MESSAGE_OVERHEAD = 3


@dataclass(frozen=True)
class Workload:
    """What a step trains and decodes: `groups` x `n` conversations of `turns` assistant turns of
    `max_tokens` after user messages of `user_words` words (one token a word with random_qwen3)."""

    model: str = "Qwen/Qwen3-4B"
    groups: int = 4
    n: int = 8
    turns: int = 4
    user_words: int = 64
    max_tokens: int = 384
    batch: int = 64  # sequences a decode step
    lora: bool = False


def params(shape: dict) -> int:
    """Parameters of a Qwen3/Llama-shaped decoder (embeddings once when tied)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    v = shape["vocab_size"]
    attn = h * (q * d + 2 * kv * d) + q * d * h
    mlp = 3 * h * i
    norms = 2 * h + (2 * d if shape.get("model_type") == "qwen3" else 0)
    embed = v * h * (1 if shape.get("tie_word_embeddings") else 2)
    return n * (attn + mlp + norms) + embed + h


def floor(w: Workload, card: str) -> dict:
    shape = MODEL_SHAPES[w.model]
    tflops, tbps = CARDS[card]
    n_params = params(shape)
    layers, q, d, kv = (
        shape[k] for k in ("num_hidden_layers", "num_attention_heads", "head_dim", "num_key_value_heads")
    )
    seqs = w.groups * w.n
    conv = w.turns * (w.user_words + MESSAGE_OVERHEAD) + w.turns * (w.max_tokens + MESSAGE_OVERHEAD)
    trained = seqs * w.turns * w.max_tokens
    through = seqs * conv
    per_token = (4 if w.lora else 6) * n_params
    train_flop = per_token * through + seqs * 6 * layers * q * d * conv**2
    train_s = train_flop / (tflops * 1e12)
    # turn k (1..turns) reads the opening, its user message, the k-1 earlier exchanges and half its own
    # tokens on average
    exchange = w.user_words + w.max_tokens
    mean_ctx = OPENING_OVERHEAD + w.user_words + (w.turns - 1) / 2 * exchange + w.max_tokens / 2
    kv_token = 2 * layers * kv * d * 2
    weights_b = 2 * n_params
    decode_steps = trained / w.batch
    step_b = weights_b + w.batch * mean_ctx * kv_token
    decode_s = decode_steps * step_b / (tbps * 1e12)
    unbounded_s = (weights_b + trained * mean_ctx * kv_token) / (tbps * 1e12)
    return {
        "card": card,
        "params": n_params,
        "trained_tokens_per_step": trained,
        "all_tokens_per_step": through,
        "training_flop_per_step": train_flop,
        "decode_steps_per_step": decode_steps,
        "bytes_per_decode_step_gb": round(step_b / 1e9, 2),
        "train_s": round(train_s, 3),
        "decode_s": round(decode_s, 3),
        "floor_trained_tokens_per_s": round(trained / (train_s + decode_s)),
        "floor_if_decode_batch_unbounded": round(trained / (train_s + unbounded_s)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=Workload.model, choices=sorted(k for k in MODEL_SHAPES if "/" in k))
    for name in ("groups", "n", "turns", "user_words", "max_tokens", "batch"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(Workload, name))
    p.add_argument("--lora", action="store_true", help="4 N FLOP a token: no weight gradients for the frozen base")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    for name in ("groups", "n", "turns", "user_words", "max_tokens", "batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    w = Workload(a.model, a.groups, a.n, a.turns, a.user_words, a.max_tokens, a.batch, a.lora)
    out = {"workload": asdict(w), "cards": {c: floor(w, c) for c in CARDS}}
    json.dump(out, sys.stdout, indent=1)
    print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
