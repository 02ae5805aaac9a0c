"""A real vLLM engine (the toy model, CPU) whose KV cache is short of its requests preempts some of them,
and PolicyEngine.counts.preemptions says how many; an engine with room preempts none. vLLM's own
stat-logger path end to end (engines.engine.counting_logger)."""

from __future__ import annotations

import asyncio

import pytest

from parley.engines.engine import EngineSettings, PolicyEngine

# extended tier: a whole vLLM engine start; the counter itself is held in `make test` by
# tests/unit/test_engine_preemption_counter.py (vLLM's real stat logger fed its own iteration stats)
pytestmark = [pytest.mark.e2e, pytest.mark.extended, pytest.mark.timeout(300)]

KV_BLOCK = 16 * 1024  # the toy model's KV in fp32: 2 (K, V) x 2 layers x 2 kv heads x 32 x 4 B = 1 KiB a token


async def test_a_short_kv_cache_counts_its_preemptions(tiny_model):
    # 24 blocks of 16 tokens hold 384 tokens; 6 requests of 12 + 160 tokens ask for 1,032
    engine = PolicyEngine(EngineSettings(model=str(tiny_model), max_model_len=256, kv_cache_bytes=24 * KV_BLOCK))
    try:
        outs = await asyncio.gather(
            *(engine.generate(list(range(10 + i, 22 + i)), max_tokens=160, seed=i, stop_token_ids=[]) for i in range(6))
        )
        assert all(o.token_ids for o in outs)
        assert engine.counts.preemptions > 0
    finally:
        engine.shutdown()
