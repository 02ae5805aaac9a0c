"""The GPU memory plan of `parley up`: what each process it starts takes on the one GPU they all
share (every child sees the same first GPU), computed from the run config and the models'
config.json before any child starts. deploy/up_cli.py prints it (also under --dry-run) and refuses a
run that does not fit. Computed, not measured: docs/gpu.md, "Train on one GPU".

The plan knows what each learner configuration holds: full fine-tuning's states on the GPU, the
optimizer state on the host (learner.offload_optimizer = "cpu", listed apart, not counted against the
GPU), or a LoRA adapter's beside the frozen base ([learner.lora]). A run that does not fit is refused
with the changes that do fit, each planned here with its figures (Plan.fixes).

A config that puts nothing on a GPU by its own words (no vLLM engine with a gpu_memory_utilization
or in half precision, no [weights] transport that needs CUDA, no up.gpu_memory_gib) is not planned:
the CPU configs run as before.

Under [up] gpu_share = "phased" the actor's engine sleeps while the learner steps (actors/phases.py):
each term says in which phase it is held (GENERATE, TRAIN or both), and the run needs the larger
phase, not the sum, so the KV cache may take what the learner's step takes only while it steps.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from parley.config.learner import LORA_TARGETS, compile_mode, compiles_layers
from parley.config.run import RunConfig
from parley.engines.config import EngineConfig
from parley.engines.models import MODEL_SHAPES
from parley.errors import ConfigError
from parley.protocol import topology
from parley.services.combined import service_children, shared_engine
from parley.weights import registry
from parley.weights.cuda_ipc import ALIGN

log = logging.getLogger(__name__)
GIB = 1024**3
HEADROOM = 0.05  # of the GPU kept free: allocator fragmentation, and the plan's own error
# Per process that holds GPU memory: a torch process's CUDA context with its kernels loaded is about
# 0.5 GiB; 1.0 also covers cuBLAS workspaces, NCCL's buffers (the learner) and what a vLLM engine
# allocates outside its fraction. Not measured on the lent machine's image.
CUDA_CONTEXT_GIB = 1.0
# DeepSpeed ZeRO's gradient bucket: reduce_bucket_size elements in the training dtype, allocated at
# every backward (its default, which learner.trainer.ds_config leaves alone on a GPU).
REDUCE_BUCKET_ELEMENTS = 500_000_000
# fp32 (chunk, vocab) tensors alive at once at the peak of one lm_head chunk's backward: its logits,
# their log-softmax, its exp and a gradient (engines.logprobs._logp_entropy, recomputed in backward).
LOGIT_COPIES = 4
FP32 = 4


class PlanError(ConfigError):
    """The plan cannot be made (a model's shape is unknown); the message names the model and the fix."""


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shape, from its config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # lm_head shares the embedding's weight
    qk_norm: bool = False  # Qwen3's RMSNorm on each head's q and k
    qkv_bias: bool = False  # Qwen2's

    @classmethod
    def of(cls, config: dict) -> Shape:
        config = config.get("text_config", config) if "hidden_size" not in config else config
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in need if k not in config]
        if missing:
            raise PlanError(f"config.json has no {', '.join(missing)}")
        heads = config["num_attention_heads"]
        kind = config.get("model_type", "")
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=kind == "qwen3",
            qkv_bias=bool(config.get("attention_bias", kind == "qwen2")),
        )

    def tensors(self) -> list[int]:
        """Elements of every weight a checkpoint holds, a tied lm_head once."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h, h, h]  # q k v o, gate up down, two norms
        layer += [q, kv, kv] if self.qkv_bias else []
        layer += [self.head_dim, self.head_dim] if self.qk_norm else []
        return [self.vocab * h, *layer * self.layers, h, *([] if self.tied else [self.vocab * h])]

    @property
    def params(self) -> int:
        return sum(self.tensors())

    def lora_tensors(self, rank: int, targets) -> list[int]:
        """Elements of every tensor of a rank-`rank` LoRA adapter on the named Linear layers of each
        decoder layer (peft's A: rank x in, B: out x rank). A target that is not one of a dense
        decoder's seven projections is a PlanError naming it."""
        dims = self._projections(targets)
        layer = [n for t in targets for n in (rank * dims[t][0], dims[t][1] * rank)]
        return layer * self.layers

    def adapted_tensors(self, targets) -> list[int]:
        """Elements of every base weight the named Linear layers hold, in every decoder layer: what
        [learner.lora] serve = "merged" makes anew for each version (learner.lora.merged_tensors)."""
        dims = self._projections(targets)
        return [dims[t][0] * dims[t][1] for t in targets] * self.layers

    def _projections(self, targets) -> dict[str, tuple[int, int]]:
        """(in, out) features of a dense decoder's seven projections; a PlanError names another target."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        dims = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        unknown = [t for t in targets if t not in dims]
        if unknown:
            raise PlanError(
                f"[learner.lora] target_modules {unknown}: the plan sizes adapters on {sorted(dims)} only; "
                "set learner.lora.target_modules to some of them"
            )
        return dims

    def lora_params(self, rank: int, targets) -> int:
        return sum(self.lora_tensors(rank, targets))

    @property
    def largest(self) -> int:
        """Elements of the largest tensor (the embedding, at every shape the plan has met)."""
        return max(self.tensors())

    def packed_bytes(self, dtype_bytes: int, tensors: list[int] | None = None) -> int:
        """The cuda_ipc / nccl buffer of these weights (or of `tensors`, an adapter's): each tensor
        padded to ALIGN (weights.cuda_ipc.plan)."""
        return sum(-(-n * dtype_bytes // ALIGN) * ALIGN for n in (self.tensors() if tensors is None else tensors))

    def layer_activation_bytes(self, compiled: bool = False, lora_rank: int = 0, lora_targets=()) -> int:
        """What one decoder layer keeps for backward per token, in bf16 (fp32 where the layer computes
        in it): what autograd saves for the gradients that are asked for. Both ways flash attention
        keeps q and its output (2 x 2 nq d), k and v (2 x 2 nkv d) and the fp32 log-sum-exp (4 nq);
        each RMSNorm its fp32 1/rms (4 a token, 4 a head for Qwen3's q/k norms); and under
        [learner.lora] each adapted projection its rank-r intermediate (2 r: lora_B's input; lora_A's
        is the base projection's input, counted already).

        Eager: each of the two RMSNorms its fp32 copy of the input (4h) and its output (2h: the
        projections' input), and where its weight trains (full fine-tuning, not LoRA) the normalised
        input its weight's gradient needs (2h); Qwen3's q/k norms alike, 4 (nq + nkv) d, + 2 (nq + nkv) d
        where they train (their output goes into the rotary embedding, which keeps none); SwiGLU the
        gate, its SiLU, up and their product (4 x 2i).

        Compiled ([learner] compile, learner.trainer.compile_layers): inductor's partitioner recomputes
        cheap pointwise work in backward from what it keeps. Each RMSNorm keeps its bf16 input (2h:
        the fp32 copy and the normalised input are recomputed from it and 1/rms) and its output (2h,
        a matmul's input); q and k before their norms (2 (nq + nkv) d, matmul outputs); SwiGLU the gate,
        up and their product (3 x 2i: the SiLU is recomputed from the gate). Matmuls are never recomputed.

        Counted from saved-tensor hooks on one Qwen3-4B-shaped layer (eager and compiled, bf16, with
        and without a rank-16 adapter): exactly these bytes; on the GPU the LoRA learner's peaks agree
        (docs/gpu.md, "The memory plan")."""
        h, i, d, nq, nkv = self.hidden, self.intermediate, self.head_dim, self.heads, self.kv_heads
        trains_norms = lora_rank == 0
        attention = 4 * (nq + nkv) * d + 4 * nq
        rms = 2 * 4 + (4 * (nq + nkv) if self.qk_norm else 0)  # fp32 1/rms, a token (and a q/k head)
        adapter = 2 * lora_rank * len(lora_targets)
        if compiled:
            norms = 2 * (2 * h + 2 * h)
            qk = 2 * (nq + nkv) * d if self.qk_norm else 0
            mlp = 3 * 2 * i
        else:
            norms = 2 * (4 * h + 2 * h + (2 * h if trains_norms else 0))
            qk = ((4 + (2 if trains_norms else 0)) * (nq + nkv) * d) if self.qk_norm else 0
            mlp = 4 * 2 * i
        return norms + qk + attention + mlp + rms + adapter


def model_shape(name: str) -> Shape:
    """The shape of "tiny" / "smol" (engines.models.MODEL_SHAPES: nothing is built) or of a checkpoint
    directory's config.json (no weights are read)."""
    if name in MODEL_SHAPES:
        return Shape.of(MODEL_SHAPES[name])
    path = Path(name).expanduser() / "config.json"
    try:
        return Shape.of(json.loads(path.read_text()))
    except OSError as e:
        raise PlanError(
            f"model {name!r}: cannot read {path} ({e.strerror}); give an existing checkpoint "
            "directory or one of tiny, smol"
        ) from None
    except (ValueError, PlanError) as e:
        raise PlanError(f"model {name!r}: {path}: {e}") from None


@dataclass(frozen=True)
class Term:
    what: str  # the term, with its formula's numbers
    gib: float = 0.0  # a fixed size
    share: float = 0.0  # a share of the GPU's total (a vLLM engine's gpu_memory_utilization)
    host: bool = False  # held in host memory, not on the GPU: listed, not counted against the GPU
    # [up] gpu_share = "phased": held only while the actor generates (GENERATE: the actor's engine
    # awake) or only while the learner steps (TRAIN); "" = in both
    phase: str = ""

    def at(self, total: float | None) -> float | None:
        if self.share and total is None:
            return None
        return self.gib + self.share * (total or 0.0)


@dataclass(frozen=True)
class Proc:
    name: str
    terms: tuple[Term, ...]

    @property
    def gib(self) -> float:
        return sum(t.gib for t in self.terms if not t.host)

    @property
    def share(self) -> float:
        return sum(t.share for t in self.terms if not t.host)

    @property
    def host_gib(self) -> float:
        return sum(t.gib for t in self.terms if t.host)


@dataclass(frozen=True)
class Plan:
    procs: tuple[Proc, ...]
    total: float | None  # the GPU's GiB; None = unknown
    source: str  # where the total comes from
    knobs: tuple[str, ...]  # what to turn when it does not fit
    # settings the plan chose, as (dotted key, value): learner.gradient_checkpointing = "auto"'s choice
    chosen: tuple[tuple[str, object], ...] = ()
    fixes: tuple[Fix, ...] = ()  # changes planned to fit (only when this plan does not)
    phased: bool = False  # [up] gpu_share = "phased": the larger of the two phases is needed, not the sum
    notes: tuple[str, ...] = ()  # warnings that refuse nothing (kv_demand_notes)

    @property
    def need(self) -> float | None:
        if self.total is None:
            return None
        return gpu_need(self.procs, self.total, self.phased)

    @property
    def usable(self) -> float | None:
        return None if self.total is None else self.total * (1 - HEADROOM)

    @property
    def fits(self) -> bool | None:
        return None if self.total is None else self.need <= self.usable

    def render(self) -> str:
        head = "GPU memory plan (computed from the config and the models' config.json, not measured): " + (
            f"GPU total {self.total:.1f} GiB ({self.source})"
            if self.total is not None
            else "GPU total unknown: set up.gpu_memory_gib"
        )
        lines = [head]
        for p in self.procs:
            lines.append(f"  {p.name:<34}{_size(p.gib, p.share, self.total):>22}")
            lines += [
                f"    {_size(t.gib, t.share, self.total):>12}  "
                + ("(host, not on the GPU) " if t.host else "")
                + (f"({PHASES[t.phase]} only) " if t.phase else "")
                + t.what
                for t in p.terms
            ]
        gib, share = sum(p.gib for p in self.procs), sum(p.share for p in self.procs)
        if self.total is None:
            lines.append(f"  {'all processes':<34}{_size(gib, share, None):>22}")
        else:
            left = self.usable - self.need
            lines.append(
                f"  {'all processes':<34}{self.need:>18.2f} GiB, of {self.usable:.2f} usable "
                f"({1 - HEADROOM:.0%} of {self.total:.1f}): "
                + (f"{left:.2f} GiB to spare" if left >= 0 else f"{-left:.2f} GiB over")
            )
        if self.phased:
            lines += self.phase_lines()
        for key, value in self.chosen:
            lines.append(f'  chosen by this plan: {key} = {_toml(value)} (it was "auto")')
        host = sum(p.host_gib for p in self.procs)
        if host:
            lines.append(f"  {'host memory (not on the GPU)':<34}{host:>18.2f} GiB")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def phase_lines(self) -> list[str]:
        """What each phase of [up] gpu_share = "phased" holds on the GPU."""
        out = ['  phased ([up] gpu_share = "phased"; the plan needs the larger phase, not the sum):']
        for phase, what in (
            ("generate", "the actor's engine awake; the learner between steps (its step's memory released)"),
            ("train", "the learner's step; the actor's engine asleep (its KV cache and weights off the GPU)"),
        ):
            gib = [_size(*_phase_sum(p.terms, phase), self.total) for p in self.procs]
            at = "" if self.total is None else f"{gpu_need(self.procs, self.total, phase=phase):.2f} GiB"
            held = ", ".join(f"{p.name} {g}" for p, g in zip(self.procs, gib))
            out.append(f"    {PHASES[phase]} {at or '(GPU total unknown)'}: {what}: {held}")
        return out

    def refusal(self) -> str:
        return (
            f"parley up: the processes on the GPU need {self.need:.2f} GiB, more than the {self.usable:.2f} GiB "
            f"usable ({1 - HEADROOM:.0%} of the GPU's {self.total:.1f} GiB, {self.source}): "
            f"{self.need - self.usable:.2f} GiB over; nothing was started\n{self.render()}\n"
            + self.fixes_text()
            + "or turn one of:\n"
            + "\n".join(f"  {k}" for k in self.knobs)
        )

    def fixes_text(self) -> str:
        fit = [f for f in self.fixes if f.need <= self.usable]
        if fit:
            return "changes that fit, each planned as above (give them as --set):\n" + "".join(
                f"  {f.sets()}  -> {f.need:.2f} GiB of {self.usable:.2f} usable{f.note}\n" for f in fit
            )
        tried = "".join(f"  {f.sets()}  -> {f.need:.2f} GiB\n" for f in self.fixes)
        return "no change of the learner's alone fits; planned:\n" + tried if tried else ""


@dataclass(frozen=True)
class Fix:
    """A change of the config (dotted keys, as `--set` takes them) and what the plan needs with it."""

    changes: tuple[tuple[str, object], ...]
    need: float  # GiB on the GPU with the change
    note: str = ""  # what else it costs (host memory)

    def sets(self) -> str:
        return " ".join(f"--set {k}={_toml(v)}" for k, v in self.changes)


PHASES = {"generate": "GENERATE", "train": "TRAIN"}


def _phase_sum(terms, phase: str | None) -> tuple[float, float]:
    """(GiB, share of the GPU) of the terms on the GPU in `phase` (None: all of them)."""
    held = [t for t in terms if not t.host and (phase is None or t.phase in ("", phase))]
    return sum(t.gib for t in held), sum(t.share for t in held)


def gpu_need(procs, total: float, phased: bool = False, phase: str | None = None) -> float:
    """GiB the processes need on a GPU of `total` GiB: the sum of their terms; `phased`, the larger
    of its two phases (GENERATE, TRAIN); `phase`, that phase's."""
    if phased:
        return max(gpu_need(procs, total, phase=ph) for ph in PHASES)
    gib, share = map(sum, zip((0.0, 0.0), *(_phase_sum(p.terms, phase) for p in procs)))
    return gib + share * total


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f'"{v}"' if isinstance(v, str) else str(v)


def _size(gib: float, share: float, total: float | None) -> str:
    if total is not None:
        return f"{gib + share * total:.2f} GiB"
    if not share:
        return f"{gib:.2f} GiB"
    return f"{gib:.2f} GiB + {share:.2f} x GPU" if gib else f"{share:.2f} x GPU"


# -- the processes ------------------------------------------------------------------------------


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def _m(n: int) -> str:
    return f"{n / 1e6:.1f}M"


ENGINE_WORK_GIB = 1.0  # what an engine with an explicit KV size takes beside weights and KV (estimate)
MIB = 1024**2


def kv_token_bytes(shape: Shape, ec: EngineConfig) -> int:
    """Bytes one token takes in an engine's KV cache: K and V (2) of every layer's kv heads, each head_dim
    values in the KV dtype: 1 B for vLLM's fp8 formats, else ("auto") the engine's dtype."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_dtype_bytes(ec)


def kv_dtype_bytes(ec: EngineConfig) -> int:
    if ec.kv_cache_dtype != "auto":
        return 1
    return 4 if ec.dtype == "float32" else 2


def kv_capacity(shape: Shape, ec: EngineConfig) -> str:
    """The tokens an explicit kv_cache_bytes holds, with the formula of a token's bytes."""
    per = kv_token_bytes(shape, ec)
    return (
        f'{ec.kv_cache_bytes // per:,} tokens of {per:,} B (kv_cache_dtype "{ec.kv_cache_dtype}": 2 x {shape.layers} '
        f"layers x {shape.kv_heads} kv heads x {shape.head_dim} x {kv_dtype_bytes(ec)} B)"
    )


def kv_demand_notes(cfg: RunConfig) -> list[str]:
    """A warning when an actor's explicit KV cache holds fewer tokens than its conversations in flight
    can: actor.concurrency conversations (each one request at a time, none shared with the simulator or
    the judge, which run on engines of their own) of up to max_model_len tokens. vLLM then preempts
    requests when they grow (their KV given up and recomputed later: the actor's preemption counter),
    which a user may accept; the plan says so and what would hold them all."""
    ec = cfg.actor.engine
    if ec.gpu_memory_utilization > 0:
        return []  # vLLM sizes the cache from the share; the plan does not know how much
    shape = model_shape(ec.model)
    per, demand = kv_token_bytes(shape, ec), cfg.actor.concurrency * ec.max_model_len
    held = ec.kv_cache_bytes // per
    if held >= demand:
        return []
    need = -(-demand * per // MIB) * MIB
    fp8 = ""
    if ec.kv_cache_dtype == "auto":
        fp8 = f'; actor.engine.kv_cache_dtype = "fp8" would hold {kv_dtype_bytes(ec)}x as many tokens in the same bytes'
    return [
        f"warning: each actor's KV cache holds {held:,} tokens ({held // ec.max_model_len} conversations of "
        f"max_model_len {ec.max_model_len}), less than the {demand:,} its actor.concurrency {cfg.actor.concurrency} "
        f"conversations can hold: vLLM may preempt (and recompute) requests; actor.engine.kv_cache_bytes = {need} "
        f"would hold them all{fp8}"
    ]


def engine_terms(ec: EngineConfig, shape_of, sleep_level: int = 0) -> list[Term]:
    """A vLLM engine: with a gpu_memory_utilization, that share of the GPU, which vLLM reserves and
    fills (weights, activations, KV cache, CUDA graphs); without one, its weights and kv_cache_bytes.
    With a `sleep_level` (the actor under [up] gpu_share = "phased") its weights, LoRA slots and KV
    cache are held in GENERATE only (vLLM's sleep mode allocates them in its own pool and frees it:
    level 1 keeps the weights in host memory), its working memory in both phases."""
    gen = "generate" if sleep_level else ""
    if ec.gpu_memory_utilization > 0:
        share = Term(
            f"vLLM engine {ec.model}: gpu_memory_utilization {ec.gpu_memory_utilization:g} x the GPU "
            "(weights, activations, KV cache, CUDA graphs)",
            share=ec.gpu_memory_utilization,
            phase=gen,
        )
        if not sleep_level:
            return [share]
        kept = Term(f"asleep (level {sleep_level}): its activations, sampler and CUDA graphs stay", ENGINE_WORK_GIB)
        return [share, replace(kept, phase="train")]
    shape, b = shape_of(ec.model), 4 if ec.dtype == "float32" else 2
    asleep = []
    if sleep_level == 1:
        asleep = [
            Term(
                f"its weights while it sleeps (sleep level 1): {b} B x {_m(shape.params)} params",
                _gib(b * shape.params),
                host=True,
            )
        ]
    slots = []
    if ec.max_lora_rank > 0:  # vLLM stacks max_loras adapters of max_lora_rank on every projection it can adapt
        a = shape.lora_params(ec.max_lora_rank, LORA_TARGETS)
        slots = [
            Term(
                f"its LoRA slots: max_loras {ec.max_loras} x {b} B x {_m(a)} params (rank {ec.max_lora_rank}, "
                "every projection)",
                _gib(ec.max_loras * b * a),
                phase=gen,
            )
        ]
    return [
        Term(f"vLLM engine {ec.model} weights: {b} B x {_m(shape.params)} params", _gib(b * shape.params), phase=gen),
        *slots,
        Term(
            f"its KV cache: kv_cache_bytes {ec.kv_cache_bytes}, {kv_capacity(shape, ec)} (explicit: vLLM does "
            "not profile, so the GPU's other processes starting beside it do not shrink it)",
            _gib(ec.kv_cache_bytes),
            phase=gen,
        ),
        Term("its activations, sampler and CUDA graphs: an estimate, not measured", ENGINE_WORK_GIB),
        *asleep,
    ]


def learner_dtype_bytes(cfg: RunConfig) -> int:
    return 4 if cfg.learner.dtype == "float32" else 2  # "auto" is bf16 on a GPU (learner.trainer.resolve_dtype)


def micro_batch_tokens(cfg: RunConfig) -> int:
    """The longest micro-batch: micro_batch_tokens, or one whole trajectory when that is longer (a
    sequence longer than the budget gets a micro-batch of its own: learner.packing.pack_by_tokens)."""
    return max(cfg.learner.micro_batch_tokens, cfg.actor.engine.max_model_len)


def compiled_layers(cfg: RunConfig) -> bool:
    """Whether the learner compiles its decoder layers (config.learner.compiles_layers, the rule
    learner.trainer acts on), on CUDA: the plan counts the learner on the GPU (uses_gpu)."""
    lc = cfg.learner
    return compiles_layers(compile_mode(lc), uses_gpu(cfg), lc.zero_stage)


def activation_terms(cfg: RunConfig, shape: Shape, checkpointing: bool) -> list[Term]:
    """The peak of one micro-batch's forward and backward: T tokens of layer activations (without
    gradient checkpointing every layer's; with it each layer's bf16 input and one layer's, recomputed)
    plus the final norm and the trained positions' hidden states (8h per token), and one lm_head
    chunk's fp32 logits: LOGIT_COPIES x 4 B x chunk x vocab. A layer's count is what it keeps compiled
    or eager, with or without an adapter (Shape.layer_activation_bytes)."""
    lc, compiled = cfg.learner, compiled_layers(cfg)
    lora = (lc.lora.rank, lc.lora.target_modules) if lc.lora.enabled else (0, ())
    t, h, layer = micro_batch_tokens(cfg), shape.hidden, shape.layer_activation_bytes(compiled, *lora)
    kind = ("compiled" if compiled else "eager") + (f", rank-{lc.lora.rank} adapter" if lc.lora.enabled else "")
    if checkpointing:
        per_token = shape.layers * 2 * h + layer + 8 * h
        how = (
            f"{t} tokens x ({shape.layers} layers x {2 * h} B layer inputs + one layer's {layer} B ({kind}) + "
            f"{8 * h} B) (gradient checkpointing)"
        )
    else:
        per_token = shape.layers * layer + 8 * h
        how = f"{t} tokens x ({shape.layers} layers x {layer} B ({kind}) + {8 * h} B) (no gradient checkpointing)"
    chunk = min(cfg.learner.logit_chunk_tokens, t)
    return [
        Term(f"activations: {how}", _gib(t * per_token)),
        Term(
            f"logits: {LOGIT_COPIES} x {FP32} B x {chunk} tokens (logit_chunk_tokens) x {shape.vocab} vocab",
            _gib(LOGIT_COPIES * FP32 * chunk * shape.vocab),
        ),
    ]


def learner_terms(cfg: RunConfig, shape: Shape) -> list[Term]:
    """The learner (one rank, DeepSpeed ZeRO 1-3 on one GPU; stage 0 is counted alike, an upper bound).
    Per trained parameter (every weight, or under [learner.lora] the adapter's, beside the frozen base
    in the training dtype, p B): its weights (p B), gradients (p B: the gradient partition in the
    training dtype, DeepSpeed's default when grad_accum_dtype is unset), fp32 master weights (4 B) and
    AdamW's m and v (fp32: 8 B); with learner.master_dtype = "bfloat16" the master copy and m and v in
    bf16 (2 + 4 B). With learner.offload_optimizer = "cpu" only the weights stay on the GPU:
    master, m, v and the fp32 gradients are in pinned host memory with the gradients accumulated across
    micro-batches and the weights' staging copy (p B each), and the GPU keeps two transfer buffers of
    the largest tensor. Then the frozen local reference (p B x every weight; under LoRA the base itself
    is the reference), rank 0's publication buffers (of the adapter alone under LoRA, of whole weights
    with serve = "merged"), the gradient bucket, the largest of a micro-batch's activations, the
    optimizer step's temporaries on the GPU (the flat gradient and its fp32 copy, p + 4 B a trained
    parameter, p B with a bf16 master, after the activations are freed; none with the step on the
    host) and, with serve = "merged", the merge's (after the step: one projection at a time), the CUDA
    context."""
    lc, p, n = cfg.learner, learner_dtype_bytes(cfg), shape.params
    lora, offload, merged = lc.lora.enabled, lc.offload_optimizer == "cpu", lc.lora.merged
    adapter = shape.lora_tensors(lc.lora.rank, lc.lora.target_modules) if lora else None
    k = sum(adapter) if lora else n  # trained parameters
    of = f"{_m(k)} adapter params (rank {lc.lora.rank})" if lora else f"{_m(k)} params"
    terms = []
    if lora:
        terms.append(
            Term(
                f"frozen base weights ([learner.lora]: no gradient, no optimizer state): {p} B x {_m(n)} params",
                _gib(p * n),
            )
        )
    if offload:
        terms += [
            Term(f"trained weights: {p} B x {of}", _gib(p * k)),
            Term(
                f'fp32 master + Adam m, v + fp32 gradients (learner.offload_optimizer = "cpu"): (4 + 8 + 4) B x {of}, '
                f"and the gradients accumulated across micro-batches and the weights' staging copy: 2 x {p} B x {_m(k)}",
                _gib((16 + 2 * p) * k),
                host=True,
            ),
            Term(
                f"offload transfer buffers: 2 x {p} B x the largest trained tensor ({_m(max(adapter or [shape.largest]))})",
                _gib(2 * p * max(adapter or [shape.largest])),
            ),
        ]
    elif lc.master_dtype == "bfloat16":
        terms.append(
            Term(
                f'weights + gradients + bf16 master + Adam m, v in bf16 (learner.master_dtype = "bfloat16"): '
                f"({p} + {p} + 2 + 4) B x {of}",
                _gib((2 * p + 6) * k),
            )
        )
    else:
        terms.append(
            Term(f"weights + gradients + fp32 master + Adam m, v: ({p} + {p} + 4 + 8) B x {of}", _gib((2 * p + 12) * k))
        )
    if lc.kl_coef > 0 and cfg.policy.reference == "local" and not lora:
        terms.append(Term(f"frozen reference (policy.reference = local): {p} B x {_m(n)} params", _gib(p * n)))
    transport = registry.of(cfg.weights)
    what = f"the weights in {p} B, a tied lm_head once"
    if merged:
        what += ', the adapter merged in: learner.lora.serve = "merged"'
    elif lora:
        what = f"the adapter in {p} B"
    if transport.gpu:
        kb, packed = cfg.weights.max_buffers, shape.packed_bytes(p, None if merged else adapter)
        terms.append(
            Term(
                f"{transport.kind} buffers: weights.max_buffers {kb} x {_gib(packed):.2f} GiB ({what})",
                _gib(kb * packed),
            )
        )
    elif packed_deltas(cfg):
        packed = shape.packed_bytes(p)
        terms.append(
            Term(
                f'packed versions (weights.delta_format = "packed"): 2 x {_gib(packed):.2f} GiB ({what})',
                _gib(2 * packed),
            )
        )
    if lc.zero_stage > 0:
        terms.append(
            Term(
                f"DeepSpeed gradient bucket: reduce_bucket_size {REDUCE_BUCKET_ELEMENTS:,} x {p} B",
                _gib(REDUCE_BUCKET_ELEMENTS * p),
                phase="train" if phased_release(cfg) else "",  # allocated at every backward
            )
        )
    act = activation_terms(cfg, shape, lc.gradient_checkpointing)
    # the flat gradient partition, then its copy in the master's dtype: none when that is bf16 already
    # (DeepSpeed's step converts it with .to(master dtype), which returns the same tensor)
    copy = 0 if lc.master_dtype == "bfloat16" else 4  # a bf16 master needs bf16 training (config.learner)
    step = Term(
        f"optimizer step temporaries: ({p} + {copy}) B x {of} (more than a micro-batch's activations here)",
        _gib((p + copy) * k),
    )
    peaks = [act] if offload else [act, [step]]
    if merged:  # after the step, when its activations and temporaries are freed
        peaks.append([merge_term(cfg, shape)])
    peak = max(peaks, key=lambda ts: sum(t.gib for t in ts))
    if phased_release(cfg):  # released after every step: held while the learner steps only
        peak = [replace(t, phase="train") for t in peak]
    terms += peak
    return [*terms, Term("CUDA context", CUDA_CONTEXT_GIB)]


def phased_release(cfg: RunConfig) -> bool:
    """[up] gpu_share = "phased" with a learner that hands its step's memory back after every step
    (learner.trainer: a transport that shares its GPU, gpu_cache = "release"): its activations, the
    gradient bucket and the step's temporaries are held in TRAIN only. A learner that keeps its cache
    holds them in both phases, and the plan counts them so."""
    return (
        cfg.up.gpu_share == "phased" and registry.of(cfg.weights).shares_device and cfg.learner.gpu_cache == "release"
    )


def merge_term(cfg: RunConfig, shape: Shape) -> Term:
    """[learner.lora] serve = "merged": what merging each version takes beside the weights, one
    projection at a time (learner.lora.merged_sum: W + scaling * B @ A summed in one fp32 tensor).
    Into a GPU buffer (cuda_ipc, nccl, packed deltas) each is merged in the buffer itself
    (learner.lora.merge_into); on its way to the host (a file transport) it is also rounded to the
    training dtype (p B) before the copy."""
    largest = max(shape.adapted_tensors(cfg.learner.lora.target_modules))
    if registry.of(cfg.weights).gpu or packed_deltas(cfg):
        return Term(
            f'merging the adapter (learner.lora.serve = "merged"): in the publication buffer, one projection '
            f"at a time: its fp32 sum ({_m(largest)} params)",
            _gib(FP32 * largest),
        )
    p = learner_dtype_bytes(cfg)
    return Term(
        f'merging the adapter (learner.lora.serve = "merged"): one projection at a time to the host, '
        f"its fp32 sum and its {p} B copy ({_m(largest)} params)",
        _gib((FP32 + p) * largest),
    )


def reference_terms(cfg: RunConfig, shape: Shape) -> list[Term]:
    """`parley reference` (services/reference/server.py): the frozen weights in the learner's dtype, and one
    trajectory's forward without grad: one layer's temporaries and one lm_head chunk's logits."""
    p, t = learner_dtype_bytes(cfg), cfg.actor.engine.max_model_len
    chunk = min(cfg.learner.logit_chunk_tokens, t)
    return [
        Term(f"reference weights: {p} B x {_m(shape.params)} params", _gib(p * shape.params)),
        Term(
            f"one trajectory's forward: {t} tokens x {shape.layer_activation_bytes()} B + "
            f"{LOGIT_COPIES} x {FP32} B x {chunk} x {shape.vocab} logits",
            _gib(t * shape.layer_activation_bytes() + LOGIT_COPIES * FP32 * chunk * shape.vocab),
        ),
        Term("CUDA context", CUDA_CONTEXT_GIB),
    ]


def _local_engines(cfg: RunConfig) -> list[tuple[str, str, EngineConfig]]:
    """(process, the section whose engine it runs, that engine) of every service vLLM engine up starts."""
    out = []
    for name in service_children(cfg):
        if name == "services":
            section, ec = shared_engine(cfg)
            out.append(("services (sim + judge)", section, ec))
        elif name in ("sim", "judge") and getattr(cfg, name).backend == "vllm":  # an openai backend is elsewhere
            out.append((name, name, getattr(cfg, name).engine))
    return out


def packed_deltas(cfg: RunConfig) -> bool:
    """[weights] delta_format = "packed" with deltas on (full_every > 1): rank 0 keeps two packed
    versions on its GPU and every actor's engine a packed copy of what it serves."""
    return getattr(cfg.weights, "delta_format", "file") == "packed" and getattr(cfg.weights, "full_every", 1) > 1


def uses_gpu(cfg: RunConfig) -> bool:
    """Whether the config puts something on a GPU by its own words: a vLLM engine with a
    gpu_memory_utilization, or in half precision (a GPU engine given an explicit kv_cache_bytes, as
    every shipped GPU config's is; the CPU configs' engines are float32), a [weights] transport that
    needs CUDA, or a GPU size for the plan (up.gpu_memory_gib)."""
    engines = [cfg.actor.engine, *(ec for _, _, ec in _local_engines(cfg))]
    return (
        any(ec.gpu_memory_utilization > 0 or ec.dtype in HALF for ec in engines)
        or registry.of(cfg.weights).needs_cuda
        or cfg.up.gpu_memory_gib > 0
    )


HALF = ("bfloat16", "float16")  # engine dtypes of a GPU (EngineConfig.dtype: float32 on CPU)


def processes(cfg: RunConfig) -> list[Proc]:
    """Every process `parley up` starts that holds GPU memory, in start order (nats-server and the
    scorers hold none)."""
    shapes: dict[str, Shape] = {}

    def shape_of(name: str) -> Shape:
        if name not in shapes:
            shapes[name] = model_shape(name)
        return shapes[name]

    ctx = Term("CUDA context", CUDA_CONTEXT_GIB)
    procs = [Proc(name, (*engine_terms(ec, shape_of), ctx)) for name, _, ec in _local_engines(cfg)]
    policy = shape_of(cfg.policy.model)
    if "reference" in service_children(cfg):
        procs.append(Proc("reference", tuple(reference_terms(cfg, policy))))
    transport = registry.of(cfg.weights)
    staging = []
    if transport.receives_copy:  # nccl receives a version into the worker's own buffer before loading it
        packed = policy.packed_bytes(learner_dtype_bytes(cfg))
        staging = [Term(f"{transport.kind}: its copy of a version while it loads", _gib(packed))]
    if packed_deltas(cfg):  # the engine's packed copy of what it serves, outside vLLM's own share
        packed = policy.packed_bytes(learner_dtype_bytes(cfg))
        staging = [Term('its packed copy of the served weights (weights.delta_format = "packed")', _gib(packed))]
    # (cuda_ipc loads from the learner's buffer itself within the hold time: no copy is planned; a
    # reader that comes later copies it first, and if that does not fit the load is tried again)
    level = cfg.actor.sleep_level_served(cfg.weights) if cfg.up.gpu_share == "phased" else 0
    actor = (*engine_terms(cfg.actor.engine, shape_of, level), *staging, ctx)
    procs += [Proc(f"actor-{i}", actor) for i in range(cfg.up.most_actors())]
    if cfg.learner.eval_every > 0:
        from parley.evaluation.commands import eval_engine

        procs.append(
            Proc("eval (periodic, [actor.engine])", (*engine_terms(eval_engine(cfg.actor.engine), shape_of), ctx))
        )
    procs.append(Proc("learner", tuple(learner_terms(cfg, policy))))
    return procs


def knobs(cfg: RunConfig, procs: list[Proc], total: float) -> list[str]:
    """What to turn, with each knob's value and what it costs now."""
    lc, policy = cfg.learner, model_shape(cfg.policy.model)
    engines = cfg.up.most_actors() + (lc.eval_every > 0)
    u = cfg.actor.engine.gpu_memory_utilization
    out = []
    eval_part = " and the periodic eval's" if lc.eval_every > 0 else ""
    if u > 0:
        out.append(
            f"actor.engine.gpu_memory_utilization = {u:g} (each of the {cfg.up.most_actors()} actors' engines{eval_part}: "
            f"{engines} x {u * total:.2f} GiB)"
        )
    else:
        kv = cfg.actor.engine.kv_cache_bytes
        out.append(
            f"actor.engine.kv_cache_bytes = {kv} (each of the {cfg.up.most_actors()} actors' engines{eval_part}: "
            f"{engines} x {_gib(kv):.2f} GiB of KV cache)"
        )
    out.append(f"up.actors = {cfg.up.most_actors()}" + (" (up.max_actors: --actors auto)" if cfg.up.autoscale else ""))
    for name, section, ec in _local_engines(cfg):
        if ec.gpu_memory_utilization > 0:
            out.append(
                f"{section}.engine.gpu_memory_utilization = {ec.gpu_memory_utilization:g} ({name}: "
                f"{ec.gpu_memory_utilization * total:.2f} GiB)"
            )
        else:
            out.append(
                f"{section}.engine.kv_cache_bytes = {ec.kv_cache_bytes} ({name}: {_gib(ec.kv_cache_bytes):.2f} GiB "
                "of KV cache)"
            )
    if lc.eval_every > 0:
        ev = next(p for p in procs if p.name.startswith("eval "))
        out.append(
            f"learner.eval_every = {lc.eval_every} (0: no periodic eval, whose process takes "
            f"{ev.gib + ev.share * total:.2f} GiB)"
        )
    act = sum(t.gib for t in activation_terms(cfg, policy, lc.gradient_checkpointing))
    line = f"learner.micro_batch_tokens = {lc.micro_batch_tokens} (activations and logits {act:.2f} GiB)"
    if not lc.gradient_checkpointing:
        ckpt = sum(t.gib for t in activation_terms(cfg, policy, True))
        line += f", or learner.gradient_checkpointing = true ({ckpt:.2f} GiB)"
    out.append(line)
    if registry.of(cfg.weights).gpu:
        out.append(
            f"weights.max_buffers = {cfg.weights.max_buffers} "
            f"({_gib(policy.packed_bytes(learner_dtype_bytes(cfg))):.2f} GiB each on the learner)"
        )
    if cfg.up.gpu_memory_gib:
        out.append(f"up.gpu_memory_gib = {cfg.up.gpu_memory_gib:g}, if the GPU has more (0 asks torch.cuda)")
    return out


@functools.cache  # asked once a process: gpu_share = "auto" plans twice before the plan that is shown
def detect_gpu_gib() -> float | None:
    """The first visible GPU's total memory in GiB, asked of the CUDA driver in a short child process
    (deploy/cuda_driver: no import of torch, and `parley up` itself holds no CUDA context for the whole
    run); None without CUDA. Where the driver cannot say, torch.cuda is asked as before."""
    from parley.deploy.cuda_driver import total_bytes

    total = total_bytes()
    if total is None or isinstance(total, int):
        return total / GIB if total else None
    log.warning("the CUDA driver could not give the GPU's total memory (%s); asking torch.cuda", total)
    return _torch_gpu_gib()


def _torch_gpu_gib() -> float | None:
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        total = int(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return total / GIB if total > 0 else None


def make_plan(cfg: RunConfig) -> Plan | None:
    """The plan of this config (None when it puts nothing on a GPU); the total from up.gpu_memory_gib,
    else the CUDA driver (detect_gpu_gib). Raises PlanError when a model's shape cannot be read."""
    if not uses_gpu(cfg):
        return None
    if cfg.up.gpu_memory_gib > 0:
        total, source = cfg.up.gpu_memory_gib, "up.gpu_memory_gib"
    else:
        total, source = detect_gpu_gib(), "the CUDA driver, device 0"  # torch.cuda's total_memory, the same figure
    chosen: tuple = ()
    phased = cfg.up.gpu_share == "phased"
    if cfg.learner.gradient_checkpointing == "auto":
        # off when everything fits without recompute (the step is a third cheaper), else on; on while
        # the GPU's total is unknown
        off = with_settings(cfg, {"learner.gradient_checkpointing": False})
        need = gpu_need(processes(off), total or 0.0, phased)
        recompute = total is None or need > total * (1 - HEADROOM)
        chosen = (("learner.gradient_checkpointing", recompute),)
        cfg = with_settings(cfg, dict(chosen))
    procs = processes(cfg)
    knobs_ = tuple(knobs(cfg, procs, total)) if total is not None else ()
    plan = Plan(tuple(procs), total, source, knobs_, chosen, phased=phased, notes=tuple(kv_demand_notes(cfg)))
    if plan.fits is False:
        plan = replace(plan, fixes=tuple(fixes(cfg, total)))
    return plan


def with_settings(cfg, changes: dict[str, object]):
    """`cfg` with each dotted key set to its value (as `--set key=value` would): every section rebuilt
    once with all of its changes, so its checks see them together."""
    fields: dict[str, dict[str, object]] = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        fields.setdefault(head, {})[rest] = value
    return msgspec.structs.replace(
        cfg,
        **{head: with_settings(getattr(cfg, head), sub) if "" not in sub else sub[""] for head, sub in fields.items()},
    )


def _learner_changes(cfg: RunConfig) -> list[tuple[tuple[str, object], ...]]:
    """The changes of the learner's memory the plan tries when a run does not fit, fewest first:
    the optimizer state on the host, a LoRA adapter instead of every weight, layers recomputed in
    backward, the optimizer's state in bf16 (learner.master_dtype: updates below half a bf16 step are
    lost), and each of the others with recompute. Each change carries what it needs besides
    (ZeRO 1-3 for the offload; compile not "layers" and an actor that serves the rank for LoRA, or
    serve = "merged" where the transport or the delta format carries whole weights only)."""
    lc, out = cfg.learner, []
    offload: tuple = ()
    stage: tuple = (("learner.zero_stage", 2),) if lc.zero_stage == 0 else ()
    if lc.offload_optimizer == "none" and not lc.lora.enabled:
        # the host's step keeps fp32 state: a bf16 master goes back to fp32 with it
        fp32 = (("learner.master_dtype", "float32"),) if lc.master_dtype == "bfloat16" else ()
        offload = stage + (("learner.offload_optimizer", "cpu"),) + fp32
    master: tuple = ()
    if lc.master_dtype == "float32" and lc.offload_optimizer == "none" and lc.dtype != "float32":
        master = stage + (("learner.master_dtype", "bfloat16"),)
    lora: tuple = ()
    transport = registry.of(cfg.weights)
    if not lc.lora.enabled:
        lora = (("learner.lora.enabled", True),)
        lora += (("learner.compile", "auto"),) if lc.compile == "layers" else ()
        rank = lc.lora.rank
        if transport.carries_adapters and not packed_deltas(cfg):
            lora += (("actor.engine.max_lora_rank", rank),) if cfg.actor.engine.max_lora_rank < rank else ()
        else:  # whole weights travel here (nccl, packed deltas): the adapter merged into them, to plain engines
            lora += (("learner.lora.serve", "merged"),)
            lora += (("actor.engine.max_lora_rank", 0),) if cfg.actor.engine.max_lora_rank else ()
    ckpt = () if lc.gradient_checkpointing else (("learner.gradient_checkpointing", True),)
    for change in (offload, lora, ckpt, master):
        if change:
            out.append(change)
    if ckpt:
        out += [c + ckpt for c in (offload, lora, master) if c]
    return out


def fixes(cfg: RunConfig, total: float) -> list[Fix]:
    """Each of _learner_changes planned in full at `total` GiB: what the GPU needs with it, and the
    host memory it takes when it moves state there."""
    out = []
    for change in _learner_changes(cfg):
        procs = processes(with_settings(cfg, dict(change)))
        need = gpu_need(procs, total, cfg.up.gpu_share == "phased")
        host = sum(p.host_gib for p in procs)
        out.append(Fix(change, need, f" (and {host:.2f} GiB of host memory)" if host else ""))
    return out


# A version's share beyond its tensors (config.json, safetensors headers, object-store chunk headers)
_VERSION_OVERHEAD = 1.02
_VERSION_SLACK = 64 * 1024**2


def version_bytes(cfg: RunConfig) -> int:
    """What one published version of the policy takes in the weights object store: its tensors in
    the learner's dtype ("auto" is fp32 on a CPU-only run, bf16 where a GPU is; learner.trainer),
    plus its delta (at most delta_max_share of it) when deltas are on. 0 when the model's shape is
    unknown here (a Hub id not in the cache)."""
    try:
        shape = model_shape(cfg.policy.model)
    except PlanError:
        return 0
    dtype = 4 if cfg.learner.dtype == "float32" or (cfg.learner.dtype == "auto" and not uses_gpu(cfg)) else 2
    full = dtype * shape.params
    if getattr(cfg.weights, "full_every", 1) > 1:
        full += int(full * cfg.weights.delta_max_share)
    return int(full * _VERSION_OVERHEAD) + _VERSION_SLACK


def blobs_max_bytes(cfg: RunConfig) -> int:
    """[bus] blobs_max_bytes when 0: with a transport that stores versions on the bus (objstore), room for the kept versions
    (keep_versions), the one being uploaded, and one more (a delete whose purge is still running); 0
    when version_bytes is unknown. Other kinds store nothing there: topology.UNUSED_BLOBS_MAX_BYTES."""
    if not registry.of(cfg.weights).stores_on_bus:
        return topology.UNUSED_BLOBS_MAX_BYTES
    one = version_bytes(cfg)
    return one * (cfg.learner.keep_versions + 2) if one else 0
