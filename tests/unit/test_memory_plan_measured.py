"""The memory plan's learner against the learner's measured peaks at the 4B shape: the plan stays an
upper bound of what the GPU held and not far above it, compiled layers and eager, with and without
recompute; and which activations count follows the learner's resolved compile mode (config.learner's
rule, which learner.trainer acts on). The model directory is a stand-in holding only the 4B
config.json. No GPU, no model."""

from __future__ import annotations

from pathlib import Path

import pytest

from parley.config.learner import compile_mode, compiles_layers
from parley.config.run import load_config
from parley.deploy.memory import compiled_layers, learner_terms, model_shape
from tests.unit.test_config_gpu1_4b import stand_in

LORA = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "gpu-1-4b-lora.toml"

# The LoRA learner of gpu-1-4b-lora.toml alone on one H100 80GB HBM3 (bench/results/learner_gpu/summary.json,
# its last run: part LP of `bash bench/gpu_run.sh LP`): rank 16 on all seven projections, ZeRO-2 on one
# rank, bf16, varlen flash attention, logit_chunk_tokens 1024, 64 conversations of 1,816 tokens a step
# (packed two, four and nine to a micro-batch of 4,096, 8,192 and 16,384 tokens). torch.cuda's peak
# allocated GiB: it counts neither the CUDA context nor cuda_ipc buffers (the run published nothing).
MEASURED = [  # (micro_batch_tokens, gradient_checkpointing, [learner] compile, peak GiB)
    (4096, False, "layers", 24.0),
    (8192, False, "layers", 37.3),
    (16384, True, "layers", 14.9),
    (8192, False, "off", 47.0),
]
# The plan counts a full micro-batch (micro_batch_tokens; here 3,632 / 7,264 tokens were packed into
# 4,096 / 8,192, 12.8% fewer) and LOGIT_COPIES fp32 logit chunks: above the peak by that, not more.
MOST_ABOVE = 1.13


def planned(model: Path, tokens: int, recompute: bool, compile: str) -> float:
    """The plan's learner in GiB, less what the measured run did not hold (the CUDA context, cuda_ipc buffers)."""
    sets = [
        f"policy.model={model}",
        f"actor.engine.model={model}",
        f"learner.micro_batch_tokens={tokens}",
        f"learner.gradient_checkpointing={'true' if recompute else 'false'}",
        f'learner.compile="{compile}"',
    ]
    terms = learner_terms(load_config(LORA, sets), model_shape(str(model)))
    return sum(t.gib for t in terms if not t.host and t.what != "CUDA context" and not t.what.startswith("cuda_ipc"))


@pytest.mark.parametrize("tokens, recompute, compile, peak", MEASURED)
def test_the_plan_bounds_the_measured_learner_closely(tmp_path, tokens, recompute, compile, peak):
    ratio = planned(stand_in(tmp_path), tokens, recompute, compile) / peak
    assert 1.0 <= ratio <= MOST_ABOVE, f"plan / measured = {ratio:.3f}"


def test_which_layers_count_follows_the_resolved_compile_mode(tmp_path):
    model = stand_in(tmp_path)
    base = [f"policy.model={model}", f"actor.engine.model={model}", "learner.gradient_checkpointing=false"]

    def case(*sets):
        cfg = load_config(LORA, [*base, *sets])
        act = next(t for t in learner_terms(cfg, model_shape(str(model))) if t.what.startswith("activations"))
        return compiled_layers(cfg), act

    auto, auto_act = case()  # as shipped: "auto", LoRA without a KL term, ZeRO-2, a GPU plan
    layers, layers_act = case('learner.compile="layers"')
    assert auto and layers and auto_act == layers_act and "compiled" in auto_act.what
    for sets in (['learner.compile="off"'], ["learner.kl_coef=0.01"], ["learner.zero_stage=3"]):
        compiled, act = case(*sets)  # off; "auto" with LoRA and a KL term; "auto" under ZeRO-3
        assert not compiled and "eager" in act.what and act.gib > 1.3 * auto_act.gib, sets
    # one rule for the trainer and the plan
    lc = load_config(LORA, base).learner
    assert compiles_layers(compile_mode(lc), True, lc.zero_stage) and not compiles_layers(compile_mode(lc), False, 2)


def test_a_layer_keeps_what_saved_tensor_hooks_count():
    """Bytes a token one Qwen3-4B-shaped decoder layer saves for backward in bf16, counted with
    torch.autograd.graph.saved_tensors_hooks (unique storages, parameters left out) by
    bench/layer_activations.py on a CPU: eager and compiled, full fine-tuning and a rank-16 adapter on
    all seven projections."""
    from bench.common import QWEN3_SHAPES, QWEN3_VOCAB
    from parley.deploy.memory import Shape

    shape = Shape.of(dict(model_type="qwen3", vocab_size=QWEN3_VOCAB, tie_word_embeddings=True, **QWEN3_SHAPES["4b"]))
    seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert shape.layer_activation_bytes(compiled=False) == 170_280
    assert shape.layer_activation_bytes(compiled=False, lora_rank=16, lora_targets=seven) == 150_024
    assert shape.layer_activation_bytes(compiled=True) == 109_864
    assert shape.layer_activation_bytes(compiled=True, lora_rank=16, lora_targets=seven) == 110_088
