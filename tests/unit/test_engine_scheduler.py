"""[*.engine] max_num_seqs / max_num_batched_tokens: an engine made from AsyncEngineArgs gets vLLM's
library fallbacks (128 sequences, 2048 tokens a step), not its tuned H100/H200 defaults, so a role that
keeps more requests in flight than 128 had the rest wait in vLLM's queue while it counted them as
running. The engine now runs as many as the role keeps in flight, and both limits can be set."""

from __future__ import annotations

import pytest

from parley.config.run import load_config
from parley.engines import backend
from parley.engines import engine as eng
from parley.engines.config import EngineConfig
from parley.errors import ConfigError
from tests.factories import stub_engine_args


def _args(cfg: EngineConfig, requests: int, monkeypatch, cpu_extra: dict | None = None) -> dict:
    stub_engine_args(monkeypatch)
    monkeypatch.setattr(backend, "cpu_workarounds", lambda max_model_len: dict(cpu_extra or {}))
    settings = backend.engine_settings(cfg, "m", requests=requests)
    settings.json_compact = False
    return eng._engine_args(settings, cpu_bind=None).fields


def test_the_engine_runs_every_request_the_actor_keeps_in_flight(monkeypatch):
    # 256 conversations in flight: vLLM's fallback would run 128 and queue the rest
    assert _args(EngineConfig(), 256, monkeypatch)["max_num_seqs"] == 256
    # at or under the fallback nothing is given: vLLM's own 128 stands, as before
    assert "max_num_seqs" not in _args(EngineConfig(), 128, monkeypatch)
    assert "max_num_seqs" not in _args(EngineConfig(), 0, monkeypatch)
    # the section's own value wins either way
    assert _args(EngineConfig(max_num_seqs=64), 256, monkeypatch)["max_num_seqs"] == 64


def test_the_step_s_token_budget_is_given_when_set_and_never_below_a_whole_prompt_on_cpu(monkeypatch):
    assert "max_num_batched_tokens" not in _args(EngineConfig(), 8, monkeypatch)
    assert _args(EngineConfig(max_num_batched_tokens=8192), 8, monkeypatch)["max_num_batched_tokens"] == 8192
    # vLLM's CPU build prefills whole prompts (cpu_workarounds): a smaller budget would refuse long ones
    cpu = {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    fields = _args(EngineConfig(max_num_batched_tokens=1024), 8, monkeypatch, cpu)
    assert fields["max_num_batched_tokens"] == 4096 and fields["enable_chunked_prefill"] is False
    assert _args(EngineConfig(max_num_batched_tokens=16384), 8, monkeypatch, cpu)["max_num_batched_tokens"] == 16384
    assert _args(EngineConfig(), 8, monkeypatch, cpu)["max_num_batched_tokens"] == 4096


def test_the_limits_are_checked_at_config_load():
    cfg = load_config(None, ["actor.engine.max_num_seqs=256", "actor.engine.max_num_batched_tokens=8192"])
    assert (cfg.actor.engine.max_num_seqs, cfg.actor.engine.max_num_batched_tokens) == (256, 8192)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.engine.max_num_seqs=-1"])
    assert "max_num_seqs" in str(e.value) and "\n" not in str(e.value)
