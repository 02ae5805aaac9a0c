"""[learner] master_dtype = "bfloat16" (DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states) on
the toy model, CPU and gloo, one process: the optimizer's partition of the weights and Adam's m and v are
bf16 (half of full fine-tuning's per-parameter state, what the 4B shape needs to fit an 80 GB GPU), the
first step's gradient is the fp32 master's, and a setting that cannot run is refused in one line."""

from __future__ import annotations

import pytest
import torch

from parley.config.learner import LearnerConfig
from parley.learner.trainer import Trainer, ds_config
from tests.e2e.ranks_step import step_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_deepspeed_config_keeps_master_weights_gradients_and_adam_state_in_bf16():
    bf16 = ds_config(LearnerConfig(master_dtype="bfloat16", dtype="bfloat16"), torch.bfloat16)["bf16"]
    assert bf16 == {
        "enabled": True,
        "check_grad_overflow": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    assert ds_config(LearnerConfig(dtype="bfloat16"), torch.bfloat16)["bf16"] == {
        "enabled": True,
        "check_grad_overflow": True,
    }


@pytest.mark.parametrize(
    "sets, named",
    [
        ({"dtype": "float32"}, 'dtype = "float32"'),
        ({"zero_stage": 0}, "zero_stage = 0"),
        ({"offload_optimizer": "cpu"}, 'offload_optimizer = "cpu"'),
    ],
)
def test_a_setting_bf16_master_weights_cannot_run_with_is_refused_naming_it(sets, named):
    with pytest.raises(ValueError, match="master_dtype") as e:
        LearnerConfig(master_dtype="bfloat16", **sets)
    assert named in str(e.value) and 'master_dtype = "float32"' in str(e.value)  # the value and a fix


def test_a_learner_that_would_train_in_fp32_refuses_bf16_master_weights_before_loading(tiny_model):
    assert not torch.cuda.is_available()  # dtype "auto" is fp32 here
    with pytest.raises(ValueError, match=r'master_dtype = "bfloat16" but this learner trains in torch.float32'):
        Trainer(LearnerConfig(master_dtype="bfloat16", kl_coef=0.0), tiny_model)


def bf16_config(master: str) -> LearnerConfig:
    """bf16 training, ZeRO-2, several micro-batches a step; the master copy and Adam state in `master`."""
    return LearnerConfig(
        zero_stage=2,
        lr=1e-3,
        kl_coef=0.0,
        micro_batch_tokens=64,
        logit_chunk_tokens=8,
        dtype="bfloat16",
        master_dtype=master,
    )


def steps(model_dir, master: str) -> tuple[list[dict], Trainer, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    trainer = Trainer(bf16_config(master), model_dir)
    before = {k: v.detach().clone() for k, v in trainer.hf_state_dict().items()}
    stats = [trainer.train_step(step_samples()) for _ in range(2)]
    return stats, trainer, before, {k: v.detach().clone() for k, v in trainer.hf_state_dict().items()}


def test_bf16_master_weights_and_adam_state_train_the_steps_the_fp32_master_does(tiny_model):
    ref, ref_trainer, _, _ = steps(tiny_model, "float32")
    try:
        assert ref_trainer.engine.optimizer.single_partition_of_fp32_groups[0].dtype == torch.float32
    finally:
        ref_trainer.close()
    got, trainer, before, after = steps(tiny_model, "bfloat16")
    try:
        opt = trainer.engine.optimizer
        assert [g.dtype for g in opt.single_partition_of_fp32_groups] == [torch.bfloat16]  # the master copy
        states = [s for s in opt.optimizer.state.values() if s]
        assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in states)
    finally:
        trainer.close()
    # the same weights and batch: the first step's gradient is the fp32 master's; then the weights differ
    assert got[0]["skipped"] == 0.0 and got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-3)
    assert got[1]["skipped"] == 0.0 and got[1]["grad_norm"] == pytest.approx(ref[1]["grad_norm"], rel=0.05)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(moved) >= len(before) // 2, f"only {moved} moved"


def test_a_checkpoint_of_bf16_master_weights_resumes_the_same_next_step(tiny_model, tmp_path):
    """--resume loads the bf16 master and Adam state back (DeepSpeed's checkpoint through safe_load): the step
    after the resume moves the weights exactly as the uninterrupted run's second step does."""
    cfg = bf16_config("bfloat16")
    first = Trainer(cfg, tiny_model)
    try:
        first.train_step(step_samples())
        first.save_checkpoint(tmp_path / "ckpt", "step1")
        second = first.train_step(step_samples())
        straight = {k: v.detach().clone() for k, v in first.hf_state_dict().items()}
    finally:
        first.close()
    resumed = Trainer(cfg, tiny_model)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt", "step1")
        again = resumed.train_step(step_samples())
        assert again["grad_norm"] == pytest.approx(second["grad_norm"], rel=1e-6)
        after = resumed.hf_state_dict()
        assert all(torch.equal(after[k], straight[k]) for k in straight)
    finally:
        resumed.close()
