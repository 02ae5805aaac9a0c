"""The policy under DeepSpeed: the process group, the DeepSpeed config for [learner], the frozen
reference and one GRPO optimizer step over packed micro-batches. Built by learner.service (every
rank) and the tests; torch at the top, DeepSpeed and transformers where a Trainer is built."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from pathlib import Path

import torch
from torch import Tensor

from parley.config.learner import LearnerConfig, compile_mode, compiles_layers
from parley.config.policy import Reference
from parley.learner import attention, grpo
from parley.learner.flops import shape_of as flops_shape
from parley.learner.flops import train_flops
from parley.learner.logprobs import PackedPolicy, token_logprobs
from parley.learner.lora import (
    adapter_config,
    adapter_params,
    adapter_state,
    add_adapters,
    base_only,
    lora_layers,
    merge_into,
    merged_tensors,
)
from parley.learner.packing import PackedBatch, Sample, build_batch, pack_by_tokens, shard_by_tokens
from parley.learner.steplog import PHASES
from parley.weights import registry
from parley.weights.config import ObjstoreWeights, WeightsConfig
from parley.weights.snapshot import PackedSnapshot, WeightSnapshot, hf_tensors, hf_weights, write_weights


def resolve_dtype(name: str) -> torch.dtype:
    """ "auto": bf16 on GPU, fp32 on CPU (bf16 matmuls are slow and inexact on this CPU)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_cpu_shm_build() -> bool:
    """Keep DeepSpeed from building its shared-memory all-reduce op (deepspeed_shm_comm) on CPU.

    DeepSpeed JIT-compiles that op into ~/.cache/torch_extensions the first time a CPU process group
    starts, behind a lock file. A learner killed while compiling (SIGKILL, the OOM killer) leaves the
    lock behind, and every later learner on the machine then waits on it forever; under load the
    compile alone took ~10 min. gloo does the learner's collectives without it (it only speeds up
    multi-rank CPU all-reduce, which parley's CPU path does not depend on). Returns whether the op
    was marked unusable."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return False
    deepspeed.ops.__compatible_ops__[builder.NAME] = False  # one cached dict: the edit holds for this process
    return True


def init_distributed() -> None:
    """One process with gloo on CPU (env filled in when absent); under the deepspeed launcher or
    torchrun the env is already set and NCCL is used on GPUs."""
    import deepspeed

    if not torch.cuda.is_available():
        skip_cpu_shm_build()

    # A launcher (torchrun, the deepspeed launcher) owns the rendezvous when it runs several ranks.
    # A single process picks its own port even if MASTER_PORT was inherited: a parent that ran a
    # learner in-process (a test, a notebook) still holds that port.
    launched = "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1
    chosen_here = not launched
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    for attempt in range(5):
        if chosen_here:
            # A port found free can be taken by a neighbour (a vLLM engine starting beside us)
            # before the store binds it: pick another and try again.
            os.environ["MASTER_PORT"] = str(_free_port())
        try:
            deepspeed.init_distributed(dist_backend=backend)
            return
        except torch.distributed.DistNetworkError as e:
            if not chosen_here or "EADDRINUSE" not in str(e) or attempt == 4:
                raise


def ds_config(cfg: LearnerConfig, dtype: torch.dtype) -> dict:
    """The DeepSpeed config for [learner]. Gradient accumulation is driven by us: one step() per
    GRPO step after as many backward() calls as the step has micro-batches (unmanaged mode)."""
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    if not torch.cuda.is_available():
        # DeepSpeed's default buckets hold 5e8 elements (2 GB in fp32 each): sized for GPUs. On a
        # CPU machine beside vLLM engines that is the difference between fitting and the OOM killer.
        zero.update(reduce_bucket_size=int(5e7), allgather_bucket_size=int(5e7))
    offload = cfg.offload_optimizer == "cpu"
    if offload:
        # ZeRO-Offload: the fp32 master weights, Adam's m and v and the fp32 gradients in pinned host
        # memory, the step on the host. The optimizer stays torch's AdamW ("torch_adam" below): with an
        # optimizer named in this config DeepSpeed takes it as given (zero_force_ds_cpu_optimizer only
        # refuses a client-built one), and DeepSpeedCPUAdam would be JIT-compiled at the first start,
        # which needs a C++ compiler on the GPU machine and leaves a lock file behind when killed
        # (skip_cpu_shm_build says what that costs). torch's fused AdamW has a CPU kernel: one pass.
        zero.update(offload_optimizer={"device": "cpu", "pin_memory": True})
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        # check_grad_overflow: a non-finite gradient skips the step (see Trainer._apply_if_finite).
        # master_dtype bfloat16: the optimizer's partition of the weights, its gradients and Adam's state in
        # bf16 ([learner] master_dtype says what that costs)
        "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": True}
        | (
            {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
            if cfg.master_dtype == "bfloat16"
            else {}
        ),
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: DeepSpeed's own CPU/fused kernels need a compiler toolchain (CPU) or
            # a build (GPU); torch's fused implementation is as fast on a GPU.
            "params": {
                "lr": cfg.lr,
                "weight_decay": cfg.weight_decay,
                "betas": [0.9, 0.999],
                "torch_adam": True,
                "fused": torch.cuda.is_available() or offload,
            },
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init work) and
    their buffers for real: enough to read what a model's constructor computes for its buffers."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def restore_computed_buffers(model, dtype: torch.dtype) -> int:
    """Put back the buffers a model computes in its constructor instead of loading them (the
    non-persistent ones: RoPE's inv_freq, ...), as a plain from_pretrained has them. Returns how
    many differed.

    Under ZeRO-3, transformers builds the model inside deepspeed.zero.Init, which turns every
    floating tensor made by torch.arange / torch.ones / ... into the training dtype. RoPE computes
    inv_freq from torch.arange(..., dtype=torch.float): under bf16 it comes out in bf16, so every
    rotation angle position * inv_freq is off by up to 2^-9 relative, and from a few hundred
    positions on the attention pattern differs from the saved model's. On the H200 that was a
    k3 KL to the (plainly loaded) reference of 0.35-0.40 at the first step, against 0.001 with
    ZeRO-2. No checkpoint holds these buffers, so loading cannot repair them: they are recomputed
    here by building the same architecture with its parameters on the meta device.
    """
    with _parameters_on_meta():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # what from_pretrained(dtype=...) sets while it builds
        try:
            skeleton = type(model)(model.config)
        finally:
            torch.set_default_dtype(previous)
    differed = 0
    for name, fresh in skeleton.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf not in owner._non_persistent_buffers_set:
            continue  # a persistent buffer comes from the checkpoint
        current = owner._buffers[leaf]
        if current is not None and current.dtype == fresh.dtype and torch.equal(current.cpu(), fresh):
            continue
        differed += 1
        owner._buffers[leaf] = fresh.to(current.device if current is not None else "cpu")
    return differed


def compile_layers(model, mode: str, device: torch.device, zero_stage: int) -> bool:
    """torch.compile each decoder layer of `model` in place ([learner] compile). The norms, rotary
    embedding, residual adds and SwiGLU around the matmuls fuse into fewer kernels; the attention
    function stays eager (learner.attention.packed_attention is excluded from tracing: a graph break
    per layer). One dynamic-shape graph serves every layer and every micro-batch length. Which modes
    compile where: config.learner.compiles_layers ("auto" on CUDA under ZeRO 0-2 only). Returns
    whether the layers were compiled."""
    if not compiles_layers(mode, device.type == "cuda", zero_stage):
        return False
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(
            f"[learner] compile={mode!r}: {type(model.base_model).__name__} has no `layers` list to "
            'compile; set compile = "off"'
        )
    for layer in layers:
        layer.compile(dynamic=True)
    return True


RELEASE_VERSIONS = 2  # versions' bytes of free GPU memory the learner leaves its actors (cache_release_needed)


def cache_release_needed(free_bytes: int, version_bytes: int) -> bool:
    """Under [learner] gpu_cache = "keep_when_room": whether a learner that shares its GPU with the
    actors must still hand its cached blocks back after a step: when the GPU's free memory is under
    RELEASE_VERSIONS copies of a version plus 1 GiB of working room, what actors copying the next
    version need (at the 4B shape the cached peak left too little free for an actor's copy of a
    version, and every one was refused). Releasing costs every step: the driver frees the blocks and the
    next step allocates them again (docs/gpu.md, "The memory plan", has the figures)."""
    return free_bytes < RELEASE_VERSIONS * version_bytes + (1 << 30)


class Trainer:
    """The policy under DeepSpeed, an optional frozen reference for KL (kl_coef > 0 and reference =
    "local"), and the GRPO step."""

    def __init__(
        self,
        cfg: LearnerConfig,
        model_dir: str | Path,
        *,
        reference: Reference = "local",
        weights: WeightsConfig | None = None,
    ):
        """`reference` is the run's [policy] reference: "local" loads a frozen copy when kl_coef > 0.
        `weights` is the run's [weights] (objstore when None): a GPU transport packs versions on rank 0."""
        weights = weights if weights is not None else ObjstoreWeights()
        transport = registry.of(weights)
        if transport.needs_cuda and not torch.cuda.is_available():
            raise ValueError(
                f"[weights] kind={transport.kind!r} shares GPU memory, but this learner has no "
                "CUDA device; use kind objstore or shared_dir"
            )
        dtype = resolve_dtype(cfg.dtype)
        if cfg.master_dtype == "bfloat16" and dtype != torch.bfloat16:  # dtype "auto" on a machine without CUDA
            raise ValueError(
                f'[learner] master_dtype = "bfloat16" but this learner trains in {dtype} (dtype = "{cfg.dtype}" '
                'without a GPU): set dtype = "bfloat16", or master_dtype = "float32"'
            )
        import deepspeed
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        init_distributed()
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        torch.manual_seed(cfg.seed)
        conf = ds_config(cfg, self.dtype)
        device = (
            torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
        )
        # Before the ZeRO-3 loading hook exists (the guard builds a small plain model).
        attn, self.attention = attention.resolve(cfg.attention, device)
        if attn == "sdpa":
            attention.check_packing_isolated(AutoConfig.from_pretrained(self.model_dir))

        self.reference = None
        if cfg.kl_coef > 0 and reference == "local" and not cfg.lora.enabled:
            # A plain second copy of the initial weights, forward only; loaded before ZeRO-3's
            # partitioning hook (below) exists, so it stays whole. With reference = "service" the
            # samples bring their reference log-probs (computed off the training GPUs).
            ref = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype, attn_implementation="sdpa")
            attention.use(ref, attn)
            # compiled exactly when the policy is: the same kernels on the same weights give a step-0 KL
            # of exactly 0 (a compiled reference beside an eager ZeRO-3 policy differs in bf16 log-probs:
            # docs/benchmarks.md, "Learner step on the GPU")
            compile_layers(ref, cfg.compile, device, cfg.zero_stage)
            self.reference = ref.to(device).eval().requires_grad_(False)

        # With ZeRO-3, from_pretrained partitions parameters while loading when this object is alive.
        self._hf_ds = HfDeepSpeedConfig(conf) if cfg.zero_stage == 3 else None
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype, attn_implementation="sdpa")
        if cfg.zero_stage == 3:
            restore_computed_buffers(model, self.dtype)
        attention.use(model, attn)
        # [learner.lora]: adapters in place; the frozen base (adapters off) is the local reference
        self.peft = add_adapters(model, cfg.lora) if cfg.lora.enabled else None
        self._lora_layers = lora_layers(model) if self.peft is not None else {}  # merged_tensors's, found once
        self._adapter = (
            None  # _adapter_tensors's (trained parameters, (saved name, parameter) list or None), found once
        )
        self._packed = None  # pack_versions's weights.gpu_delta.PackedVersions on rank 0, built at its first call
        if self.peft is not None and cfg.kl_coef > 0 and reference == "local":
            self.reference = model
        self.compiled = compile_layers(model, compile_mode(cfg), device, cfg.zero_stage)
        model.config.use_cache = False
        if cfg.gradient_checkpointing in (True, "auto"):  # "auto" unresolved by `parley up`: on, the safe side
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        warmup = cfg.warmup_steps

        def schedule(optimizer):
            # linear warm-up to lr over warmup_steps optimizer steps (the first step already moves), then constant
            return torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
            )

        self.engine, _, _, _ = deepspeed.initialize(
            model=PackedPolicy(
                model,
                cfg.logit_chunk_tokens,
                equal_chunks=cfg.zero_stage == 3 and torch.distributed.get_world_size() > 1,
            ),
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=conf,
            lr_scheduler=schedule,
        )
        self.device = self.engine.device
        self.rank = torch.distributed.get_rank()
        # rank 0's packer of weight buffers for the GPU transports (no file on that path)
        self.sender = transport.sender(weights, device) if self.rank == 0 and transport.gpu else None
        # On a GPU the actors' engines share (cuda_ipc), the memory this step cached is handed back
        # after it: PyTorch keeps the peak of a step reserved, and at the 4B shape that left too
        # little free for an actor to copy the next version, so every one was refused. The next step
        # allocates it again (docs/gpu.md, "The memory plan"). Under gpu_cache =
        # "keep_when_room" only when the GPU runs short (cache_release_needed).
        self.release_cache = transport.shares_device and getattr(device, "type", str(device)) == "cuda"
        # for the step's model FLOPs (learner.flops): parameters once each (a tied lm_head once; ZeRO-3's
        # partitioned ones by their full size)
        self.n_params = sum(getattr(p, "ds_numel", 0) or p.numel() for p in self.module.parameters())

    def close(self) -> None:
        """Forget the ZeRO-3 loading hook: later from_pretrained calls in this process load plain
        models. Stops the GPU transport's sender (the nccl sender's threads)."""
        self._hf_ds = None
        if self.sender is not None:
            self.sender.close()

    @property
    def module(self):
        """The HF model being trained (state-dict names are the checkpoint's)."""
        return self.engine.module.model

    def _policy_logprobs(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        return self.engine(batch.input_ids, batch.position_ids, batch.src, batch.targets, batch.inv_temp)

    # -- the GRPO step --------------------------------------------------------------------------

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Forward/backward every micro-batch of this rank's share of `samples`, then one optimizer step.

        Every rank is given the same `samples` and trains a token-balanced shard of them. Each
        micro-batch's loss is weighted by its share of the step's tokens (token-mean) or sequences
        (seq-mean modes), so the accumulated gradient is that of the step's loss as a whole,
        however the sequences were sharded and packed.
        """
        cfg = self.cfg
        if cfg.kl_coef > 0 and self.reference is None:
            missing = [s.traj_id for s in samples if s.ref is None]
            if missing:  # before any backward: a refused step leaves no gradient behind
                raise ValueError(
                    f"policy.reference='service' but {len(missing)} sample(s) ({missing[:3]}) carry no "
                    "reference log-probs (Sample.ref); the scorer fills them in from the reference service"
                )
        t0 = time.perf_counter()
        self.engine.train()
        world = torch.distributed.get_world_size()
        mine = [samples[i] for i in shard_by_tokens([len(s.token_ids) for s in samples], world)[self.rank]]
        micro = pack_by_tokens([len(s.token_ids) for s in mine], cfg.micro_batch_tokens)
        n_tokens = sum(s.n_trained for s in samples)
        n_seqs = sum(1 for s in samples if s.n_trained)
        if n_tokens == 0:
            raise ValueError("no trained token in this step's samples")
        n_micro = len(micro)
        if world > 1:
            # ZeRO reduces gradients inside backward(): every rank must run as many of them.
            count = torch.tensor([n_micro], device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            n_micro = int(count.item())
        sums: dict[str, float] = {}
        seen = 0
        finite_loss = True
        # host seconds per phase, summed over micro-batches (PHASES); a phase that reads a value back
        # from the GPU also waits there for the work queued before it
        phase = dict.fromkeys(PHASES, 0.0)
        for i in range(n_micro):
            if i >= len(micro):
                t = time.perf_counter()
                self._idle_backward()
                phase["backward_s"] += time.perf_counter() - t
                continue
            t = time.perf_counter()
            batch = build_batch([mine[j] for j in micro[i]], self.device)
            n = batch.n_loss_tokens
            if n == 0:
                t_backward = time.perf_counter()
                phase["forward_s"] += t_backward - t
                self._idle_backward()
                phase["backward_s"] += time.perf_counter() - t_backward
                continue
            logp, entropy = self._policy_logprobs(batch)
            ref = None
            if self.reference is not None:
                with base_only(self.peft):
                    ref, _ = token_logprobs(self.reference, batch, cfg.logit_chunk_tokens, grad=False)
            elif cfg.kl_coef > 0:  # reference = "service": what the reference service computed for each token
                ref = batch.ref
            loss, st = grpo.batch_loss(logp, batch, cfg, ref)
            share = n / n_tokens if cfg.loss_agg == "token-mean" else len(set(batch.seq.tolist())) / n_seqs
            # Still backward when it is not finite: the non-finite gradient is what makes the optimizer
            # skip the step on every rank (_apply_if_finite), and the ranks' collectives stay in step.
            finite_loss = finite_loss and bool(torch.isfinite(loss.detach()))
            t_backward = time.perf_counter()
            phase["forward_s"] += t_backward - t
            # DeepSpeed averages gradients over ranks; the shares already sum to 1 over all ranks.
            self.engine.backward(loss * share * world)
            t = time.perf_counter()
            phase["backward_s"] += t - t_backward
            st.update(
                loss=float(loss.detach()),
                entropy=float(entropy.mean()),
                logp_mismatch=float((logp.detach() - batch.behaviour).abs().mean()),
            )
            for k, v in st.items():
                if k.endswith("_max"):
                    sums[k] = max(sums.get(k, float("-inf")), v)
                else:
                    sums[k] = sums.get(k, 0.0) + v * n
            seen += n
            phase["readback_s"] += time.perf_counter() - t
        t = time.perf_counter()
        applied, grad_norm = self._apply_if_finite()
        phase["optimizer_s"] = time.perf_counter() - t
        stats = {k: (v if k.endswith("_max") else v / max(seen, 1)) for k, v in sums.items()}
        if applied and not finite_loss:
            # Cannot happen (a non-finite loss gives non-finite gradients); if it did, the weights may be
            # damaged: stop rather than train on and publish them.
            raise RuntimeError("the optimizer applied a step whose loss was not finite; the weights cannot be trusted")
        t = time.perf_counter()
        released = self._release_cache()
        phase["release_s"] = time.perf_counter() - t
        elapsed = time.perf_counter() - t0
        total_tokens = sum(len(s.token_ids) for s in samples)
        flops = train_flops(
            self.n_params,
            *flops_shape(self.module.config),
            (len(s.token_ids) for s in samples),
            frozen_base=self.peft is not None,
            reference_forward=self.reference is not None,
        )
        stats.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            skipped=0.0 if applied else 1.0,  # learner.stepper dead-letters a skipped step's groups
            lr=float(self.engine.get_lr()[0]),
            tokens=float(total_tokens),
            trained_tokens=float(n_tokens),
            sequences=float(len(samples)),
            micro_batches=float(n_micro),
            train_s=elapsed,
            **phase,
            tokens_per_s=total_tokens / elapsed,
            # the step's model FLOPs per second per rank (learner.flops: the policy's, and a local reference's forward)
            model_tflops_per_s=flops / elapsed / 1e12 / torch.distributed.get_world_size(),
        )
        if released is not None:
            stats.update(cache_released_gib=released[0], reserved_gib=released[1], peak_allocated_gib=released[2])
        return stats

    def _release_cache(self) -> tuple[float, float, float] | None:
        """With `release_cache`: hand PyTorch's cached blocks back to the driver (under gpu_cache =
        "keep_when_room" only when the actors would run short); (GiB released, GiB still reserved, GiB
        allocated at this step's peak), or None."""
        if not self.release_cache:
            return None
        gib = 1024**3
        before = torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated()
        keep = self.cfg.gpu_cache == "keep_when_room" and not cache_release_needed(
            torch.cuda.mem_get_info(self.device)[0], getattr(self.sender, "total", 0) or 2 * self.n_params
        )  # before the first pack: bf16 bytes
        if not keep:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        after = torch.cuda.memory_reserved()
        return (before - after) / gib, after / gib, peak / gib

    def _apply_if_finite(self) -> tuple[bool, float | None]:
        """The optimizer step, unless a gradient is not finite: (applied, global grad norm).

        ZeRO 1-3 check the global gradient norm inside step() and, when it is not finite, clear the
        gradients and leave weights and optimizer state untouched (their overflow path; bf16 needs
        `check_grad_overflow`, on in ds_config). Without ZeRO the gradients are whole on every rank
        (reduced in backward), so they are checked here before the optimizer sees them, through their
        global norm (one read-back; a non-finite gradient makes it non-finite). That norm is also the one
        reported where DeepSpeed keeps none: its fp32 path without ZeRO clips by a norm it does not store."""
        own = None
        if self.cfg.zero_stage == 0:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            own = (
                float(torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)])))
                if grads
                else 0.0
            )
            if not math.isfinite(own):
                self.engine.zero_grad()
                return False, own
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else own
        return norm is None or math.isfinite(norm), norm

    def warm_up(self) -> float:
        """One zero-weighted forward and backward of a small micro-batch (two sequences), run before the
        first step while the learner waits for its first groups: the compiled layers are traced and
        compiled, and the kernels chosen, off the first step's path (the first compiled step is many
        times a later one: docs/benchmarks.md, "Learner step on the GPU"). The gradient it leaves is exactly zero
        and no optimizer step follows, so the first step trains as it would without it. Every rank
        makes it (the ZeRO reductions in backward). Returns its seconds."""
        t0 = time.perf_counter()
        self.engine.train()
        n = max(2, min(64, self.cfg.micro_batch_tokens // 2))
        pair = [Sample(f"warm-up-{i}", [0] * n, [0] + [1] * (n - 1), [0.0] * n, 0.0) for i in range(2)]
        logp, _ = self._policy_logprobs(build_batch(pair, self.device))
        self.engine.backward(logp.sum() * 0.0)
        return time.perf_counter() - t0

    def _idle_backward(self) -> None:
        """A zero-weighted backward through the whole model, so this rank joins the gradient
        reductions of a micro-batch it has no data for."""
        batch = build_batch([Sample("idle", [0, 0], [0, 1], [0.0, 0.0], 0.0)], self.device)
        logp, _ = self._policy_logprobs(batch)
        self.engine.backward(logp.sum() * 0.0)

    # -- weights and checkpoints ----------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, Tensor]:
        """hf_weights of the trained model on rank 0, {} on the other ranks: only rank 0 writes the
        weights, so only it pays for a CPU copy of the whole model. Every rank must call it (under
        ZeRO-3 the parameters are gathered first, a collective). Under [learner.lora] the policy's
        weights with the adapter merged in (policy_tensors), merged and copied one tensor at a time."""
        import deepspeed

        def copied() -> dict[str, Tensor]:
            if self.rank:
                return {}
            if self.peft is None:
                return hf_weights(self.module)
            return {name: t.to("cpu", copy=True).contiguous() for name, t in self.policy_tensors()}

        if self.cfg.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                return copied()
        return copied()

    def policy_tensors(self):
        """The policy's whole weights under the checkpoint's names, where they are: hf_tensors, or under
        [learner.lora] the base's with the adapter merged in (learner.lora.merged_tensors: a new tensor
        per adapted projection, made as it is taken). Call it where every parameter is whole."""
        return (
            merged_tensors(self.module, self._lora_layers) if self.peft is not None else iter(hf_tensors(self.module))
        )

    def _to_pack(self):
        """(the tensors a packed buffer copies, what then finishes it in place or None): hf_tensors, or
        under [learner.lora] the base's tensors and the merge of each adapter into its projection's copy
        in the buffer (learner.lora.merge_into: no merged copy of the model beside it)."""
        if self.peft is None:
            return hf_tensors(self.module), None
        return merge_into(self.module, self._lora_layers)

    def weights_snapshot(self) -> WeightSnapshot | None:
        """hf_state_dict with the model's config on rank 0 (None on the others): the learner publishes
        it in the background while the next step runs."""
        state = self.hf_state_dict()
        return WeightSnapshot(state, self.module.config.to_json_string()) if self.rank == 0 else None

    def adapter_snapshot(self) -> tuple[dict, dict] | None:
        """[learner.lora]: the adapter's tensors (copied to the CPU) and config on rank 0, None on the
        others; under ZeRO-3 every rank takes part in gathering the adapter's parameters. Read from the
        parameters found once (_adapter_tensors), not from a walk of peft's state dict each version."""
        return self._adapter_tensors(lambda state, conf: ({k: v.to("cpu", copy=True) for k, v in state}, conf))

    def pack_adapter(self, version: int):
        """[learner.lora] under cuda_ipc: the adapter's tensors packed into one of rank 0's GPU buffers
        (pack_weights for the adapter alone). (the CudaIpcBuffer to announce, the adapter's config) on
        rank 0, or (None, config) when every buffer is still held; None on the other ranks."""
        return self._adapter_tensors(lambda state, conf: (self.sender.pack(state, version), conf))

    def _adapter_tensors(self, use):
        """use(the adapter's (saved name, tensor) pairs sorted by name, its config) on rank 0, where the
        tensors are the trained parameters themselves (detached, no copy) and whole; None on the other
        ranks, which take part in the ZeRO-3 gather. The parameters are found once
        (learner.lora.adapter_params; peft's state-dict walk over the 4B shape's ~900 tensors took
        0.08-0.09 s a call), or walked each time when peft saves something that is no parameter."""
        import contextlib

        import deepspeed

        trained = (
            [p for p in self.module.parameters() if p.requires_grad] if self._adapter is None else self._adapter[0]
        )
        gather = (
            deepspeed.zero.GatheredParameters(trained, modifier_rank=None)
            if self.cfg.zero_stage == 3
            else contextlib.nullcontext()
        )
        with gather:
            if self.rank:
                return None
            if self._adapter is None:  # inside the gather: the parameters are whole (adapter_params)
                self._adapter = (trained, adapter_params(self.peft))
            params = self._adapter[1]
            if params is None:
                state, conf = adapter_state(self.peft, device=None)
                return use(sorted(state.items()), conf)
            return use([(name, p.detach()) for name, p in params], adapter_config(self.peft))

    def save_weights(self, out_dir: str | Path) -> Path:
        """Write model.safetensors + config.json (what publish_version and vLLM's reload read)."""
        out = Path(out_dir)
        state = self.hf_state_dict()  # every rank takes part in the ZeRO-3 gather
        if self.rank == 0:
            write_weights(state, self.module.config, out)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        return out

    def pack_weights(self, version: int):
        """A GPU transport (cuda_ipc, nccl): the trained weights packed into one of rank 0's buffers;
        returns what to announce (protocol.messages.CudaIpcBuffer / NcclSource) on rank 0, None on
        the other ranks (which take part in the ZeRO-3 gather)."""
        import contextlib

        import deepspeed

        gather = (
            deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)
            if self.cfg.zero_stage == 3
            else contextlib.nullcontext()
        )
        with gather:
            if self.rank:
                return None
            named, finish = self._to_pack()
            return self.sender.pack(named, version, finish=finish)

    def pack_versions(self, version: int, max_share: float | None):
        """[weights] delta_format = "packed": the trained weights packed on the device they train on
        (weights.gpu_delta.PackedVersions, two buffers kept on rank 0), in place of weights_snapshot.
        (the packed table, its weights.snapshot.PackedSnapshot: the delta against the version
        packed before, unless this is the first or `max_share` is None, and the full file, both taken
        from the buffers by the publication) on rank 0, None on the other ranks (which take part in
        the ZeRO-3 gather)."""
        import contextlib

        import deepspeed

        from parley.weights.gpu_delta import PackedVersions

        gather = (
            deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)
            if self.cfg.zero_stage == 3
            else contextlib.nullcontext()
        )
        with gather:
            if self.rank:
                return None
            if self._packed is None:
                self._packed = PackedVersions()
            named, finish = self._to_pack()
            table, pending = self._packed.pack(named, version, max_share, finish=finish)
            return table, PackedSnapshot(pending, self.module.config.to_json_string())

    def weights_writable_in(self) -> float:
        """Seconds until pack_weights would find a GPU buffer it may write on rank 0 (0: now; inf while
        every buffer is being sent from); 0 without GPU buffers (a file transport, or another rank)."""
        return self.sender.writable_in() if self.sender is not None else 0.0

    def save_checkpoint(self, ckpt_dir: str | Path, tag: str) -> None:
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)

    def load_checkpoint(self, ckpt_dir: str | Path, tag: str) -> None:
        """--resume: the checkpoint `tag` into the engine (weights, optimizer, scheduler). Every file is
        read through learner.checkpoint.safe_load (DeepSpeed's own engine unpickles with
        weights_only=False: a pickle planted in the run directory would run code as it loads), so a
        file holding more than tensors and DeepSpeed's records raises UnsafeCheckpoint naming it."""
        from parley.learner.checkpoint import safe_load

        # DeepSpeed reads every checkpoint file of a (non-universal) load through this one method
        self.engine.checkpoint_engine.load = safe_load
        path, _ = self.engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed checkpoint {tag!r} not found under {ckpt_dir}")
