"""Model FLOPs of a training step, the figure MFU divides by the GPU's peak: the formula
bench/learner_gpu.py states and the live learner reports (`model_tflops_per_s` in each step's
metrics), so the bench and a real run are measured alike.

Per sequence of s tokens, training (forward + backward) = 6 * N * s + 6 * L * Hq * d * s^2 (PaLM-style
model FLOPs, recomputation not counted; N = parameters with a tied embedding counted once; the
second term is causal attention, 12 * L * Hq * d * s^2 / 2). Packed sequences attend only within
themselves, so the attention term is summed per sequence. A forward alone is a third of that.

With a frozen base (a LoRA learner: [learner.lora]) no weight gradients are computed for the base, so
its linear layers cost 4 * N a token (forward, and the backward to the activations), not 6 * N; the
adapter's own FLOPs (under 1% at rank 16) are not counted, and attention, which has no weights, keeps
its term. bench/floor.py counts a LoRA floor the same way: one denominator for the doc's MFU figures.

A frozen local reference (a KL term with [policy] reference = "local"; under LoRA the base with the
adapters off) runs one forward over the same tokens: a third of full fine-tuning's count, 2 * N a token
plus the causal attention's forward, whatever the policy trains. With reference = "service" the samples
bring their reference log-probs and the step runs no such forward.
"""

from __future__ import annotations

from collections.abc import Iterable


def train_flops(
    n_params: int,
    layers: int,
    heads: int,
    head_dim: int,
    lengths: Iterable[int],
    *,
    frozen_base: bool,
    reference_forward: bool,
) -> float:
    """A step's model FLOPs: the policy's forward and backward, and the local reference's forward when
    `reference_forward` (the module docstring)."""
    attn = layers * heads * head_dim
    per_token = (4 if frozen_base else 6) * n_params
    lengths = list(lengths)
    policy = sum(per_token * n + 6 * attn * n * n for n in lengths)
    reference = sum(2 * n_params * n + 2 * attn * n * n for n in lengths) if reference_forward else 0
    return float(policy + reference)


def shape_of(config) -> tuple[int, int, int]:
    """(layers, query heads, head dim) of an HF config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, head_dim
