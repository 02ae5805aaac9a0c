"""[*.engine] torch_compile: with enforce_eager = false, false starts vLLM without its torch.compile
(Inductor) pass and with full CUDA graphs instead (issue 56: on a warm H100 SmolLM2's engine spent 7 s of
a 16 s start loading its compiled graphs). The engine arguments are checked through the args double;
tests/e2e/test_engine_compile.py has vLLM itself resolve them."""

from __future__ import annotations

import pytest

from parley.config.run import load_config
from parley.engines import backend
from parley.engines import engine as eng
from parley.engines.config import EngineConfig
from parley.errors import ConfigError
from tests.factories import stub_engine_args


def _fields(cfg: EngineConfig, monkeypatch) -> dict:
    stub_engine_args(monkeypatch)
    monkeypatch.setattr(backend, "cpu_workarounds", lambda max_model_len: {})
    settings = backend.engine_settings(cfg, "m")
    settings.json_compact = False
    return eng._engine_args(settings, cpu_bind=None).fields


def test_graphs_without_compile_ask_vllm_for_mode_none_and_full_graphs(monkeypatch):
    fields = _fields(EngineConfig(enforce_eager=False, torch_compile=False), monkeypatch)
    assert fields["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL"}
    assert fields["enforce_eager"] is False
    # the default leaves vLLM's own compilation (torch.compile and its CUDA graphs) untouched
    assert "compilation_config" not in _fields(EngineConfig(enforce_eager=False), monkeypatch)
    assert "compilation_config" not in _fields(EngineConfig(), monkeypatch)


def test_the_setting_is_read_from_the_run_config_and_refused_where_it_means_nothing():
    cfg = load_config(None, ["actor.engine.enforce_eager=false", "actor.engine.torch_compile=false"])
    assert (cfg.actor.engine.enforce_eager, cfg.actor.engine.torch_compile) == (False, False)
    # the default config's engines are eager (CPU): there is no compile to leave out
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.engine.torch_compile=false"])
    text = str(e.value)
    assert "torch_compile = false with enforce_eager = true" in text and "\n" not in text
