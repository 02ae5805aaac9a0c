"""Typed configuration of `parley learner` ([learner]) and the training data ([data])."""

from __future__ import annotations

from pathlib import Path

import msgspec

from protocol.messages import TASK_MAX_FUTURES, TASK_MAX_N, TASK_MAX_NEW_TURNS
from protocol.weights import TRANSPORTS

LOSS_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
STALE_POLICIES = ("drop", "correct")
DTYPES = ("auto", "float32", "bfloat16")
ATTENTIONS = ("auto", "sdpa", "varlen")  # learner.attention
REFERENCES = ("local", "service")  # where the KL's reference log-probs come from (learner.trainer)
COMPILES = ("auto", "off", "layers")  # learner.trainer.compile_layers


class DataConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[data]: where tasks come from and how train/eval are split (per reference document)."""

    path: str = "bundled"  # "bundled" or a CollabLLM parquet/jsonl file
    eval_fraction: float = 0.25
    split_seed: int = 0
    eval_path: str = ""  # a separate eval file instead of a split
    allow_overlap: bool = False  # start even if train and eval share reference targets

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be in [0, 1)")


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[rollout]: what each task asks of the actors."""

    mode: str = "conversation"  # "conversation" | "next_turn"
    n: int = 4  # samples per task (GRPO group size)
    max_new_turns: int = 6
    max_tokens: int = 256  # per assistant turn
    sim_prompt: str = ""  # a named simulator prompt; "" = the environment's (deploy/config.py resolves it)
    system_prompt: str = ""  # a file path or "" for none
    futures: int = 0  # next_turn: sampled futures per sample
    future_turns: int = 2

    def __post_init__(self) -> None:
        if self.mode not in ("conversation", "next_turn"):
            raise ValueError(f"mode={self.mode!r} not allowed; use conversation or next_turn")
        if self.n < 2:
            raise ValueError(f"n={self.n} must be >= 2 (GRPO needs a group)")
        # Actors refuse tasks beyond these (rollout.conversation.check_task_limits): fail here, not there.
        for name, most in (("n", TASK_MAX_N), ("max_new_turns", TASK_MAX_NEW_TURNS), ("futures", TASK_MAX_FUTURES),
                           ("future_turns", TASK_MAX_NEW_TURNS)):
            if getattr(self, name) > most:
                raise ValueError(f"{name}={getattr(self, name)} must be <= {most}")


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[learner]: feeder, grouping, GRPO, DeepSpeed, weights and checkpoints."""

    model: str = "smol"  # same names as [actor.engine].model
    steps: int = 3  # stop after this many optimizer steps (0 = run forever)
    groups_per_step: int = 2
    max_staleness: int = 1  # versions a group may lag behind the learner
    stale_policy: str = "drop"  # "drop" | "correct" (train it: the clipped ratio against its behaviour log-probs)
    group_timeout_s: float = 1800.0  # a partial group is dropped after this
    # An issued task that has not become a complete group this long after it was issued is given up
    # (its admission slot freed, the reason in the ledger): the backstop for fates the DEAD stream
    # does not tell (a letter that lost its payload or aged out). Counts learner uptime, across resumes.
    task_deadline_s: float = 7200.0
    lr: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    kl_coef: float = 0.001  # low-variance (k3) KL to the frozen reference
    # Where the reference log-probs come from (kl_coef > 0): "local" = a frozen copy of the initial
    # weights beside the policy, run in every step; "service" = computed once per trajectory by the
    # reference service (`parley reference`), asked by the scorer, carried in Scored.ref_logp_f32.
    reference: str = "local"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    loss_agg: str = "token-mean"
    scale_advantages: bool = True  # divide by the group std
    zero_stage: int = 2
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096  # token budget of a packed micro-batch
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    gradient_checkpointing: bool = False
    # attention over packed micro-batches: auto = flash varlen on CUDA (SDPA if unusable), SDPA on CPU;
    # sdpa = transformers' block-diagonal mask; varlen = per-sequence kernel (flash on CUDA, an SDPA call
    # per sequence on CPU)
    attention: str = "auto"
    # torch.compile of each decoder layer (attention itself stays eager): auto = on CUDA with ZeRO 0-2,
    # off on CPU and under ZeRO-3 (its parameter hooks run inside the layer); layers = always; off = never
    compile: str = "auto"
    publish_every: int = 1  # versions
    keep_versions: int = 3
    transport: str = "objstore"
    shared_dir: str = ""  # transport = shared_dir
    # transport = cuda_ipc (learner and actors on one host, CUDA) or nccl (actors elsewhere): a
    # superseded packed buffer is kept unchanged at least ipc_hold_s (the actors' deadline for
    # copying it); ipc_buffers of the packed model's size are held on rank 0's GPU.
    ipc_hold_s: float = 30.0
    ipc_buffers: int = 2
    nccl_address: str = ""  # transport = nccl: host:port of rank 0's store, as the actors reach it
    checkpoint_every: int = 1
    seed: int = 0
    keep_checkpoints: int = 2  # DeepSpeed checkpoints kept in the run dir (0 = all; export needs them)
    logit_chunk_tokens: int = 1024  # trained positions per lm_head chunk (bounds fp32 logits memory)
    ledger_flush_s: float = 2.0  # while waiting for data, record newly received samples this often, then ack
    # Periodic eval on the held-out split (evaluation.periodic): version 0, every eval_every-th version
    # and the last one are played by `parley eval` through the sim/judge services; 0 = off.
    eval_every: int = 0
    eval_items: int = 4  # held-out items per eval (0 = the whole eval split)
    # names the best version and drives early_stop: one of the environment's selectable eval columns
    # (collabllm_medium: bleu | interactivity | mr); "" = the environment's choice (deploy/config.py)
    eval_metric: str = ""
    early_stop: bool = False  # stop training when eval_metric regresses significantly
    early_stop_alpha: float = 0.05  # one-sided paired t test level of that regression
    eval_wait_s: float = 3600.0  # after the last step, how long to wait for the queued evals

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGG:
            raise ValueError(f"loss_agg={self.loss_agg!r} not allowed; use one of {LOSS_AGG}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy={self.stale_policy!r} not allowed; use one of {STALE_POLICIES}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} not allowed; use one of {TRANSPORTS}")
        if self.ipc_hold_s <= 0 or self.ipc_buffers < 1:
            raise ValueError(f"ipc_hold_s={self.ipc_hold_s} must be > 0 and ipc_buffers={self.ipc_buffers} >= 1")
        if self.transport == "nccl":
            from protocol.nccl import parse_address

            parse_address(self.nccl_address)  # raises naming the value and the fix
        if self.transport == "shared_dir" and not self.shared_dir:
            raise ValueError("transport='shared_dir' needs shared_dir (a directory every actor can read)")
        if self.shared_dir:
            # Once, here: a relative path would otherwise mean another directory in every process's cwd.
            # Actors check every announced location against it (protocol.weights.resolve_location).
            self.shared_dir = str(Path(self.shared_dir).expanduser().resolve())
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage} not allowed; use 0, 1, 2 or 3")
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step={self.groups_per_step} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness} must be >= 0")
        if self.compile not in COMPILES:
            raise ValueError(f"compile={self.compile!r} not allowed; use one of {COMPILES}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r} not allowed; use one of {ATTENTIONS}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference={self.reference!r} not allowed; use one of {REFERENCES}")
        if self.reference == "service" and self.kl_coef <= 0:
            raise ValueError(
                f"reference='service' with kl_coef={self.kl_coef}: without a KL term no reference is used; "
                "set learner.kl_coef > 0 or learner.reference = \"local\""
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} not allowed; use one of {DTYPES}")
        for name in ("publish_every", "checkpoint_every", "micro_batch_tokens", "logit_chunk_tokens", "keep_versions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints={self.keep_checkpoints} must be >= 0 (0 keeps all)")
        if self.ledger_flush_s <= 0:
            raise ValueError(f"ledger_flush_s={self.ledger_flush_s} must be > 0")
        if self.eval_every < 0 or self.eval_items < 0:
            raise ValueError(f"eval_every={self.eval_every} and eval_items={self.eval_items} must be >= 0")
        from evaluation.selection import REWARD_REFUSED, TRAINING_REWARD_NAMES

        if self.eval_metric.lower() in TRAINING_REWARD_NAMES:  # whatever the environment, with the reason
            raise ValueError(f"eval_metric {self.eval_metric}: {REWARD_REFUSED}")
        if not 0.0 < self.early_stop_alpha < 1.0:
            raise ValueError(f"early_stop_alpha={self.early_stop_alpha} must be in (0, 1)")
        if self.eval_every > 0 and self.eval_every % self.publish_every:
            raise ValueError(
                f"eval_every={self.eval_every} must be a multiple of publish_every={self.publish_every}: "
                "only published versions are kept for export to the eval"
            )
        if self.early_stop and self.eval_every == 0:
            raise ValueError("early_stop = true needs eval_every > 0 (it acts on the periodic eval)")
        if self.group_timeout_s <= 0:
            raise ValueError(f"group_timeout_s={self.group_timeout_s} must be > 0")
        if self.task_deadline_s < self.group_timeout_s:
            raise ValueError(
                f"task_deadline_s={self.task_deadline_s} must be >= group_timeout_s={self.group_timeout_s}: "
                "the deadline counts from issue, the group timeout from the first sample, so a shorter "
                "deadline would cut groups the timeout still waits for"
            )
        if self.publish_every > self.max_staleness + 1:
            raise ValueError(
                f"publish_every={self.publish_every} must be <= max_staleness + 1 = {self.max_staleness + 1}: "
                "tasks are admitted on the announced version, so the learner could never get further ahead "
                "than that and would stop; publish more often or raise max_staleness"
            )
