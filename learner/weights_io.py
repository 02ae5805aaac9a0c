"""The trained model's weights under their checkpoint (HF) names, as actors and vLLM load them:
gathered to CPU without tied duplicates, written as one model.safetensors + config.json."""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor


def hf_weights(model) -> dict[str, Tensor]:
    """A transformers model's full state dict under its checkpoint names, copied to CPU in its
    dtype, with tied duplicates (lm_head sharing the embedding) left out as save_pretrained does."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            continue  # a tied weight already written under its first name
        seen.add(key)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def write_weights(state: dict[str, Tensor], config, out_dir: str | Path) -> Path:
    """model.safetensors (one file, HF names) + config.json into out_dir, written beside and renamed."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    config.to_json_file(str(out / "config.json"))
    return out
