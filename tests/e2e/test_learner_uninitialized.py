"""A learner step reads no memory it never wrote (CPU, toy model, DeepSpeed ZeRO-2): the same steps
on the same batches give bit-identical losses, gradient norms, entropies and weights whether every
torch.empty comes back as it is or filled with NaN (torch's deterministic fill_uninitialized_memory),
with one micro-batch a step and with several (gradients accumulated). bench/learner_poison.py is the
harness; on a GPU it fills PyTorch's caching allocator instead (docs/gpu.md says why: the H200 runs
whose learner kept its cache between steps trained differently)."""

from __future__ import annotations

import math

import pytest

from bench.learner_poison import run_fill, verdict

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.mark.parametrize("dtype,micro_batch_tokens", [("float32", 600), ("bfloat16", 8192)])
def test_a_learner_step_reads_no_memory_it_never_wrote(tiny_model, dtype, micro_batch_tokens):
    runs = [
        run_fill(str(tiny_model), fill, 3, 2, dtype, micro_batch_tokens=micro_batch_tokens)
        for fill in ("0", "0", "nan")
    ]
    many = micro_batch_tokens < 1000
    assert all((s["micro_batches"] > 1) == many and s["skipped"] == 0.0 for r in runs for s in r["steps"])
    v = verdict(runs)
    assert v["reads_unwritten"] is False, v
    # on CPU the step is deterministic: not only within the noise, equal
    assert all(d == 0.0 for row in v["fills"] for d in row["diff"].values()), v


def test_the_nan_fill_catches_a_step_that_reads_unwritten_memory(tiny_model, monkeypatch):
    """The harness can fail: a log-prob computation that adds a value read from torch.empty (times
    zero, which hides garbage but not NaN) is caught by the NaN fill."""
    import torch

    import parley.engines.logprobs as lp

    real = lp._logp_entropy

    def reads_unwritten(lm_head, hidden, targets, inv_temp=None):
        logp, entropy = real(lm_head, hidden, targets, inv_temp)
        return logp + torch.empty(1, dtype=logp.dtype)[0] * 0.0, entropy

    monkeypatch.setattr(lp, "_logp_entropy", reads_unwritten)
    poisoned = run_fill(str(tiny_model), "nan", 2, 2, "float32")
    assert all(s["skipped"] == 1.0 or math.isnan(s["loss"]) for s in poisoned["steps"]), poisoned["steps"]
