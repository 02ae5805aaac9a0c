"""GRPO on DeepSpeed (CPU, gloo, one process) with the toy model: one step moves every trainable
parameter and writes weights transformers loads back identically; ZeRO-3 does the same; and a
synthetic reward rises when the learner samples from itself and trains on what it sampled."""

from __future__ import annotations

import pytest
import torch

from parley.config.learner import LearnerConfig
from parley.learner.grpo import group_advantages
from parley.learner.packing import Sample
from parley.learner.steplog import PHASES, behaviour_gap
from parley.learner.trainer import Trainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPT, NEW = 6, 16  # prompt and sampled tokens per sequence


def sample(model, prompts: list[list[int]], n: int, gen: torch.Generator):
    """n samples of NEW tokens per prompt from the model itself (temperature 1, no cache: the toy
    model is small), with the raw log-prob of each sampled token as the behaviour log-prob."""
    ids = torch.tensor([p for p in prompts for _ in range(n)])
    lps = []
    with torch.no_grad():
        for _ in range(NEW):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            lps.append(logp.gather(1, nxt)[:, 0])
            ids = torch.cat([ids, nxt], dim=1)
    return ids, torch.stack(lps, dim=1)


def samples_for(ids, lps, rewards) -> list[Sample]:
    adv = group_advantages(rewards).reshape(-1)
    return [
        Sample(f"s{i}", ids[i].tolist(), [0] * PROMPT + [1] * NEW, [0.0] * PROMPT + lps[i].tolist(), float(adv[i]))
        for i in range(ids.shape[0])
    ]


def whole_batch_grad_norm(model_dir, samples: list[Sample]) -> float:
    """The gradient norm of the step's loss computed in one plain-torch pass over all samples:
    what DeepSpeed's accumulation over micro-batches must reproduce."""
    from transformers import AutoModelForCausalLM

    from parley.learner.grpo import batch_loss
    from parley.learner.logprobs import token_logprobs
    from parley.learner.packing import build_batch

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    b = build_batch(samples)
    logp, _ = token_logprobs(model, b, grad=True)
    loss, _ = batch_loss(logp, b, LearnerConfig(kl_coef=0.0))
    loss.backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("stage", [2, 0])
def test_one_step_changes_every_parameter_and_weights_round_trip(tiny_model, tmp_path, stage):
    """ZeRO-0 in fp32 included: DeepSpeed keeps no gradient norm there, the learner measures its own."""
    from transformers import AutoModelForCausalLM

    trainer = Trainer(LearnerConfig(zero_stage=stage, lr=1e-3, kl_coef=0.01, micro_batch_tokens=64), tiny_model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (PROMPT,), generator=gen).tolist() for _ in range(2)]
    ids, lps = sample(trainer.module, prompts, 4, gen)
    before = params(trainer)
    batch = samples_for(ids, lps, torch.rand(2, 4, generator=gen))
    stats = trainer.train_step(batch)
    assert stats["micro_batches"] == 4  # 8 x 22 tokens at a 64-token budget: two per micro-batch
    assert stats["grad_norm"] == pytest.approx(whole_batch_grad_norm(tiny_model, batch), rel=1e-4)
    assert stats["logp_mismatch"] < 1e-4  # on-policy: the learner sees what the sampler saw
    assert behaviour_gap(stats, LearnerConfig().behaviour_gap_alarm) is None
    # where train_s went: every phase took time, and together they are the step less its sharding and packing
    phases = [stats[k] for k in PHASES]
    assert all(v > 0 for v in phases[:4]) and stats["release_s"] >= 0, dict(zip(PHASES, phases))
    assert 0.8 * stats["train_s"] <= sum(phases) <= stats["train_s"]
    after = params(trainer)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters not updated: {unchanged}"

    out = trainer.save_weights(tmp_path / "v1")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trainer.module(input_ids=ids).logits)


def test_behaviour_log_probs_of_another_model_are_measured_and_flagged(tiny_model):
    """What an actor engine that computes the model wrongly records (here: every token's log-prob 3 nats
    off) is the step's logp_mismatch, and [learner] behaviour_gap_alarm's default flags it."""
    trainer = Trainer(LearnerConfig(zero_stage=0, lr=1e-3, kl_coef=0.0, micro_batch_tokens=64), tiny_model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (PROMPT,), generator=gen).tolist() for _ in range(2)]
    ids, lps = sample(trainer.module, prompts, 4, gen)
    stats = trainer.train_step(samples_for(ids, lps - 3.0, torch.rand(2, 4, generator=gen)))
    assert stats["logp_mismatch"] == pytest.approx(3.0, abs=1e-3)
    assert "by 3.00 nats" in behaviour_gap(stats, LearnerConfig().behaviour_gap_alarm)


def test_zero3_accumulates_exactly_and_exports(tiny_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from parley.learner import checkpoint

    # Everything that loads a plain model comes first: while a ZeRO-3 trainer lives,
    # from_pretrained partitions what it loads.
    gen = torch.Generator().manual_seed(1)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids, lps = sample(plain, [torch.randint(3, 2000, (PROMPT,), generator=gen).tolist()], 4, gen)
    batch = samples_for(ids, lps, torch.tensor([[0.0, 1.0, 0.5, 0.2]]))
    expected_norm = whole_batch_grad_norm(tiny_model, batch)

    trainer = Trainer(LearnerConfig(zero_stage=3, lr=1e-3, kl_coef=0.0, micro_batch_tokens=30), tiny_model)
    try:
        first = trainer.hf_state_dict()
        stats = trainer.train_step(batch)
        assert stats["micro_batches"] == 4
        assert stats["grad_norm"] == pytest.approx(expected_norm, rel=1e-4)
        saved = load_file(trainer.save_weights(tmp_path / "z3") / "model.safetensors")
        assert set(saved) == set(first) and "lm_head.weight" not in saved  # tied to the embedding
        assert all(saved[k].shape == first[k].shape and not torch.equal(saved[k], first[k]) for k in first)

        # `parley export` of a version whose only record is the DeepSpeed checkpoint
        run_dir = tmp_path / "run"
        checkpoint.record_base_model(run_dir, tiny_model)
        trainer.save_checkpoint(checkpoint.ckpt_dir(run_dir), checkpoint.step_tag(1))
        out = checkpoint.export_version(run_dir, 1, tmp_path / "export")
        exported = load_file(out / "model.safetensors")
        assert set(exported) == set(saved)
        assert all(torch.equal(exported[k], saved[k]) for k in saved)
        assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    finally:
        trainer.close()  # later model loads in this process must not be partitioned


def test_synthetic_reward_rises(tiny_model):
    """Reward = share of sampled tokens with id < 256 (~12% for the random toy model)."""
    trainer = Trainer(LearnerConfig(zero_stage=2, lr=1e-2, kl_coef=0.0), tiny_model)
    gen = torch.Generator().manual_seed(0)
    history = []
    for _ in range(16):
        prompts = [torch.randint(3, 2000, (PROMPT,), generator=gen).tolist() for _ in range(4)]
        trainer.engine.eval()
        ids, lps = sample(trainer.module, prompts, 8, gen)
        rewards = (ids[:, PROMPT:] < 256).float().mean(dim=1).reshape(4, 8)  # (groups, samples)
        history.append(float(rewards.mean()))
        trainer.train_step(samples_for(ids, lps, rewards))
    print("mean reward per step:", " ".join(f"{r:.2f}" for r in history))
    start, end = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert end > start + 0.3, f"reward did not rise: {start:.3f} -> {end:.3f}"


@pytest.mark.parametrize("stage", [0, 2])
def test_a_step_with_a_non_finite_loss_is_not_applied(tiny_model, stage):
    """The last line of defence: a NaN advantage (a hostile reward that got past intake) makes the
    loss NaN; the step is skipped (weights and optimizer untouched) and reported, the next one trains."""
    trainer = Trainer(LearnerConfig(zero_stage=stage, lr=1e-3, micro_batch_tokens=64), tiny_model)

    def batch(adv):
        return [
            Sample(f"s{i}", [5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1], [0.0, 0.0, -1.0, -1.0, -1.0, -1.0], a)
            for i, a in enumerate(adv)
        ]

    before = params(trainer)
    stats = trainer.train_step(batch([float("nan"), 1.0, -1.0]))
    assert stats["skipped"] == 1.0
    after = params(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before), "a non-finite step changed the weights"
    stats = trainer.train_step(batch([1.0, -1.0, 0.5]))
    assert stats["skipped"] == 0.0
    trained = params(trainer)
    assert all(bool(torch.isfinite(p).all()) for p in trained.values())
    assert any(not torch.equal(after[n], trained[n]) for n in after)


def test_the_warm_up_before_the_first_step_changes_nothing_that_step_trains(tiny_model):
    """Trainer.warm_up (the learner's start, while it waits for data) leaves a zero gradient and no
    optimizer step: the first step after it gives bit-identical weights and the same statistics as
    a first step without it, under ZeRO-2's reductions in backward."""
    gen = torch.Generator().manual_seed(1)
    cfg = LearnerConfig(zero_stage=2, lr=1e-3, kl_coef=0.0, micro_batch_tokens=64)
    cold = Trainer(cfg, tiny_model)
    prompts = [torch.randint(3, 2000, (PROMPT,), generator=gen).tolist() for _ in range(2)]
    ids, lps = sample(cold.module, prompts, 4, gen)
    batch = samples_for(ids, lps, torch.rand(2, 4, generator=gen))
    cold_stats = cold.train_step(batch)
    cold_after = params(cold)
    warm = Trainer(cfg, tiny_model)
    assert warm.warm_up() > 0
    assert all(p.grad is None or not p.grad.any() for p in warm.module.parameters())
    warm_stats = warm.train_step(batch)
    warm_after = params(warm)
    assert all(torch.equal(cold_after[n], warm_after[n]) for n in cold_after)
    assert warm_stats["grad_norm"] == cold_stats["grad_norm"] and warm_stats["loss"] == cold_stats["loss"]


@pytest.mark.parametrize("stage", [2, 3])
def test_packed_versions_chain_from_one_step_to_the_next(tiny_model, stage, tmp_path):
    """[weights] delta_format = "packed" on the learner: Trainer.pack_versions packs the trained weights
    (ZeRO-3 gathers first) and encodes each version against the one packed before; an actor's packed
    copy of v1 (weights.gpu_delta.Mirror, filled from v1's tensors) turns into v2 with v2's delta alone
    and then holds exactly the weights the trainer saves, and v2's full file written from the packed
    buffer holds them too. fp32 weights (the CPU learner) change in
    about half their 16-bit words each step (every low half), so the delta is let up to the whole
    buffer here (max_share 1.0), and the step is small (lr 1e-7: a low half moves by tens of its
    steps, an int8 difference; at 1e-5 by thousands, an exception each, and no delta is smaller than
    the version); bf16 weights on a GPU change in 1-2% of their words at 1e-6 (docs/benchmarks.md)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from parley.weights.cuda_ipc import table_digest
    from parley.weights.gpu_delta import Mirror

    gen = torch.Generator().manual_seed(2)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids, lps = sample(plain, [torch.randint(3, 2000, (PROMPT,), generator=gen).tolist()], 4, gen)
    batch = samples_for(ids, lps, torch.tensor([[0.0, 1.0, 0.5, 0.2]]))
    trainer = Trainer(LearnerConfig(zero_stage=stage, lr=1e-7, kl_coef=0.0, micro_batch_tokens=64), tiny_model)
    try:
        table1, snap1 = trainer.pack_versions(1, 1.0)
        assert snap1.pending.encode() == (None, None, None)  # nothing packed before it
        actor = Mirror()
        actor.fill(trainer.hf_state_dict(), table1, "cpu")
        snap1.pending.discard()
        trainer.train_step(batch)
        table2, snap2 = trainer.pack_versions(2, 1.0)
        blob2, base2, digest2 = snap2.pending.encode()  # what the publication does beside the next step
        assert (base2, digest2) == (1, table_digest(table1)) and blob2 is not None
        actor.apply(blob2, table2)
        now = trainer.hf_state_dict()
        held = dict(actor.named())
        assert set(held) == set(now) and all(torch.equal(held[k], now[k]) for k in now)
        assert not all(torch.equal(held[k], t) for k, t in plain.state_dict().items() if k in held)  # it trained
        written = load_file(snap2.write(tmp_path / "v2") / "model.safetensors")  # the full file, from the buffer
        assert set(written) == set(now) and all(torch.equal(written[k], now[k]) for k in now)
        assert trainer.pack_versions(3, None)[1].pending.encode()[0] is None  # a full-only version: no delta
    finally:
        trainer.close()
