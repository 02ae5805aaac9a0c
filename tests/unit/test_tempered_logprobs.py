"""The learner's log-probs at a sample's temperature: log_softmax(logits / T), what vLLM reports as
processed_logprobs for a token drawn at T (engines/engine.py's docstring). Checked against a plain
transformers forward pass on the toy model, packed the way the learner trains, with samples at
different temperatures in one micro-batch; the end-to-end agreement with a real vLLM engine is
tests/e2e/test_logprob_agreement.py."""

from __future__ import annotations

import pytest
import torch

from parley.learner.logprobs import token_logprobs
from parley.learner.packing import Sample, build_batch
from tests.reference import reference_logprobs


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_packed_logprobs_are_taken_at_each_samples_temperature(model):
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 5, 9)]
    gens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 8, 4)]
    temps = [0.7, 1.0, 1.6]
    samples = [
        Sample(f"s{i}", p + x, [0] * len(p) + [1] * len(x), [0.0] * (len(p) + len(x)), 0.0, temperature=t)
        for i, (p, x, t) in enumerate(zip(prompts, gens, temps))
    ]
    ours, entropy = token_logprobs(model, build_batch(samples), chunk=5, grad=False)
    want = torch.tensor(
        [lp for p, x, t in zip(prompts, gens, temps) for lp in reference_logprobs(model, p, x, temperature=t)]
    )
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)
    # the raw distribution is measurably another one: ignoring the temperature cannot pass
    raw = torch.tensor([lp for p, x in zip(prompts, gens) for lp in reference_logprobs(model, p, x)])
    at_07 = slice(0, len(gens[0]))
    assert (raw[at_07] - want[at_07]).abs().max() > 100 * 1e-5
    assert (entropy > 0).all()
