"""What the bench scripts share: running their async main on uvloop (as every role does), and printing
the header, the table and the optional JSON. Nothing in parley imports bench/."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from pathlib import Path

from parley.engines.models import MODEL_SHAPES


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
# random init runs at the speed of trained weights): the published ones are engines.models' (one home
# for a model's shape); "mini" is for tests: seconds to build on a CPU.
_LAYOUT = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
QWEN3_SHAPES = {
    "mini": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    **{
        size: {k: MODEL_SHAPES[f"Qwen/Qwen3-{hub}"][k] for k in _LAYOUT}
        for size, hub in (("0.6b", "0.6B"), ("4b", "4B"))
    },
}
QWEN3_VOCAB = 151936
# The word-level tokenizer's vocabulary: "t<id>" for every id but these, which keep Qwen3's own ids for
# its chat tokens (so eos and pad are Qwen3's) and take three of its unused ones for the role names.
QWEN3_PAD, QWEN3_IM_START, QWEN3_EOS = 151643, 151644, 151645  # <|endoftext|>, <|im_start|>, <|im_end|>
QWEN3_NAMED = {
    QWEN3_PAD: "<|endoftext|>",
    QWEN3_IM_START: "<|im_start|>",
    QWEN3_EOS: "<|im_end|>",
    151646: "system",
    151647: "user",
    151648: "assistant",
}
# ChatML with one space between tokens instead of newlines: the word-level tokenizer splits on
# whitespace and decodes by joining tokens with one space, so a rendered conversation decodes back to
# exactly its text, and the ids of a conversation appended turn by turn (rollout.chat.ChatTokens) are
# those of the whole conversation rendered at once. The assistant's turn ends with <|im_end|> (eos).
WORD_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|> ' + message['role'] + ' ' + message['content'] + ' <|im_end|>' }}"
    "{%- if not loop.last or add_generation_prompt %}{{- ' ' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|> assistant' }}{%- endif %}"
)


def word_tokenizer():
    """The word-level tokenizer of random_qwen3: one token per id, "t0".."t151935" but QWEN3_NAMED,
    <|im_start|> / <|im_end|> / <|endoftext|> special, eos <|im_end|>, the chat template above."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {QWEN3_NAMED.get(i, f"t{i}"): i for i in range(QWEN3_VOCAB)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="t0",
        eos_token=QWEN3_NAMED[QWEN3_EOS],
        pad_token=QWEN3_NAMED[QWEN3_PAD],
        additional_special_tokens=[QWEN3_NAMED[QWEN3_IM_START]],
        chat_template=WORD_CHAT_TEMPLATE,
    )


def random_qwen3(shape: str, out: str | Path, seed: int = 0) -> Path:
    """A bf16 Qwen3 checkpoint of `shape` with random weights and word_tokenizer(), so vLLM has a real
    tokenizer and `parley up` a chat template; built on the GPU when there is one. Weights already in
    `out` are kept; a tokenizer without the chat template (an older build) is written again."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "chat_template.jinja").is_file():
        word_tokenizer().save_pretrained(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        bos_token_id=None,
        eos_token_id=QWEN3_EOS,
        pad_token_id=QWEN3_PAD,
        dtype="bfloat16",
        **QWEN3_SHAPES[shape],
    )
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(eos_token_id=QWEN3_EOS, pad_token_id=QWEN3_PAD)
    model.save_pretrained(out)
    return out
