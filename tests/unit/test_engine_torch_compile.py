"""[*.engine] torch_compile: false gives vLLM compilation mode NONE with full CUDA graphs of decode steps
only (never of mixed prefill and decode steps, which put a prefill over cached context up to 15 nats off
the learner on an H100), is refused at load beside enforce_eager = true, and reaches the eval's engine
as the actor's. vLLM's AsyncEngineArgs is replaced by a recorder (tests.factories.stub_engine_args); no
engine starts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from parley.config.run import ConfigError, load_config
from parley.engines.config import EngineConfig


def _args(monkeypatch, cfg: EngineConfig) -> dict:
    from parley.engines import backend
    from parley.engines import engine as eng
    from tests.factories import stub_engine_args

    stub_engine_args(monkeypatch)
    monkeypatch.setattr(backend, "cpu_workarounds", lambda max_model_len: {})
    settings = backend.engine_settings(cfg, "m")
    settings.json_compact = False
    return eng._engine_args(settings, cpu_bind=None).fields


def test_no_compile_is_decode_graphs_only(monkeypatch):
    fields = _args(monkeypatch, EngineConfig(enforce_eager=False, torch_compile=False))
    assert fields["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert fields["enforce_eager"] is False


def test_the_default_leaves_vllms_compilation(monkeypatch):
    assert EngineConfig().torch_compile is True
    assert "compilation_config" not in _args(monkeypatch, EngineConfig(enforce_eager=False))
    assert "compilation_config" not in _args(monkeypatch, EngineConfig(enforce_eager=True))


def test_each_engine_gets_its_own_copy(monkeypatch):
    """vLLM may fill in the compilation config it is given: one engine's must not reach the next."""
    first = _args(monkeypatch, EngineConfig(enforce_eager=False, torch_compile=False))
    first["compilation_config"]["cudagraph_mode"] = "FULL"
    second = _args(monkeypatch, EngineConfig(enforce_eager=False, torch_compile=False))
    assert second["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"


def test_refused_with_an_eager_engine_at_load():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.engine.torch_compile=false"])  # the embedded default is eager (CPU)
    assert "\n" not in str(e.value)
    assert "torch_compile = false with enforce_eager = true" in str(e.value)
    assert "set enforce_eager = false" in str(e.value)
    cfg = load_config(None, ["actor.engine.torch_compile=false", "actor.engine.enforce_eager=false"])
    assert cfg.actor.engine.torch_compile is False


def test_the_eval_engine_follows_the_actors(monkeypatch):
    """The periodic eval opens [actor.engine] (its KV format aside): an uncompiled actor engine gives an
    uncompiled eval engine, which starts sooner beside it. open_engine is replaced by a recorder."""
    from parley.engines import backend
    from parley.evaluation.commands import FollowingPolicy

    opened = []

    def open_engine_recorder(cfg, version=0, sampled_logprobs=False):
        opened.append(cfg)
        return SimpleNamespace(shutdown=lambda: None), object(), "path"

    monkeypatch.setattr(backend, "open_engine", open_engine_recorder)
    sets = ["actor.engine.torch_compile=false", "actor.engine.enforce_eager=false"]
    asyncio.run(FollowingPolicy(load_config(None, sets)).open("smol", 3))
    assert [(c.torch_compile, c.enforce_eager) for c in opened] == [(False, False)]
