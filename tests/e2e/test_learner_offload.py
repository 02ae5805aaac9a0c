"""[learner] offload_optimizer = "cpu" (DeepSpeed ZeRO-Offload with torch's AdamW) on the toy model, CPU and
gloo, one process: DeepSpeed runs in offload mode with torch's AdamW (no DeepSpeedCPUAdam to compile), and
two GRPO steps move the weights as the same steps without offload do, under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import pytest
import torch

from parley.config.learner import LearnerConfig
from parley.learner.trainer import Trainer, ds_config
from tests.e2e.ranks_step import step_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_deepspeed_config_offloads_to_pinned_host_memory_with_torch_adamw():
    conf = ds_config(LearnerConfig(zero_stage=2, offload_optimizer="cpu"), torch.bfloat16)
    assert conf["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert conf["optimizer"]["params"]["torch_adam"] and conf["optimizer"]["params"]["fused"]
    assert "offload_optimizer" not in ds_config(LearnerConfig(zero_stage=2), torch.bfloat16)["zero_optimization"]


def trained(model_dir, stage: int, offload: str) -> tuple[dict[str, torch.Tensor], list[dict], Trainer]:
    cfg = LearnerConfig(
        zero_stage=stage,
        lr=1e-3,
        kl_coef=0.0,
        micro_batch_tokens=64,  # several micro-batches: the offloaded gradients accumulate on the host
        logit_chunk_tokens=8,
        dtype="float32",
        offload_optimizer=offload,
    )
    trainer = Trainer(cfg, model_dir)
    try:
        stats = [trainer.train_step(step_samples()) for _ in range(2)]
        return {k: v.detach().clone() for k, v in trainer.hf_state_dict().items()}, stats, trainer
    finally:
        trainer.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_steps_train_as_the_steps_on_the_device_do(tiny_model, stage):
    plain, plain_stats, _ = trained(tiny_model, stage, "none")
    off, off_stats, trainer = trained(tiny_model, stage, "cpu")
    assert trainer.engine.zero_cpu_offload()
    assert type(trainer.engine.basic_optimizer) is torch.optim.AdamW  # not DeepSpeedCPUAdam: nothing compiled
    assert [s["micro_batches"] for s in off_stats] == [s["micro_batches"] for s in plain_stats] and all(
        s["micro_batches"] > 1 for s in off_stats
    )
    for a, b in zip(plain_stats, off_stats, strict=True):
        assert b["skipped"] == 0.0 and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert set(off) == set(plain)
    base = Trainer(LearnerConfig(zero_stage=stage, kl_coef=0.0, dtype="float32"), tiny_model)
    try:
        first = base.hf_state_dict()
    finally:
        base.close()
    for k in plain:
        assert not torch.equal(off[k], first[k]), f"{k} did not move"
        torch.testing.assert_close(off[k], plain[k], rtol=1e-4, atol=1e-5)
