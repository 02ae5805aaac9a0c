"""deploy/configs/gpu-1-4b.toml, the one-GPU throughput run on Qwen3-4B-shaped random weights: its dry run
exits 0 on a CPU machine and fits the H200 (the model directory a stand-in holding only the 4B
config.json, which is all the memory plan reads), and its numbers follow from the shape and the
environment's lengths as its comments say. No GPU, no model is built."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from bench.common import QWEN3_SHAPES, QWEN3_VOCAB
from parley.config.run import load_config
from parley.deploy.cli import app

ROOT = Path(__file__).resolve().parents[2]
GPU1_4B = ROOT / "deploy" / "configs" / "gpu-1-4b.toml"
GIB = 1024**3


def stand_in(tmp_path: Path) -> Path:
    """A directory with random_qwen3('4b')'s config.json keys the plan reads, and nothing else."""
    (tmp_path / "config.json").write_text(
        json.dumps(dict(model_type="qwen3", vocab_size=QWEN3_VOCAB, tie_word_embeddings=True, **QWEN3_SHAPES["4b"]))
    )
    return tmp_path


def test_the_dry_run_exits_0_and_fits_the_h200(tmp_path):
    model = stand_in(tmp_path)
    out = CliRunner().invoke(
        app,
        [
            "up",
            "--config",
            str(GPU1_4B),
            "--dry-run",
            "--set",
            "up.gpu_memory_gib=140.4",
            "--set",
            f"policy.model={model}",
            "--set",
            f"actor.engine.model={model}",
        ],
    )
    assert out.exit_code == 0, out.output
    dumped = tomllib.loads(out.stdout)  # the plan comes as comments
    assert dumped["env"]["name"] == "random_words" and dumped["weights"]["kind"] == "cuda_ipc"
    # actor 7.49 weights + 12.02 KV + 1 + 1; learner 59.94 states + 7.49 (one buffer) + 0.93 + 22.48 + 1
    assert "113.36 GiB, of 133.38 usable (95% of 140.4): 20.02 GiB to spare" in out.stdout
    rows = [m.group(1) for m in re.finditer(r"^#   (\S+)", out.stdout, re.MULTILINE)]  # processes, not their terms
    # a programmatic user: no sim/judge engine; no periodic eval; and the KV cache's warning (64 in flight)
    assert rows == ["actor-0", "learner", "all", "warning:"]
    assert "warning: each actor's KV cache holds 87,552 tokens (48 conversations" in out.stdout


def test_the_numbers_follow_from_the_shape_and_the_lengths():
    cfg = load_config(GPU1_4B)
    assert cfg.policy.model == cfg.actor.engine.model == "/tmp/m4b"
    opts, shape = cfg.env.options, QWEN3_SHAPES["4b"]
    # every conversation: turns x (<|im_start|> user, words, <|im_end|>) + turns x (<|im_start|> assistant,
    # max_tokens, <|im_end|>), each word one token of random_qwen3's tokenizer
    conversation = opts["turns"] * (opts["user_words"] + 3) + opts["turns"] * (cfg.rollout.max_tokens + 3)
    assert conversation == 1816 <= cfg.actor.engine.max_model_len
    assert cfg.rollout.max_new_turns == 2 * opts["turns"] - 1 and (cfg.rollout.n, cfg.rollout.max_tokens) == (8, 384)
    # the actor takes everything admission lets out: (max_staleness + 1) x groups_per_step groups of n
    lc = cfg.learner
    assert cfg.up.actors * cfg.actor.concurrency == (lc.max_staleness + 1) * lc.groups_per_step * cfg.rollout.n == 64
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
    assert kv_per_token == 144 * 1024
    # 48 whole conversations: the 64 in flight are at all lengths (vLLM preempts should they not fit)
    assert cfg.actor.engine.kv_cache_bytes == 48 * math.ceil(conversation / 16) * 16 * kv_per_token
    assert cfg.actor.engine.gpu_memory_utilization == 0 and not cfg.actor.engine.enforce_eager
    assert (lc.zero_stage, lc.compile, lc.attention, lc.eval_every, lc.steps) == (2, "layers", "varlen", 0, 20)
    # one DeepSpeed checkpoint (52.5 GiB at this shape), at the last step
    assert lc.checkpoint_every == lc.steps and lc.keep_checkpoints == 1
