"""[actor.engine] kv_cache_dtype: checked at config load, passed to vLLM only when not "auto" (vLLM's default
stands otherwise), kept out of the eval's engine; and the memory plan's KV capacity against the demand of the
conversations in flight (deploy/memory.py), with a warning, not a refusal, when vLLM may preempt. The model
directory holds only a hand-written Qwen3-4B config.json. No GPU, no model, no vLLM engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from typer.testing import CliRunner

from parley.config.run import ConfigError, load_config
from parley.deploy.cli import app
from parley.deploy.memory import engine_terms, kv_demand_notes, kv_token_bytes, model_shape
from parley.engines.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "deploy" / "configs"
H100 = 79.2  # GiB torch.cuda reports for an 80 GB H100


def qwen3_4b(tmp_path: Path) -> Path:
    """Qwen3-4B's config.json keys the plan reads, written out by hand."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "hidden_size": 2560,
                "intermediate_size": 9728,
                "num_hidden_layers": 36,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            }
        )
    )
    return tmp_path


def test_the_setting_is_checked_at_load():
    assert load_config().actor.engine.kv_cache_dtype == "auto"
    cfg = load_config(None, ['actor.engine.kv_cache_dtype="fp8"'])
    assert cfg.actor.engine.kv_cache_dtype == "fp8"
    assert cfg.sim.engine.kv_cache_dtype == cfg.judge.engine.kv_cache_dtype == "auto"  # each section its own
    with pytest.raises(ConfigError) as e:
        load_config(None, ['actor.engine.kv_cache_dtype="fp4"'])
    assert "\n" not in str(e.value)
    assert "actor.engine.kv_cache_dtype = 'fp4': expected one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'" in str(e.value)


def test_vllm_is_given_the_setting_only_when_not_auto(monkeypatch):
    from parley.engines import backend
    from parley.engines import engine as eng
    from tests.factories import stub_engine_args

    stub_engine_args(monkeypatch)
    monkeypatch.setattr(backend, "cpu_workarounds", lambda max_model_len: {})
    for dtype, given in (("auto", None), ("fp8", "fp8"), ("fp8_e5m2", "fp8_e5m2")):
        settings = backend.engine_settings(EngineConfig(kv_cache_dtype=dtype), "m")
        settings.json_compact = False
        assert settings.kv_cache_dtype == dtype
        assert eng._engine_args(settings, cpu_bind=None).fields.get("kv_cache_dtype") == given


def test_the_eval_engine_keeps_the_models_dtype(monkeypatch):
    """The periodic eval scores the weights, not the actor's KV format: it opens [actor.engine] with "auto".
    open_engine is replaced by a recorder."""
    from parley.engines import backend
    from parley.evaluation.commands import FollowingPolicy

    opened = []

    def open_engine_recorder(cfg, version=0, sampled_logprobs=False):
        opened.append(cfg)
        return SimpleNamespace(shutdown=lambda: None), object(), "path"

    monkeypatch.setattr(backend, "open_engine", open_engine_recorder)
    asyncio.run(FollowingPolicy(load_config(None, ['actor.engine.kv_cache_dtype="fp8"'])).open("smol", 3))
    assert [c.kv_cache_dtype for c in opened] == ["auto"]


def test_the_capacity_at_the_4b_shape_and_fp8_halves_a_tokens_bytes(tmp_path):
    shape = model_shape(str(qwen3_4b(tmp_path)))
    bf16 = EngineConfig(model=str(tmp_path), dtype="bfloat16", kv_cache_bytes=17_213_423_616)
    # K and V x 36 layers x 8 kv heads x 128 x 2 B = 147,456 B (144 KiB); 17,213,423,616 / 147,456 = 116,736
    assert kv_token_bytes(shape, bf16) == 147_456
    fp8 = msgspec.structs.replace(bf16, kv_cache_dtype="fp8")
    assert kv_token_bytes(shape, fp8) == 73_728
    kv = [t.what for t in engine_terms(bf16, lambda _: shape) if t.what.startswith("its KV cache")]
    assert "116,736 tokens of 147,456 B" in kv[0], kv
    kv = [t.what for t in engine_terms(fp8, lambda _: shape) if t.what.startswith("its KV cache")]
    assert '233,472 tokens of 73,728 B (kv_cache_dtype "fp8"' in kv[0], kv
    cpu = EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_bytes=147_456 * 4)
    assert kv_token_bytes(shape, cpu) == 294_912  # "auto" is the engine's dtype: 4 B in float32


def dry_run(config: Path, model: Path, *sets: str):
    args = ["up", "--config", str(config), "--dry-run", "--set", f"up.gpu_memory_gib={H100}"]
    for s in (f"policy.model={model}", f"actor.engine.model={model}", *sets):
        args += ["--set", s]
    return CliRunner().invoke(app, args)


def test_the_plan_warns_where_the_conversations_in_flight_outgrow_the_kv_cache(tmp_path):
    model = qwen3_4b(tmp_path)
    # gpu-1-4b.toml: 12,910,067,712 B / 147,456 B = 87,552 tokens, 48 conversations of 1,824, of the 64 in
    # flight (64 x 1,824 = 116,736 tokens, 17,213,423,616 B = 16,416 MiB). Refused on an H100 (its full
    # fine-tuning does not fit), but the plan it prints says so too.
    out = dry_run(CONFIGS / "gpu-1-4b.toml", model)
    warning = (
        "warning: each actor's KV cache holds 87,552 tokens (48 conversations of max_model_len 1824), less than "
        "the 116,736 its actor.concurrency 64 conversations can hold: vLLM may preempt (and recompute) requests; "
        'actor.engine.kv_cache_bytes = 17213423616 would hold them all; actor.engine.kv_cache_dtype = "fp8" would '
        "hold 2x as many tokens in the same bytes"
    )
    assert warning in out.output
    # fp8 in the same bytes holds them all: no warning
    cfg = load_config(CONFIGS / "gpu-1-4b.toml", [f"actor.engine.model={model}", 'actor.engine.kv_cache_dtype="fp8"'])
    assert kv_demand_notes(cfg) == []
    # gpu-1-4b-lora.toml as shipped holds every conversation in flight whole: it fits, and warns of nothing
    out = dry_run(CONFIGS / "gpu-1-4b-lora.toml", model)
    assert out.exit_code == 0, out.output
    assert "116,736 tokens of 147,456 B" in out.stdout and "warning" not in out.output
    # twice the conversations in the same bytes, fp8 already: the warning names the bytes and no fp8
    out = dry_run(CONFIGS / "gpu-1-4b-lora.toml", model, "actor.concurrency=256", 'actor.engine.kv_cache_dtype="fp8"')
    assert "less than the 466,944 its actor.concurrency 256 conversations" in out.output  # 256 x 1,824
    # 466,944 x 73,728 B = 34,426,847,232 B = 32,832 MiB
    assert "actor.engine.kv_cache_bytes = 34426847232 would hold them all" in out.output
    assert 'kv_cache_dtype = "fp8" would' not in out.output


def test_every_eval_engine_keeps_the_models_dtype_the_fleets_and_the_plans_too(tmp_path):
    """evaluation.commands.eval_engine is the one home of the eval's engine: the fleet's actors get it in
    the config they are started with, and the memory plan counts the periodic eval's engine by it."""
    import msgspec

    from parley.config.run import RunConfig
    from parley.deploy.memory import processes
    from parley.evaluation import commands
    from parley.evaluation.runner import EvalSettings

    cfg = load_config(None, ['actor.engine.kv_cache_dtype="fp8"', "actor.engine.prefix_cache_across_versions=true"])
    assert commands.eval_engine(cfg.actor.engine, "v3").kv_cache_dtype == "auto"
    assert commands.eval_engine(cfg.actor.engine).model == cfg.actor.engine.model

    asyncio.run(commands.fleet(None, None, cfg, [], [], EvalSettings(), tmp_path, 0, asyncio.Event(), None, None))
    written = msgspec.toml.decode((tmp_path / "fleet" / "config.toml").read_bytes(), type=RunConfig)
    assert written.actor.engine.kv_cache_dtype == "auto"
    assert written.actor.engine.prefix_cache_across_versions is False

    gpu = load_config(
        None,
        [
            'actor.engine.kv_cache_dtype="fp8"',
            'actor.engine.dtype="bfloat16"',
            "learner.eval_every=5",
            "up.gpu_memory_gib=80",
        ],
    )
    plan = {p.name: [t.what for t in p.terms if "KV cache" in t.what] for p in processes(gpu)}
    assert 'kv_cache_dtype "fp8"' in plan["actor-0"][0]
    assert 'kv_cache_dtype "auto"' in plan["eval (periodic, [actor.engine])"][0]
