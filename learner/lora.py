"""The learner's LoRA side ([learner.lora]): peft adapters injected into the policy in place, the
frozen base as the KL reference (adapters disabled, no second copy), and the adapter's tensors
and config for publication (weights.lora). Used by learner.trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from parley.config.learner import LoraSettings

if TYPE_CHECKING:
    import torch
    from torch import Tensor


def add_adapters(model, settings: LoraSettings):
    """Inject a fresh LoRA adapter into `model` (an HF causal LM) in place and freeze the rest;
    returns the PeftModel that owns it. `model` keeps its own forward (the packed log-probs read it):
    its targeted Linear layers are now peft's LoRA layers. With serve = "merged" every targeted layer
    must be a Linear one (merged_tensors merges those)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    missing = [t for t in settings.target_modules if not any(n.endswith(f".{t}") for n, _ in model.named_modules())]
    if missing:
        raise ValueError(
            f"[learner.lora] target_modules {missing} name no module of {type(model).__name__}; "
            "use the names of its Linear layers, e.g. q_proj, v_proj"
        )
    conf = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )
    peft_model = get_peft_model(model, conf)
    if settings.merged:
        other = sorted({type(m).__name__ for m in lora_layers(model).values() if not isinstance(m, LoraLinear)})
        if other:
            raise ValueError(
                f'[learner.lora] serve = "merged" with target_modules {list(settings.target_modules)}: peft adapts '
                f"some as {other}, which the learner does not merge; target Linear layers only (e.g. "
                'q_proj, v_proj), or serve = "adapter"'
            )
    return peft_model


def lora_layers(model) -> dict:
    """peft's LoRA layers in `model` (the HF model the adapters were injected into), by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_tensors(model, layers: dict | None = None) -> Iterator[tuple[str, Tensor]]:
    """The policy's whole weights with the adapter merged in, under the base checkpoint's names
    ([learner.lora] serve = "merged"): what merge_and_unload would leave, computed without changing
    `model` (the HF model peft injected into, which keeps training). Per tensor of hf_tensors: an
    adapted Linear's weight is W + scaling * B @ A (merged_weight: summed in fp32, rounded once to W's
    dtype, on W's device; peft rounds its delta to a half-precision dtype first), the adapter's own
    tensors are left out, everything else is the base's tensor itself (no copy). A generator: each
    merged weight is made as it is taken, so a caller that copies one at a time (to the host) holds
    one at a time. `layers`: lora_layers(model), found once by the caller."""
    for name, t, layer in _base_tensors(model, layers):
        yield name, (t if layer is None else merged_weight(layer, t))


def merge_into(model, layers: dict | None = None) -> tuple[list[tuple[str, Tensor]], Callable[[dict], None]]:
    """merged_tensors for a packed buffer (weights.cuda_ipc.IpcPublisher.fill's `finish`): (the
    tensors to copy in: the base's under the checkpoint's names, an adapted projection's base weight in
    its merged weight's place; `finish`, which merges each adapter into its projection's copy in the
    buffer, one fp32 sum at a time). The buffer then holds what merged_tensors gives, bit for bit,
    without a merged copy of every projection beside the model."""
    named, adapted = [], []
    for name, t, layer in _base_tensors(model, layers):
        named.append((name, t))
        if layer is not None:
            adapted.append((name, layer))

    def finish(dsts: dict) -> None:
        for name, layer in adapted:
            dst = dsts[name]  # the base weight, copied
            merged = merged_sum(layer, dst)
            if merged is not dst:
                dst.copy_(merged)

    return named, finish


def _base_tensors(model, layers: dict | None):
    """(checkpoint name, the base's tensor, its LoRA layer when it is an adapted Linear's weight, else
    None) for every tensor of hf_tensors(model) but the adapter's own."""
    from parley.weights.snapshot import hf_tensors

    layers = lora_layers(model) if layers is None else layers
    for name, t in hf_tensors(model):
        if ".lora_" in name:  # lora_A / lora_B (and peft's other adapter tensors): merged into the weight
            continue
        module, sep, rest = name.partition(".base_layer.")
        if not sep:
            yield name, t, None
        else:
            yield f"{module}.{rest}", t, (layers[module] if rest == "weight" else None)


def merged_weight(layer, weight: Tensor) -> Tensor:
    """`weight` (the base Linear's) plus every active adapter's scaling * B @ A, in weight's dtype."""
    return merged_sum(layer, weight).to(weight.dtype)


def merged_sum(layer, weight: Tensor) -> Tensor:
    """delta + `weight` in fp32, delta the active adapters' scaling * B @ A: one fp32 tensor of the
    weight's size (the delta, the weight added into it; the same sum as peft's W + delta, bit for
    bit); `weight` itself when no adapter is active."""
    out = None
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a, b = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach()
        delta = (b.float() @ a.float()).mul_(layer.scaling[name])
        delta = delta.T if layer.fan_in_fan_out else delta
        out = delta if out is None else out.add_(delta)
    return weight if out is None else out.add_(weight)


def base_only(peft_model):
    """Context in which the model computes the frozen base: the reference (adapters disabled)."""
    return peft_model.disable_adapter() if peft_model is not None else contextlib.nullcontext()


def adapter_state(peft_model, device: str | None = "cpu") -> tuple[dict, dict]:
    """(tensors under peft's saved names, copied to CPU; the adapter's config as a dict): what
    weights.lora.write_adapter writes and vLLM loads. device=None: the trained tensors themselves,
    where they are (no copy; the GPU transport packs them into its buffer at once)."""
    from peft import get_peft_model_state_dict

    state = {
        k: v.detach() if device is None else v.detach().to(device, copy=True)
        for k, v in get_peft_model_state_dict(peft_model).items()
    }
    return state, adapter_config(peft_model)


def adapter_config(peft_model) -> dict:
    """The adapter's peft config as a dict (target modules sorted), as adapter_state returns it."""
    conf = peft_model.peft_config["default"].to_dict()
    conf["target_modules"] = sorted(conf["target_modules"])
    return conf


def adapter_params(peft_model) -> list[tuple[str, torch.nn.Parameter]] | None:
    """The adapter's trained parameters under peft's saved names (adapter_state's names, sorted), as
    the Parameter objects themselves: found once, then read at each version without walking the
    model's state dict again (get_peft_model_state_dict over the 4B shape's ~900 tensors is most of
    an adapter version's pack). None when a saved tensor is not a trained parameter (peft saving
    something else too, modules_to_save): adapter_state each time then. Call it where every
    parameter is whole (under ZeRO-3: inside the gather)."""
    from peft import get_peft_model_state_dict

    by_ptr = {p.data_ptr(): p for p in peft_model.parameters() if p.requires_grad and p.numel()}
    out = []
    for name, t in sorted(get_peft_model_state_dict(peft_model).items()):
        p = by_ptr.get(t.data_ptr())
        if p is None or tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
            return None
        out.append((name, p))
    return out


def export_merged(base_dir, adapter_dir, out) -> None:
    """The base model with the adapter of `adapter_dir` (weights.lora.write_adapter's) merged into its
    weights, saved to `out` as a plain HF checkpoint (safetensors + config.json)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from parley.weights.lora import as_vllm_adapter

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")  # the base's own dtype
    merged = PeftModel.from_pretrained(model, str(as_vllm_adapter(adapter_dir))).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
