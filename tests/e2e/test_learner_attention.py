"""Attention over packed micro-batches (learner.attention): the installed transformers keeps packed
sequences apart on the SDPA path (restarting position_ids give a block-diagonal mask) and the learner
refuses to start where it would not; the per-sequence path gives the SDPA path's log-probs and
gradients; on CUDA, flash varlen matches per-sequence attention (outputs and gradients). Small models
built from configs, no DeepSpeed, no vLLM."""

from __future__ import annotations

import pytest
import torch

from parley.learner import attention
from parley.learner.logprobs import token_logprobs
from parley.learner.packing import Sample, build_batch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def configs():
    from transformers import LlamaConfig, Qwen3Config

    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=97,
        max_position_embeddings=512,
    )
    return {"qwen3": Qwen3Config(**shape, tie_word_embeddings=True), "llama": LlamaConfig(**shape)}  # Qwen3, SmolLM2


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_position_restarts_give_a_block_diagonal_mask(arch):
    assert attention.packing_leak(configs()[arch], "sdpa") < 1e-5
    attention.check_packing_isolated(configs()[arch])  # does not refuse


def test_the_guard_checks_a_model_whose_pad_id_is_beyond_its_small_copys_vocabulary():
    """bench.common.random_qwen3's pad id is 151643: the guard's small copy (64 ids) must not keep it."""
    config = configs()["qwen3"]
    config.pad_token_id = 90
    attention.check_packing_isolated(config)


def test_learner_refuses_to_pack_where_transformers_would_not_separate(monkeypatch):
    """A transformers whose masks ignore the restarts (as releases before packed-sequence detection
    did) is simulated by making the detection find one sequence: the guard must see the leak."""
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)
    assert attention.packing_leak(configs()["qwen3"], "sdpa") > 1e-2
    with pytest.raises(RuntimeError, match="lets packed sequences attend to each other"):
        attention.check_packing_isolated(configs()["qwen3"])
    # the per-sequence path does not depend on transformers' masks
    assert attention.packing_leak(configs()["qwen3"], attention.VARLEN) < 1e-5


def packed_samples(vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate((40, 1, 25, 60)):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out.append(Sample(f"s{i}", ids, [0] * (n // 4) + [1] * (n - n // 4), [0.0] * n, 1.0))
    return out


def logp_and_grads(model, batch, name):
    attention.use(model, name)
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, batch, chunk=16, grad=True)
    (logp * torch.linspace(-1, 1, logp.numel(), device=logp.device)).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_per_sequence_path_matches_sdpa_on_cpu():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs()["qwen3"], dtype=torch.float32, attn_implementation="sdpa")
    batch = build_batch(packed_samples(97))
    lp_sdpa, g_sdpa = logp_and_grads(model, batch, "sdpa")
    lp_var, g_var = logp_and_grads(model, batch, attention.VARLEN)
    torch.testing.assert_close(lp_var, lp_sdpa, atol=1e-5, rtol=0)
    for n in g_sdpa:
        torch.testing.assert_close(g_var[n], g_sdpa[n], atol=1e-5, rtol=1e-4, msg=n)


def test_cpu_default_is_sdpa():
    assert attention.resolve("auto", torch.device("cpu"))[0] == "sdpa"
    assert attention.resolve("varlen", torch.device("cpu"))[0] == attention.VARLEN


def _has_varlen() -> bool:
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_varlen(), reason="needs CUDA and torch.nn.attention.varlen")
def test_flash_varlen_matches_per_sequence_attention_on_cuda():
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda")
    name, why = attention.resolve("auto", device)
    print("auto attention on CUDA:", why)
    assert name == attention.VARLEN, why  # the learner's default on CUDA
    # the kernel alone: outputs and q/k/v gradients against per-sequence SDPA (bf16)
    fn = attention._kernel["fn"]
    assert attention.check_varlen(fn, device) <= attention.VARLEN_TOLERANCE
    # through a model, fp32 weights run in bf16: log-probs and parameter gradients against SDPA's mask path
    torch.manual_seed(0)
    cfg = configs()["qwen3"]
    cfg.head_dim = 64  # flash wants head_dim a multiple of 8 and >= 32 on every release
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    batch = build_batch(packed_samples(97), device)
    lp_sdpa, g_sdpa = logp_and_grads(model, batch, "sdpa")
    lp_var, g_var = logp_and_grads(model, batch, attention.VARLEN)
    # bf16: both paths round differently (~2^-8 relative); a cross-sequence leak moves log-probs by ~0.1-1
    assert float((lp_var - lp_sdpa).abs().max()) <= 3e-2
    for n in g_sdpa:
        scale = float(g_sdpa[n].float().abs().max()) + 1e-6
        assert float((g_var[n].float() - g_sdpa[n].float()).abs().max()) / scale <= 5e-2, n
