"""[learner] compile (learner.trainer.compile_layers): which modes compile, and that compiled decoder
layers give the eager layers' log-probs and gradients on the packed path (CPU in fp32 where a C
compiler is installed for inductor; on CUDA in bf16 with flash varlen attention, gpu-marked)."""

from __future__ import annotations

import shutil

import pytest
import torch

from parley.learner import attention
from parley.learner.logprobs import token_logprobs
from parley.learner.packing import build_batch
from parley.learner.trainer import compile_layers
from tests.e2e.test_learner_attention import configs, logp_and_grads, packed_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _model(dtype=torch.float32, device="cpu", head_dim=16):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = configs()["qwen3"]
    cfg.head_dim = head_dim
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)


def _compiled(model) -> list[bool]:
    return [layer._compiled_call_impl is not None for layer in model.base_model.layers]


@pytest.mark.parametrize(
    "mode,device,zero,expect",
    [
        ("auto", "cpu", 2, False),
        ("off", "cuda", 2, False),
        ("auto", "cuda", 3, False),
        ("auto", "cuda", 2, True),
        ("layers", "cpu", 3, True),
    ],
)
def test_which_modes_compile(mode, device, zero, expect):
    model = _model()  # on the CPU whatever `device` says: compiling is lazy, nothing runs here
    assert compile_layers(model, mode, torch.device(device), zero) is expect
    assert _compiled(model) == [expect] * len(model.base_model.layers)


def test_a_model_without_a_layer_list_is_refused():
    class Flat(torch.nn.Module):
        base_model = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="no `layers` list"):
        compile_layers(Flat(), "layers", torch.device("cpu"), 2)


def test_bad_compile_value_is_refused_at_config():
    from parley.config.run import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"learner.compile = 'fast': expected one of 'auto', 'layers', 'off'"):
        load_config(None, ["learner.compile=fast"])


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor on CPU needs a C compiler"
)
def test_compiled_layers_match_eager_on_cpu():
    eager = _model()
    compiled = _model()
    assert compile_layers(compiled, "layers", torch.device("cpu"), 2)
    batch = build_batch(packed_samples(97))
    lp_e, g_e = logp_and_grads(eager, batch, attention.VARLEN)
    lp_c, g_c = logp_and_grads(compiled, batch, attention.VARLEN)
    torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
    for n in g_e:
        torch.testing.assert_close(g_c[n], g_e[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.extended  # about 50 s of inductor: make test-extended
@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor on CPU needs a C compiler"
)
def test_compiled_lora_layers_match_eager_on_cpu():
    """[learner.lora] with compile = "layers" (allowed without a KL reference): the adapters' LoRA
    layers inside compiled decoder layers give the eager log-probs and adapter gradients."""
    from parley.config.learner import LoraSettings
    from parley.learner.lora import add_adapters

    def adapted():
        model = _model()
        add_adapters(model, LoraSettings(enabled=True, rank=4, alpha=8.0))
        torch.manual_seed(1)
        with torch.no_grad():  # lora_B starts at 0 (a no-op adapter): give it weights so it counts
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        return model

    def logp_and_adapter_grads(model, batch):
        attention.use(model, attention.VARLEN)
        model.zero_grad(set_to_none=True)
        logp, _ = token_logprobs(model, batch, chunk=16, grad=True)
        (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    eager, compiled = adapted(), adapted()
    assert compile_layers(compiled, "layers", torch.device("cpu"), 2)
    batch = build_batch(packed_samples(97))
    lp_e, g_e = logp_and_adapter_grads(eager, batch)
    lp_c, g_c = logp_and_adapter_grads(compiled, batch)
    assert g_e and all("lora_" in n for n in g_e)
    torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=0)
    for n in g_e:
        torch.testing.assert_close(g_c[n], g_e[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_layers_match_eager_on_cuda():
    device = torch.device("cuda")
    name, why = attention.resolve("auto", device)
    eager = _model(torch.bfloat16, device, head_dim=64)
    compiled = _model(torch.bfloat16, device, head_dim=64)
    assert compile_layers(compiled, "auto", device, 2)
    batch = build_batch(packed_samples(97), device)
    lp_e, g_e = logp_and_grads(eager, batch, name)
    lp_c, g_c = logp_and_grads(compiled, batch, name)
    d_lp = float((lp_c - lp_e).abs().max())
    d_g = max(
        float((g_c[n].float() - g_e[n].float()).abs().max()) / (float(g_e[n].float().abs().max()) + 1e-6) for n in g_e
    )
    print(f"compiled vs eager ({why}), bf16: max |dlogp| {d_lp:.3g}, max relative grad diff {d_g:.3g}")
    # bf16: fused kernels round differently (~2^-8 relative); a wrong graph moves log-probs by ~0.1-1
    assert d_lp <= 3e-2
    assert d_g <= 5e-2
