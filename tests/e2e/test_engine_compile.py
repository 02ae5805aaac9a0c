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


@pytest.mark.gpu
def test_on_a_gpu_graphs_without_compile_serve_what_an_eager_engine_serves_also_after_a_reload(tmp_path):
    """[*.engine] torch_compile = false on CUDA (bench/gpu_run.sh part S runs it before a lease's
    TORCH_COMPILE=0 seeds): the engine starts with full CUDA graphs and no torch.compile, gives the eager
    engine's greedy tokens, and still does after weights are reloaded in place (a graph replays the
    weights' addresses it captured: a reload that moved them would serve the old weights)."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from parley.engines.engine import EngineSettings, PolicyEngine
    from parley.engines.models import build_tiny
    from parley.weights.snapshot import hf_weights, write_weights

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base = build_tiny(tmp_path / "tiny")
    stepped_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in stepped_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    stepped = write_weights(hf_weights(stepped_model), stepped_model.config, tmp_path / "stepped")
    prompt = list(range(5, 75))

    def answers(**settings) -> tuple[list[int], list[int]]:
        loop = asyncio.new_event_loop()
        engine = PolicyEngine(
            EngineSettings(
                model=str(base), dtype="float32", max_model_len=1024, kv_cache_bytes=512 << 20, json_compact=False,
                **settings,
            )
        )  # fmt: skip
        try:
            first = loop.run_until_complete(
                asyncio.wait_for(engine.generate(prompt, max_tokens=24, temperature=0.0), 300)
            )
            loop.run_until_complete(asyncio.wait_for(engine.reload_weights(stepped, version=1), 120))
            after = loop.run_until_complete(
                asyncio.wait_for(engine.generate(prompt, max_tokens=24, temperature=0.0), 120)
            )
            return first.token_ids, after.token_ids
        finally:
            engine.shutdown()
            loop.close()

    eager = answers(enforce_eager=True)
    graphs = answers(enforce_eager=False, torch_compile=False)
    assert graphs == eager
    assert eager[0] != eager[1]  # the reload changed what is served
