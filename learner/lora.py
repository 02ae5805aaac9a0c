"""The learner's LoRA side ([learner.lora]): peft adapters injected into the policy in place, the
frozen base as the KL reference (adapters disabled, no second copy), and the adapter's tensors
and config for publication (weights.lora). Used by learner.trainer.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from parley.config.learner import LoraSettings

if TYPE_CHECKING:
    import torch


def add_adapters(model, settings: LoraSettings):
    """Inject a fresh LoRA adapter into `model` (an HF causal LM) in place and freeze the rest;
    returns the PeftModel that owns it. `model` keeps its own forward (the packed log-probs read it):
    its targeted Linear layers are now peft's LoRA layers."""
    from peft import LoraConfig, get_peft_model

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
    return get_peft_model(model, conf)


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
