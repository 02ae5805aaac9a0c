"""A real vLLM engine (the toy model, CPU) started with [actor.engine] kv_cache_dtype = "fp8" generates, with
its behaviour log-probs: the setting reaches vLLM (engines.engine._engine_args) and vLLM's CPU attention
backend serves it (CPUAttentionBackend lists fp8, fp8_e4m3 and fp8_e5m2; its kernels need AVX-512 or AMX,
so a CPU without them refuses it, and the test is skipped there naming what refused it)."""

from __future__ import annotations

import asyncio
import math

import pytest

from parley.engines.engine import EngineSettings, PolicyEngine

# extended tier: a whole vLLM engine start; the setting's path to vLLM's arguments is held in `make test`
# by tests/unit/test_kv_cache_dtype.py
pytestmark = [pytest.mark.e2e, pytest.mark.extended, pytest.mark.timeout(300)]


def cpu_refuses_fp8_kv() -> str:
    """Why vLLM's CPU attention would refuse an fp8 KV cache here ("" when it would not)."""
    import torch

    if torch.cuda.is_available():
        return ""
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported():
        return ""
    return "vLLM's CPU attention (v1/attention/backends/cpu_attn.py) needs AVX-512 or AMX for an fp8 KV cache"


async def test_an_fp8_kv_cache_engine_generates(tiny_model):
    why = cpu_refuses_fp8_kv()
    if why:
        pytest.skip(why)
    engine = PolicyEngine(
        EngineSettings(model=str(tiny_model), max_model_len=256, kv_cache_bytes=16 << 20, kv_cache_dtype="fp8")
    )
    try:
        outs = await asyncio.gather(
            *(engine.generate(list(range(10 + i, 30 + i)), max_tokens=24, seed=i, stop_token_ids=[]) for i in range(4))
        )
        assert all(len(o.token_ids) == 24 == len(o.logprobs) for o in outs)
        assert all(math.isfinite(lp) and lp <= 0 for o in outs for lp in o.logprobs)
    finally:
        engine.shutdown()
