"""[*.engine] torch_compile = false as vLLM itself reads it (the CPU build here): the engine arguments
parley builds resolve to vLLM's compilation mode NONE, where the default resolves to a compiling mode.
On a GPU the same arguments also ask for full CUDA graphs (tests/unit/test_engine_torch_compile.py)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_vllm_resolves_graphs_without_compile_to_no_compilation(tmp_path):
    from vllm.config.compilation import CompilationMode

    from parley.engines.backend import engine_settings
    from parley.engines.config import EngineConfig
    from parley.engines.engine import _engine_args
    from parley.engines.models import ensure_model

    model = ensure_model("tiny")

    def mode(**engine) -> CompilationMode:
        settings = engine_settings(EngineConfig(model="tiny", enforce_eager=False, **engine), model)
        return _engine_args(settings, cpu_bind="nobind").create_engine_config().compilation_config.mode

    assert mode(torch_compile=False) == CompilationMode.NONE
    assert mode() != CompilationMode.NONE
