"""engines.worker.scaled_in_place: an adapter staged in memory has each module's LoRA scaling folded
into its B matrix before vLLM's manager adds it, in one multi-tensor multiply per scaling value,
with exactly the numbers vLLM's own LoRALayerWeights.optimize gives (what an adapter loaded from its
files gets); a scaling the dtype cannot hold exactly is left to vLLM. Real vLLM weight classes, no engine."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

from engines.worker import scaled_in_place


def _module(name: str, scaling: float, seed: int, with_b: bool = True) -> LoRALayerWeights:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, 8, generator=gen).to(torch.bfloat16) if with_b else None
    return LoRALayerWeights(name, 8, 8 * scaling, a, b, scaling=scaling)


def test_scaling_folded_into_b_is_what_vllms_optimize_gives():
    loras = {f"m{i}": _module(f"m{i}", s, i) for i, s in enumerate([2.0, 2.0, 4.0, 1.0, 0.37, 2.0, 3.0, 1.5])}
    loras["no_b"] = _module("no_b", 2.0, 99, with_b=False)
    want = copy.deepcopy(loras)
    loras_before = copy.deepcopy(loras)
    for w in want.values():
        if w.lora_b is not None:
            w.optimize()  # vLLM's own: lora_b *= scaling, one module at a time
    got = scaled_in_place(SimpleNamespace(loras=loras)).loras
    for name, w in got.items():
        if w.lora_b is None:
            assert w.scaling == 2.0, name  # nothing to scale: left for vLLM as it was
            continue
        if name == "m4":  # 0.37 is no bfloat16: left for vLLM's optimize, untouched here
            assert w.scaling == 0.37 and torch.equal(w.lora_b, loras_before["m4"].lora_b)
            continue
        assert w.scaling == 1, name
        assert torch.equal(w.lora_b, want[name].lora_b), name  # bit for bit, not close
        assert torch.equal(w.lora_a, want[name].lora_a), name
    # what the manager does next (pack, then optimize) finds nothing left to scale
    got["m4"].optimize()
    assert torch.equal(got["m4"].lora_b, want["m4"].lora_b)
    packed = PackedLoRALayerWeights.pack([got["m0"], got["m1"]])
    b_before = [t.clone() for t in packed.lora_b]
    packed.optimize()
    assert all(torch.equal(x, y) for x, y in zip(packed.lora_b, b_before))


def test_an_unscaled_adapter_is_left_alone():
    loras = {"m": _module("m", 1.0, 0)}
    b = loras["m"].lora_b.clone()
    scaled_in_place(SimpleNamespace(loras=loras))
    assert torch.equal(loras["m"].lora_b, b) and loras["m"].scaling == 1.0
