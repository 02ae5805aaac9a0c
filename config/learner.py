"""Typed configuration of `parley learner` ([learner]) and the training data ([data])."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

from parley.protocol.messages import TASK_MAX_FUTURES, TASK_MAX_N, TASK_MAX_NEW_TURNS
from parley.rewards.reward import REWARD_REFUSED, TRAINING_REWARD_NAMES

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
LOSS_AGG = get_args(LossAgg)
Attention = Literal["auto", "sdpa", "varlen"]  # learner.attention
ATTENTIONS = get_args(Attention)
Compile = Literal["auto", "off", "layers"]  # compiles_layers
Offload = Literal["none", "cpu"]  # learner.offload_optimizer
Positive = Annotated[int, Meta(ge=1)]


class DataConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[data]: where tasks come from and how train/eval are split (per reference document)."""

    path: Annotated[str, Meta(min_length=1)] = "bundled"  # "bundled", a CollabLLM parquet/jsonl file or Hub dataset id
    eval_fraction: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.25
    split_seed: int = 0
    eval_path: str = ""  # a separate eval file (or Hub dataset id, ORG/NAME#test) instead of a split
    allow_overlap: bool = False  # start even if train and eval share reference targets


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[rollout]: what each task asks of the actors."""

    mode: Literal["conversation", "next_turn"] = "conversation"
    # samples per task (GRPO group size). The upper bounds are the Task's: actors refuse tasks beyond
    # them (rollout.conversation.check_task_limits), so a run fails here, not there.
    n: Annotated[int, Meta(ge=2, le=TASK_MAX_N, description="GRPO needs a group")] = 4
    max_new_turns: Annotated[int, Meta(ge=1, le=TASK_MAX_NEW_TURNS)] = 6
    max_tokens: Annotated[int, Meta(ge=1)] = 256  # per assistant turn
    sim_prompt: str = ""  # a named simulator prompt; "" = the environment's (config/run.py resolves it)
    system_prompt: str = ""  # a file path or "" for none
    futures: Annotated[int, Meta(ge=0, le=TASK_MAX_FUTURES)] = 0  # next_turn: sampled futures per sample
    future_turns: Annotated[int, Meta(ge=1, le=TASK_MAX_NEW_TURNS)] = 2
    # Per-run limits on simulator and judge calls (services.budget): calls past them WAIT (the actors
    # stop taking tasks) instead of failing. Split evenly: each actor holds 1/[up] actors of the
    # simulator's, each scorer 1/[up] scorers of the judge's. 0 = unlimited.
    sim_call_budget: Annotated[int, Meta(ge=0, description="simulator calls per run; 0 = unlimited")] = 0
    judge_call_budget: Annotated[int, Meta(ge=0, description="judge calls per run; 0 = unlimited")] = 0
    sim_calls_per_s: Annotated[float, Meta(ge=0.0, description="simulator calls per second; 0 = unlimited")] = 0.0
    judge_calls_per_s: Annotated[float, Meta(ge=0.0, description="judge calls per second; 0 = unlimited")] = 0.0


# peft's names for the Linear layers of a Qwen3 / Llama decoder layer: every projection
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[learner.lora]: train a LoRA adapter (peft) on the frozen base instead of every weight. The
    reference for KL is then the base itself (the adapter disabled): no second copy is loaded. How
    actors serve each version (`serve`): "adapter", the adapter alone travels and their engines serve
    it as a vLLM LoRA adapter beside the base (weights.lora); "merged", the learner merges it into
    whole weights (W + alpha / rank * B @ A per adapted projection, learner.lora.merged_tensors) and
    publishes those like full fine-tuning's versions, to plain engines (no vLLM LoRA): the adapter's
    decode cost traded for a whole-weight transfer each version."""

    enabled: bool = False
    rank: Annotated[int, Meta(ge=1, le=512)] = 16
    alpha: Annotated[float, Meta(gt=0)] = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    serve: Literal["adapter", "merged"] = "adapter"

    @property
    def merged(self) -> bool:
        """Whether versions travel as whole weights with the adapter merged in (serve = "merged")."""
        return self.enabled and self.serve == "merged"

    @property
    def adapter_versions(self) -> bool:
        """Whether versions travel as the adapter alone (enabled, serve = "adapter")."""
        return self.enabled and self.serve == "adapter"

    def __post_init__(self) -> None:
        if self.enabled and not self.target_modules:
            raise ValueError(
                f"[learner.lora] target_modules is empty: name the Linear layers to adapt, e.g. {list(LORA_TARGETS)}"
            )


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[learner]: feeder, grouping, GRPO, DeepSpeed, weights and checkpoints."""

    steps: Annotated[int, Meta(ge=0, description="0 = run forever")] = (
        3  # stop after this many optimizer steps (0 = run forever)
    )
    groups_per_step: Positive = 2
    max_staleness: Annotated[int, Meta(ge=0)] = 1  # versions a group may lag behind the learner
    # Groups issued beyond the staleness gate's limit (learner.feeder.may_admit), so that groups that
    # come back with equal rewards (skipped: no signal) are replaced without waiting for a whole play.
    # The bound itself still holds where it is enforced, at training: an extra group that comes back
    # when no earlier one was skipped lags too far and is dropped (stale_policy "drop") as stale. 0: none.
    oversample_groups: Annotated[int, Meta(ge=0)] = 0
    # Which complete groups a step trains first: "oldest" (completion order) or "freshest" (the newest
    # behaviour version first: with oversampled groups back, the one least off-policy). Either way
    # nothing lagging more than max_staleness is trained under stale_policy "drop".
    group_order: Literal["oldest", "freshest"] = "oldest"
    # "correct": train it (the clipped ratio against its behaviour log-probs)
    stale_policy: Literal["drop", "correct"] = "drop"
    group_timeout_s: Annotated[float, Meta(gt=0)] = 1800.0  # a partial group is dropped after this
    # An issued task that has not become a complete group this long after it was issued is given up
    # (its admission slot freed, the reason in the ledger): the backstop for fates the DEAD stream
    # does not tell (a letter that lost its payload or aged out). Counts learner uptime, across resumes.
    task_deadline_s: Annotated[float, Meta(gt=0)] = 7200.0
    lr: Annotated[float, Meta(gt=0.0)] = 1e-6
    warmup_steps: Annotated[int, Meta(ge=0, description="0 = no warm-up")] = 0
    weight_decay: Annotated[float, Meta(ge=0.0)] = 0.0
    kl_coef: Annotated[float, Meta(ge=0.0, description="0 = no KL term")] = (
        0.001  # low-variance (k3) KL to the frozen reference ([policy] reference says which)
    )
    clip_low: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.2  # the ratio is clipped below at 1 - clip_low
    clip_high: Annotated[float, Meta(ge=0.0)] = 0.28
    dual_clip: Annotated[float, Meta(ge=0.0, description="0 = off, else > 1")] = 3.0  # learner/grpo.py
    # How a token's lag behind the policy that sampled it is corrected (learner/grpo.py): "clip" takes
    # the PPO clip (clip_low, clip_high, dual_clip) on exp(logp - mu) against the actor's behaviour
    # log-probs mu; "truncated_is" weights each token's gradient by min(exp(logp - mu), is_cap) and
    # clips nothing (TRL's and verl's "truncated importance sampling").
    behaviour_correction: Literal["clip", "truncated_is"] = "clip"
    is_cap: Annotated[float, Meta(ge=1.0)] = 3.0
    # A step whose mean |learner - behaviour| token log-prob (its logp_mismatch) exceeds this many nats
    # is flagged: one warning line in the learner's log, "behaviour_gap": true in metrics.jsonl and
    # train.behaviour_gap in the live view. The actor then sampled from a model other than the one the
    # learner trains (an engine setting that computes it differently, weights not applied). Lag and
    # bf16 stay far below it: on an H100 (2026-12-07, SmolLM2, hidden_goal) every step of a healthy run
    # was <= 0.52, while an engine that was wrong gave 1.6-3.8 on a fifth to two fifths of its steps.
    behaviour_gap_alarm: Annotated[float, Meta(ge=0.0, description="nats; 0 = off")] = 1.0
    # After this many flagged steps of one learner process the learner stops with that reason (exit code
    # 2, a config error, which `parley up` does not restart), once the last of them is durable: training
    # on another model's samples does not learn (on the H100 the wrong engine's runs flagged their
    # 10th step at steps 43 and 78 of 120, and never reached the target). 0 = warn only, never stop.
    behaviour_gap_stop: Annotated[int, Meta(ge=0, description="0 = never")] = 10
    loss_agg: LossAgg = "token-mean"
    scale_advantages: bool = True  # divide by the group std
    # Which group std: "sample" (n - 1, verl's and TRL's GRPO) or "population" (n; parley before
    # 2026-12, sqrt(n / (n - 1)) larger advantages: 1.15x at n = 4, 1.07x at n = 8).
    adv_std: Literal["sample", "population"] = "sample"
    zero_stage: Literal[0, 1, 2, 3] = 2
    grad_clip: Annotated[float, Meta(ge=0.0, description="0 = no clipping")] = 1.0  # DeepSpeed's gradient_clipping
    micro_batch_tokens: Positive = 4096  # token budget of a packed micro-batch
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto = bf16 on GPU, fp32 on CPU
    # Layers recomputed in backward (a third more compute, a layer's activations kept instead of all):
    # "auto" lets `parley up`'s memory plan choose, off when the activations without recompute fit the GPU
    # (deploy.memory.make_plan); a learner started otherwise takes "auto" as on.
    gradient_checkpointing: bool | Literal["auto"] = False
    # Where the optimizer's state lives: "none" on the GPU beside the weights; "cpu" the fp32 master
    # weights, Adam's m and v and the fp32 gradients in host memory and the Adam step on the host's
    # cores (DeepSpeed ZeRO-Offload, learner.trainer.ds_config), so a GPU holds only the training-dtype
    # weights: at the 4B shape 45 GiB of GPU memory become host memory. Needs zero_stage 1-3.
    offload_optimizer: Offload = "none"
    # The optimizer's copy of the trained weights, the gradients it steps with and Adam's m and v:
    # "float32" (mixed precision: 4 + 2 + 8 B a parameter beside the bf16 weights) or "bfloat16"
    # (DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states: 2 + 2 + 4 B, what TRL's bf16
    # weights train with), so full fine-tuning at the 4B shape fits an 80 GB GPU without the host.
    # The cost: an update smaller than half a bf16 step of its weight (about 0.4% of it) rounds to
    # nothing, step after step; at lr 1e-4 on SmolLM2 one step kept 0.45 of the update AdamW computed
    # (bench/results/step_match/summary.json), and at the recipe's lr 1e-6 most weights would not move.
    # Needs dtype bfloat16 (or auto on a GPU), zero_stage 1-3 and offload_optimizer = "none".
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    # attention over packed micro-batches: auto = flash varlen on CUDA (SDPA if unusable), SDPA on CPU;
    # sdpa = transformers' block-diagonal mask; varlen = per-sequence kernel (flash on CUDA, an SDPA call
    # per sequence on CPU)
    attention: Attention = "auto"
    # torch.compile of each decoder layer (attention itself stays eager): auto = on CUDA with ZeRO 0-2,
    # off on CPU, under ZeRO-3 (its parameter hooks run inside the layer) and with LoRA and a KL term
    # (compile_mode, compiles_layers); layers = always; off = never
    compile: Compile = "auto"
    # A learner that shares its GPU with the actors (cuda_ipc) and PyTorch's cache of the step's memory:
    # "release" hands it back to the driver after every step (the actors copy versions out of what is
    # free; the next step allocates it again); "keep_when_room" keeps it unless the GPU's free memory is
    # under two versions plus 1 GiB (learner.trainer.cache_release_needed). docs/gpu.md ("Side by side
    # with TRL") says why "release" is the default: the H200 runs that kept it trained differently, and
    # bench/learner_poison.py is the check.
    gpu_cache: Literal["release", "keep_when_room"] = "release"
    publish_every: Positive = 1  # versions
    keep_versions: Positive = 3
    checkpoint_every: Positive = 1
    seed: int = 0
    # DeepSpeed checkpoints kept in the run dir (0 = all; export needs them)
    keep_checkpoints: Annotated[int, Meta(ge=0, description="0 keeps all")] = 2
    logit_chunk_tokens: Positive = 1024  # trained positions per lm_head chunk (bounds fp32 logits memory)
    # A training step over the same groups that failed this many times (an exception such as a CUDA
    # out-of-memory on one long sample, or a kill during the step) is not tried again: its groups are
    # rejected with the error and dead-lettered, so a deterministic failure does not crash-loop the
    # learner (every --resume takes the same groups first). Counted in the ledger, across resumes.
    max_step_attempts: Annotated[int, Meta(ge=1, le=100)] = 3
    # Train Scored samples of tasks this learner has not issued (not in flight, not finished): off, so
    # a role that can write into SCORED cannot choose the training data; such samples are refused and
    # dead-lettered (counted as scored.foreign). On only to train samples made elsewhere (a replay).
    accept_foreign_scored: bool = False
    # while waiting for data, record newly received samples this often, then ack
    ledger_flush_s: Annotated[float, Meta(gt=0)] = 2.0
    # Periodic eval on the held-out split (evaluation.periodic): version 0, every eval_every-th version
    # and the last one are played by `parley eval` through the sim/judge services; 0 = off.
    eval_every: Annotated[int, Meta(ge=0, description="0 = off")] = 0
    eval_items: Annotated[int, Meta(ge=0)] = 4  # held-out items per eval (0 = the whole eval split)
    # names the best version and drives early_stop: one of the environment's selectable eval columns
    # (collabllm_medium: bleu | interactivity | mr); "" = the environment's choice (config/run.py)
    eval_metric: str = ""
    early_stop: bool = False  # stop training when eval_metric regresses significantly
    early_stop_alpha: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.05  # one-sided paired t test level of that regression
    eval_wait_s: Annotated[float, Meta(ge=0.0)] = 3600.0  # after the last step, how long to wait for the queued evals
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)  # [learner.lora]; off by default
    # optimizer updates per step: the step's groups split in order into this many mini-batches of whole
    # groups, each its own loss and optimizer step (verl's ppo_mini_batch_size = groups_per_step / this)
    updates_per_step: Positive = 1

    def __post_init__(self) -> None:
        if 0 < self.dual_clip <= 1:
            raise ValueError(
                f"[learner] dual_clip={self.dual_clip}: the dual clip caps a negative advantage's loss at "
                "dual_clip times it, so it must be > 1; set it > 1 (3.0 is the default) or 0 for off"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                f'[learner] offload_optimizer = "{self.offload_optimizer}" with zero_stage = 0: DeepSpeed offloads '
                "the optimizer state of ZeRO stages 1-3 only; set zero_stage = 2 (one GPU: the same "
                'mixed-precision Adam) or offload_optimizer = "none"'
            )
        if self.master_dtype == "bfloat16":
            refusals = (
                (self.dtype == "float32", 'dtype = "float32"'),
                (self.zero_stage == 0, "zero_stage = 0 (DeepSpeed keeps bf16 master weights in ZeRO stages 1-3 only)"),
                (
                    self.offload_optimizer != "none",
                    f'offload_optimizer = "{self.offload_optimizer}" (the host step keeps fp32 state)',
                ),
            )
            why = next((reason for bad, reason in refusals if bad), "")
            if why:
                raise ValueError(
                    f'[learner] master_dtype = "bfloat16" with {why}: bf16 master weights need bf16 training '
                    '(dtype = "bfloat16" or "auto" on a GPU), zero_stage 1-3 and offload_optimizer = "none"; '
                    'change that, or set master_dtype = "float32"'
                )
        if self.lora.enabled and self.compile == "layers" and self.kl_coef > 0:
            # peft swaps every targeted Linear for a LoRA layer holding a dict of adapters and a
            # disable flag the KL reference flips per forward: a compiled layer guards on that state and
            # recompiles at every flip. Without a KL term nothing flips it, and compiled LoRA layers
            # give the eager ones' log-probs and gradients (tests/e2e/test_learner_compile.py)
            raise ValueError(
                f'[learner] compile = "layers" with [learner.lora] enabled and kl_coef = {self.kl_coef}: the '
                "KL reference flips the adapters off per forward, which a compiled layer would "
                'recompile for; set kl_coef = 0, or compile = "auto" (off with LoRA and a KL term) or "off"'
            )
        if self.eval_metric.lower() in TRAINING_REWARD_NAMES:  # whatever the environment, with the reason
            raise ValueError(f"eval_metric {self.eval_metric}: {REWARD_REFUSED}")
        if self.eval_every > 0 and self.eval_every % self.publish_every:
            raise ValueError(
                f"eval_every={self.eval_every} must be a multiple of publish_every={self.publish_every}: "
                "only published versions are kept for export to the eval"
            )
        if self.early_stop and self.eval_every == 0:
            raise ValueError("early_stop = true needs eval_every > 0 (it acts on the periodic eval)")
        if self.task_deadline_s < self.group_timeout_s:
            raise ValueError(
                f"task_deadline_s={self.task_deadline_s} must be >= group_timeout_s={self.group_timeout_s}: "
                "the deadline counts from issue, the group timeout from the first sample, so a shorter "
                "deadline would cut groups the timeout still waits for"
            )
        if self.oversample_groups and self.stale_policy != "drop":
            raise ValueError(
                f"[learner] oversample_groups={self.oversample_groups} with stale_policy={self.stale_policy!r}: an "
                "extra group that comes back when no earlier one was skipped lags more than max_staleness and "
                'would be trained; set stale_policy = "drop" or oversample_groups = 0'
            )
        if self.groups_per_step % self.updates_per_step:
            raise ValueError(
                f"[learner] updates_per_step={self.updates_per_step} must divide groups_per_step="
                f"{self.groups_per_step}: every update trains a mini-batch of as many whole groups; "
                "set updates_per_step to a divisor of groups_per_step"
            )
        if self.publish_every > self.max_staleness + 1:
            raise ValueError(
                f"publish_every={self.publish_every} must be <= max_staleness + 1 = {self.max_staleness + 1}: "
                "tasks are admitted on the announced version, so the learner could never get further ahead "
                "than that and would stop; publish more often or raise max_staleness"
            )


def compile_mode(cfg: LearnerConfig) -> str:
    """[learner] compile as this learner reads it: with LoRA and a KL term "auto" is off, since the KL
    reference flips the adapters off per forward and a compiled layer recompiles at every flip (the
    config refuses an explicit "layers" there). Without a KL term compiled LoRA layers give the eager
    ones' log-probs and gradients (tests/e2e/test_learner_compile.py), and at the 4B shape they cut the
    step (docs/gpu.md, "Throughput against the floor")."""
    if cfg.compile == "auto" and cfg.lora.enabled and cfg.kl_coef > 0:
        return "off"
    return cfg.compile


def compiles_layers(mode: str, cuda: bool, zero_stage: int) -> bool:
    """Whether compile `mode` (compile_mode's) compiles the decoder layers: "layers" always, "off" never,
    "auto" on CUDA under ZeRO 0-2 only (ZeRO-3 gathers parameters in module hooks, which compiled layers
    would trace). learner.trainer.compile_layers acts on it; deploy.memory plans the activations that
    compiled layers keep by it, before start."""
    return mode == "layers" or (mode == "auto" and cuda and zero_stage != 3)
