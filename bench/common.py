"""What the bench scripts share: running their async main on uvloop (as every role does), and printing
the header, the table and the optional JSON. Nothing in parley imports bench/."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from pathlib import Path


def run(coro_fn, *args):
    """(result, seconds) of `coro_fn(*args)` on uvloop, or asyncio where uvloop is missing."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    t0 = time.perf_counter()
    result = runner(coro_fn(*args))
    return result, time.perf_counter() - t0


def report(title: str, details: str, seconds: float, table: str, data, json_path: Path | None) -> None:
    """`title: <cores> cores, <python>, <details>, <seconds> s`, the table, and the data as JSON if asked."""
    print(f"{title}: {os.cpu_count()} cores, {platform.python_version()}, {details}, {seconds:.0f} s")
    print(table)
    if json_path:
        json_path.write_text(json.dumps(data, indent=1, default=str))


# Qwen3 shapes for GPU benches built from a config with random weights (no hub on the GPU machine;
# random init runs at the speed of trained weights).
QWEN3_SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
QWEN3_VOCAB, QWEN3_EOS, QWEN3_PAD = 151936, 151645, 151643


def random_qwen3(shape: str, out: str | Path, seed: int = 0) -> Path:
    """A bf16 Qwen3 checkpoint of `shape` with random weights and a word-level tokenizer of one
    token per id ("t0".."t151935"), so vLLM has a real tokenizer; built on the GPU when there is
    one. Kept if `out` already holds one."""
    out = Path(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(QWEN3_VOCAB)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=f"t{QWEN3_EOS}", pad_token=f"t{QWEN3_PAD}").save_pretrained(out)
    cfg = Qwen3Config(vocab_size=QWEN3_VOCAB, max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=1000000.0, bos_token_id=None, eos_token_id=QWEN3_EOS, pad_token_id=QWEN3_PAD,
                      dtype="bfloat16", **QWEN3_SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(eos_token_id=QWEN3_EOS, pad_token_id=QWEN3_PAD)
    model.save_pretrained(out)
    return out
