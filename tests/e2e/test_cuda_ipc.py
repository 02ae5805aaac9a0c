"""cuda_ipc on a real GPU: this test process plays the learner (the toy model's weights on the GPU,
packed by weights.cuda_ipc.IpcPublisher and exported as a CUDA IPC handle), a real vLLM engine
in its own process is the actor. A version loaded by IPC must serve exactly what the same
weights loaded from files serve; a copy whose checksums do not match is refused and changes
nothing. Runs only where torch sees a CUDA device (gpu marker); docs/gpu.md has the command."""

from __future__ import annotations

import asyncio
import time

import pytest

from parley.engines.engine import EngineSettings, PolicyEngine
from parley.engines.models import build_tiny
from parley.protocol import codec
from parley.weights.common import WeightVerifyError
from parley.weights.registry import gpu_announcement

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(600)]


def greedy(loop, engine, prompt):
    out = loop.run_until_complete(engine.generate(prompt, max_tokens=16, temperature=0.0))
    return out.token_ids, out.logprobs


def test_ipc_version_serves_what_the_file_version_serves_and_a_bad_copy_is_refused(tmp_path):
    import msgspec
    import torch
    from transformers import AutoModelForCausalLM

    from parley.weights.cuda_ipc import IpcPublisher
    from parley.weights.snapshot import hf_tensors, hf_weights, write_weights

    base = build_tiny(tmp_path / "tiny")
    # fp32 as the other toy-model tests (the toy's head_dim 32 has no FlashAttention-3 kernel); the
    # transport is dtype-blind, and the 4B bf16 path is bench/weight_path.py's
    learner = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to("cuda").eval()
    with torch.no_grad():  # "a training step": other weights than the engine starts with
        g = torch.Generator(device="cuda").manual_seed(1)
        for p in learner.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.05)
    stepped = write_weights(hf_weights(learner), learner.config, tmp_path / "stepped")

    loop = asyncio.new_event_loop()
    engine = PolicyEngine(
        EngineSettings(
            model=str(base),
            dtype="float32",
            max_model_len=1024,
            kv_cache_bytes=256 << 20,
            json_compact=False,
            extra={"enable_prefix_caching": False},
        )
    )
    try:
        prompt = list(range(5, 40))
        before = greedy(loop, engine, prompt)

        pub = IpcPublisher(hold_s=30.0)
        ipc = pub.pack(hf_tensors(learner), 1)
        wv = gpu_announcement("gpu-test", 1, 1, ipc)

        # a wrong checksum: refused before any weight changed
        bad_tensors = list(ipc.tensors)
        bad_tensors[3] = msgspec.structs.replace(bad_tensors[3], checksum=[0, 0, 0])
        bad = msgspec.structs.replace(wv, ipc=msgspec.structs.replace(ipc, tensors=bad_tensors))
        with pytest.raises(WeightVerifyError, match=f"first: {bad_tensors[3].name}"):
            loop.run_until_complete(engine.load_gpu(codec.encode(bad), hold_s=30.0, version=1))
        assert engine.version == 0 and greedy(loop, engine, prompt) == before

        loop.run_until_complete(engine.load_gpu(codec.encode(wv), hold_s=30.0, version=1))
        assert engine.version == 1
        by_ipc = greedy(loop, engine, prompt)
        assert by_ipc != before
        # loaded straight from the learner's buffer (filled just now, 30 s hold): nothing served
        # points into it, so the learner refilling it changes nothing the engine serves
        saved = pub.buffers[0].data.clone()
        pub.buffers[0].data.zero_()
        torch.cuda.synchronize()
        assert greedy(loop, engine, prompt) == by_ipc
        pub.buffers[0].data.copy_(saved)
        # a late reader (under half the hold left): the staged copy, checked, loads the same weights
        late = msgspec.structs.replace(wv, ipc=msgspec.structs.replace(ipc, filled_at=time.time() - 29.0))
        loop.run_until_complete(engine.reload_weights(base, version=0))
        loop.run_until_complete(engine.load_gpu(codec.encode(late), hold_s=30.0, version=1))
        assert greedy(loop, engine, prompt) == by_ipc

        loop.run_until_complete(engine.reload_weights(base, version=0))
        assert greedy(loop, engine, prompt) == before
        loop.run_until_complete(engine.reload_weights(stepped, version=1))
        assert greedy(loop, engine, prompt) == by_ipc  # same bf16 weights, same tokens and log-probs
    finally:
        engine.shutdown()
        loop.close()


@pytest.mark.parametrize("merged", [False, True], ids=["full", "lora-merged"])
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_trainer_packs_what_it_would_save(tiny_model, zero_stage, merged):
    """Trainer.pack_weights (ZeRO-3: gathered first) fills rank 0's shared buffer with exactly the
    tensors save_weights writes, and the announced checksums are those of the buffer. With
    [learner.lora] serve = "merged" (one step trained, so the adapter is not zero) those are the
    base checkpoint's tensors with the adapter merged in, merged inside the buffer (learner.lora.merge_into)."""
    import torch

    from parley.config.learner import LearnerConfig, LoraSettings
    from parley.learner.trainer import Trainer
    from parley.weights import cuda_ipc
    from parley.weights.config import CudaIpcWeights
    from tests.e2e.ranks_step import step_samples

    lora = LoraSettings(enabled=merged, rank=8, serve="merged")
    cfg = LearnerConfig(zero_stage=zero_stage, kl_coef=0.0, lr=1e-2, lora=lora)
    trainer = Trainer(cfg, tiny_model, weights=CudaIpcWeights())
    try:
        if merged:
            trainer.train_step(step_samples())
        expected = trainer.hf_state_dict()
        if merged:  # the base checkpoint's names, and the adapted projections moved off the base
            from safetensors.torch import load_file

            base = load_file(str(tiny_model / "model.safetensors"))
            assert sorted(expected) == sorted(base)
            moved = [n for n in base if not torch.equal(expected[n], base[n].to(expected[n].dtype))]
            assert moved and all(n.endswith("_proj.weight") for n in moved)
        ipc = trainer.pack_weights(1)
        assert [t.name for t in ipc.tensors] == list(expected) and ipc.nbytes == trainer.sender.total
        (buf,) = [b.data for b in trainer.sender.buffers if b.version == 1]
        for t in ipc.tensors:
            assert torch.equal(cuda_ipc.view(buf, t).cpu(), expected[t.name])
        assert cuda_ipc.mismatch(ipc.tensors, cuda_ipc.checksums(buf, ipc.tensors)) is None
        assert ipc.device_uuid == cuda_ipc.device_uuid(torch.cuda.current_device())
    finally:
        trainer.close()
