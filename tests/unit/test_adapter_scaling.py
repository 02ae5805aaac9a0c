"""weights.worker.scaled_in_place: an adapter staged in memory has each module's LoRA scaling folded
into its B matrix before vLLM's manager adds it, in one multi-tensor multiply per scaling value the
dtype holds exactly (one multiply per module otherwise), with exactly the numbers vLLM's own
LoRALayerWeights.optimize gives (what an adapter loaded from its files gets), and without touching
the staged tensors, so an adapter built again from them after an eviction is scaled once. Real vLLM
weight classes, no engine."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

from parley.weights.worker import scaled_in_place

SCALINGS = [2.0, 2.0, 4.0, 1.0, 0.37, 2.0, 3.0, 1.5]  # 0.37: no bfloat16, the rest exact


def _staged() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"m{i}": (
            torch.randn(8, 64, generator=gen).to(torch.bfloat16),
            torch.randn(96, 8, generator=gen).to(torch.bfloat16),
        )
        for i in range(len(SCALINGS))
    }


def _model(staged) -> SimpleNamespace:
    """What from_lora_tensors builds from staged tensors of the engine's device and dtype: the staged
    tensors themselves, not copies."""
    loras = {
        name: LoRALayerWeights(name, 8, 8 * s, a, b, scaling=s) for (name, (a, b)), s in zip(staged.items(), SCALINGS)
    }
    loras["no_b"] = LoRALayerWeights("no_b", 8, 16.0, staged["m0"][0], None, scaling=2.0)
    return SimpleNamespace(loras=loras)


def test_scaling_folded_into_b_is_what_vllms_optimize_gives():
    want = {n: w for n, w in _model(copy.deepcopy(_staged())).loras.items()}
    for w in want.values():
        if w.lora_b is not None:
            w.optimize()  # vLLM's own: lora_b *= scaling, one module at a time
    got = scaled_in_place(_model(_staged())).loras
    for name, w in got.items():
        if w.lora_b is None:
            assert w.scaling == 2.0, name  # nothing to scale: left for vLLM as it was
            continue
        assert w.scaling == 1, name
        assert torch.equal(w.lora_b, want[name].lora_b), name  # bit for bit, not close
        assert torch.equal(w.lora_a, want[name].lora_a), name
    # what the manager does next (pack, then optimize) finds nothing left to scale
    packed = PackedLoRALayerWeights.pack([got["m0"], got["m1"]])
    b_before = [t.clone() for t in packed.lora_b]
    packed.optimize()
    assert all(torch.equal(x, y) for x, y in zip(packed.lora_b, b_before))


def test_the_staged_tensors_stay_as_sent_so_a_rebuilt_adapter_is_scaled_once():
    staged = _staged()
    sent = copy.deepcopy(staged)
    first = scaled_in_place(_model(staged)).loras
    assert all(torch.equal(staged[n][1], sent[n][1]) for n in staged)  # B as the learner sent it
    again = scaled_in_place(_model(staged)).loras  # vLLM evicted the adapter and builds it again
    for name, w in first.items():
        if w.lora_b is not None:
            assert torch.equal(again[name].lora_b, w.lora_b), name


def test_an_unscaled_adapter_is_left_alone():
    staged = _staged()
    loras = {"m": LoRALayerWeights("m", 8, 8.0, *staged["m0"], scaling=1.0)}
    scaled_in_place(SimpleNamespace(loras=loras))
    assert loras["m"].lora_b is staged["m0"][1] and loras["m"].scaling == 1.0
