"""[actor.engine] torch_compile = false on a real vLLM (CPU) with the toy model: the engine the config
builds (compilation mode NONE, decode CUDA graphs, which the CPU platform turns off) starts, samples,
and its sampled log-probs equal a transformers fp32 forward over the same ids, the actor/learner
contract. Its own engine, not the session's shared ones (a different compilation setting). Whether
its CUDA graphs keep that contract on a GPU is bench/logprob_gpu.py's (docs/gpu.md, "An engine
without torch.compile: the cause")."""

from __future__ import annotations

import asyncio

import pytest

from tests.reference import reference_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TOL = 1e-4


def test_an_engine_without_torch_compile_samples_the_models_log_probs(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parley.config.run import load_config
    from parley.engines.backend import engine_settings
    from parley.engines.engine import PolicyEngine

    sets = [
        f'actor.engine.model="{tiny_model}"',
        "actor.engine.enforce_eager=false",
        "actor.engine.torch_compile=false",
        "actor.engine.max_model_len=512",
    ]
    cfg = load_config(None, sets).actor.engine
    settings = engine_settings(cfg, str(tiny_model), sampled_logprobs=True)
    assert (settings.enforce_eager, settings.torch_compile) == (False, False)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype="float32").eval()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short note to the team."}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok.encode(rendered, add_special_tokens=False)

    async def sample():
        engine = PolicyEngine(settings)
        try:
            return await asyncio.gather(
                *[engine.generate(prompt, max_tokens=24, temperature=0.7, seed=7 + i) for i in range(3)]
            )
        finally:
            engine.shutdown()

    outs = asyncio.run(sample())
    for out in outs:  # log-probs of the distribution sampled at 0.7, as the actor records them
        assert out.token_ids
        ref = reference_logprobs(hf, prompt, out.token_ids, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < TOL
