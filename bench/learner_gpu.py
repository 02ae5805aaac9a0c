"""GPU benchmark of the learner's GRPO step (issue 9): the bf16 matmul peak, a plain PyTorch training
step and the parley learner (learner.trainer.Trainer under DeepSpeed ZeRO-2/3) on the same packed
CollabLLM-like tokens of a Qwen3-4B-shaped model, all in one invocation. Run by hand; bench/README.md
has the device command. Nothing in parley imports this file.

Each measured phase runs in its own child process (this same script with --_phase), so GPU memory is
fully returned between phases, every phase reports its own peak, and a phase that fails or runs out
of time leaves the others' figures intact. The parent measures the matmul peak, computes FLOPs and
MFU from the children's raw timings, prints a markdown table and writes JSON (to $OUT when set).

FLOPs (stated once, used for every row; PaLM-style model FLOPs, recomputation not counted):
  per sequence of s tokens, training (forward + backward) = 6 * N * s + 6 * L * Hq * d * s^2
  (N = parameters, tied embedding counted once; the second term is causal attention,
  12 * L * Hq * d * s^2 / 2), a forward alone is a third of that. Packed sequences attend only
  within themselves, so the attention term is summed per sequence, never over the whole pack.
  The learner's row adds the reference model's forward (KL) to its FLOPs; "policy MFU" leaves it out.
  With --ref service the learner rows run [policy] reference = "service": each sample's reference
  log-probs are computed before the Trainer is built (untimed, the reference service's computation),
  so the step has no reference forward and its FLOPs are the policy's alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a plain script from anywhere: `learner` must import

VARLEN = "parley_varlen"  # learner.attention.VARLEN (kept here so --help imports no torch)
ATTN_CHOICES = ("sdpa", "varlen")
REF_CHOICES = ("local", "service")  # config.policy.REFERENCES
GiB = 2**30
DATASHEET_TFLOPS = 989.4  # dense bf16, H100 SXM and H200: the docs' one MFU denominator


# ---------------------------------------------------------------------------------------------
# arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 36; 2 with --tiny)")
    p.add_argument(
        "--budget-tokens",
        type=int,
        default=None,
        help="token budget of a packed micro-batch (default 8192; 1024 with --tiny)",
    )
    p.add_argument("--step-tokens", type=int, default=None, help="tokens drawn for one GRPO step (default 4 x budget)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them")
    p.add_argument("--zero", default="2,3", help="ZeRO stages to run the learner with, comma-separated ('' for none)")
    p.add_argument(
        "--attn", default="sdpa,varlen", help=f"attention variants, comma-separated, of {list(ATTN_CHOICES)}"
    )
    p.add_argument(
        "--compile",
        default="auto",
        help="learner [learner] compile values to run, comma-separated, of auto, off, layers "
        "(one learner phase per ZeRO stage and value)",
    )
    p.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="after each learner phase's variants, one more step of its fastest under torch.profiler: the "
        "top kernels by device time with counts, the share of the step per kernel kind and the GPU's idle "
        "gaps (in the JSON; with DIR also DIR/profile_<phase>.json, and one gzipped trace under 5 MiB)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        default=None,
        help="[learner] micro_batch_tokens values to run in each learner phase, comma-separated "
        "(default: --budget-tokens); one Trainer per phase, the values as its variants",
    )
    p.add_argument(
        "--recompute-micro-batch-tokens",
        default=None,
        help="the micro_batch_tokens values of the phases with gradient checkpointing on (default: "
        "--micro-batch-tokens): recompute is what lets the larger ones fit",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="the saved model the learner phases load: built there when it holds none (random weights "
        "of the bench's shape), kept afterwards, so later invocations skip the build",
    )
    p.add_argument(
        "--sequences",
        type=int,
        default=0,
        help="> 0: the step is this many sequences of --seq-tokens each (--seq-trained of them trained, "
        "in --seq-turns turns) instead of the CollabLLM-like draw: gpu-1-4b-lora.toml's random_words "
        "step is 8 groups x 8 = 64 sequences of 1,816 tokens, 1,536 trained",
    )
    p.add_argument("--seq-tokens", type=int, default=1816, help="tokens of each sequence with --sequences")
    p.add_argument("--seq-trained", type=int, default=1536, help="trained tokens of each sequence with --sequences")
    p.add_argument("--seq-turns", type=int, default=4, help="user/assistant turns of each sequence with --sequences")
    p.add_argument("--logit-chunk", type=int, default=None, help="[learner] logit_chunk_tokens (default: the config's)")
    p.add_argument("--skip-plain", action="store_true", help="leave out the plain PyTorch step")
    p.add_argument("--gpus", type=int, default=1, help="ranks for the learner phases (torch.distributed.run when > 1)")
    p.add_argument("--kl-coef", type=float, default=0.001, help="learner kl_coef; > 0 adds the reference forward")
    p.add_argument(
        "--ref",
        default="local",
        help="where the learner rows' reference log-probs come from, comma-separated of "
        f"{list(REF_CHOICES)}: local = the learner's frozen copy run in every step; service = "
        '[policy] reference = "service", the samples\' ref filled in beforehand (untimed) '
        "the way the reference service computes them",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=520.0,
        help="wall-clock budget; phases and variants that would overrun it are skipped",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="> 0: the learner trains a LoRA adapter of this rank ([learner.lora], alpha 2 x rank); 0: full",
    )
    p.add_argument(
        "--offload-optimizer",
        default="none",
        choices=["none", "cpu"],
        help="learner.offload_optimizer: cpu keeps master weights, Adam state and fp32 gradients in host memory",
    )
    p.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const="on",
        default="off",
        help="learner.gradient_checkpointing values to run, comma-separated of off, on (one learner phase "
        "each; the flag alone: on)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="2-layer, 4k-vocab model in fp32: runs on CPU (gloo) in about a minute"
    )
    p.add_argument("--out", default=None, help="JSON path (default $OUT/learner_gpu.json when OUT is set)")
    # internal: a child process runs one phase
    p.add_argument("--_phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_model-dir", dest="_model_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.layers is None:
        args.layers = 2 if args.tiny else 36
    if args.budget_tokens is None:
        args.budget_tokens = 1024 if args.tiny else 8192
    if args.step_tokens is None:
        args.step_tokens = 4 * args.budget_tokens
    args.zero_stages = [int(z) for z in args.zero.split(",") if z.strip()]
    args.attn_list = [a.strip() for a in args.attn.split(",") if a.strip()]
    args.ref_list = [r.strip() for r in args.ref.split(",") if r.strip()]
    args.compile_list = [c.strip() for c in args.compile.split(",") if c.strip()]
    args.gc_list = [g.strip() for g in args.gradient_checkpointing.split(",") if g.strip()]
    errors = []
    try:
        args.mbt_list = [int(m) for m in (args.micro_batch_tokens or str(args.budget_tokens)).split(",") if m.strip()]
    except ValueError:
        args.mbt_list = []
    if not args.mbt_list or any(m < 1 for m in args.mbt_list):
        errors.append(f"--micro-batch-tokens={args.micro_batch_tokens!r}: use comma-separated token counts >= 1")
    try:
        args.gc_mbt_list = [
            int(m)
            for m in (args.recompute_micro_batch_tokens or ",".join(map(str, args.mbt_list))).split(",")
            if m.strip()
        ]
    except ValueError:
        args.gc_mbt_list = []
    if not args.gc_mbt_list or any(m < 1 for m in args.gc_mbt_list):
        errors.append(
            f"--recompute-micro-batch-tokens={args.recompute_micro_batch_tokens!r}: use comma-separated token counts >= 1"
        )
    if not args.gc_list or any(g not in ("off", "on") for g in args.gc_list):
        errors.append(
            f"--gradient-checkpointing={args.gradient_checkpointing!r}: use a comma-separated subset of off, on"
        )
    if args.sequences and not 0 < args.seq_trained < args.seq_tokens:
        errors.append(
            f"--seq-trained={args.seq_trained} must be between 1 and --seq-tokens={args.seq_tokens} - 1 "
            "(the first token of a sequence is never trained)"
        )
    if args.sequences and args.seq_turns < 1:
        errors.append(f"--seq-turns={args.seq_turns} must be >= 1")
    if not args.ref_list or any(r not in REF_CHOICES for r in args.ref_list):
        errors.append(f"--ref={args.ref!r}: use a comma-separated subset of {list(REF_CHOICES)}")
    if "service" in args.ref_list and args.kl_coef <= 0:
        errors.append(f"--ref service needs --kl-coef > 0 (got {args.kl_coef}): without KL no reference is used")
    if any(z not in (0, 1, 2, 3) for z in args.zero_stages):
        errors.append(f"--zero={args.zero!r}: stages must be among 0, 1, 2, 3")
    if not args.attn_list or any(a not in ATTN_CHOICES for a in args.attn_list):
        errors.append(f"--attn={args.attn!r}: use a comma-separated subset of {list(ATTN_CHOICES)}")
    if not args.compile_list or any(c not in ("auto", "off", "layers") for c in args.compile_list):
        errors.append(f"--compile={args.compile!r}: use a comma-separated subset of auto, off, layers")
    for name in ("layers", "budget_tokens", "step_tokens", "steps", "gpus", "sequences"):
        if getattr(args, name) < (0 if name == "sequences" else 1):
            errors.append(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        errors.append(f"--warmup={args.warmup} must be >= 0")
    if errors:
        p.error("; ".join(errors))
    return args


# ---------------------------------------------------------------------------------------------
# model shape, parameter count, FLOPs


def model_config(args):
    from transformers import Qwen3Config

    if args.tiny:
        shape = dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            vocab_size=4096,
        )
    else:  # Qwen3-4B
        shape = dict(
            hidden_size=2560,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=9728,
            vocab_size=151936,
        )
    return Qwen3Config(
        num_hidden_layers=args.layers,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        use_cache=False,
        **shape,
    )


def shape_of(args) -> dict:
    c = model_config(args)
    return dict(
        hidden=c.hidden_size,
        layers=c.num_hidden_layers,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
    )


def count_params(s: dict) -> int:
    """Parameters of the Qwen3 shape; the tied embedding / lm_head matrix counted once."""
    h, d = s["hidden"], s["head_dim"]
    q, kv = s["heads"] * d, s["kv_heads"] * d
    layer = h * q + 2 * h * kv + q * h + 3 * h * s["intermediate"] + 2 * h + 2 * d  # projections, MLP, norms
    return s["layers"] * layer + s["vocab"] * h + h


def train_flops(
    s: dict, n_params: int, lengths: list[int], frozen_base: bool = False, reference_forward: bool = False
) -> float:
    """Forward + backward model FLOPs of sequences of these lengths (learner.flops, module docstring);
    `frozen_base`: a LoRA learner's, 4 N a token; `reference_forward`: plus a local reference's forward."""
    from parley.learner.flops import train_flops as flops

    return flops(
        n_params,
        s["layers"],
        s["heads"],
        s["head_dim"],
        lengths,
        frozen_base=frozen_base,
        reference_forward=reference_forward,
    )


# ---------------------------------------------------------------------------------------------
# a CollabLLM-like batch


def conversation_mask(n: int, rng: random.Random) -> list[int]:
    """Loss mask of an n-token conversation: 2-6 turns of user text (0) then assistant text (1);
    assistant segments are drawn 1.5x heavier, so about 60% of the tokens are trained."""
    weights: list[float] = []
    for _ in range(rng.randint(2, 6)):
        weights += [rng.uniform(0.5, 1.5), 1.5 * rng.uniform(0.5, 1.5)]
    total, acc, bounds = sum(weights), 0.0, [0]
    for w in weights:
        acc += w
        bounds.append(round(n * acc / total))
    mask: list[int] = []
    for i in range(len(weights)):
        mask += [i % 2] * (bounds[i + 1] - bounds[i])
    return mask


def fixed_mask(n: int, trained: int, turns: int) -> list[int]:
    """Loss mask of an n-token conversation of `turns` turns, each a user part (0) then an assistant part
    (1), `trained` tokens trained in all (random_words: 4 turns of 70 user then 384 assistant tokens)."""
    mask: list[int] = []
    for t in range(turns):
        a = trained * (t + 1) // turns - trained * t // turns
        u = (n - trained) * (t + 1) // turns - (n - trained) * t // turns
        mask += [0] * u + [1] * a
    return mask


def draw_samples(args, vocab: int):
    """With --sequences: that many sequences of --seq-tokens (fixed_mask). Otherwise trajectories of
    budget/8 .. budget tokens (lognormal, median 3/8 of the budget: 1k-8k with the
    default 8192) until step_tokens are drawn; random token ids (speed does not depend on them),
    behaviour log-probs of a uniform policy (what a random-init model gives, so ratios stay near 1)."""
    from parley.learner.packing import Sample

    rng = random.Random(args.seed)
    uniform = -math.log(vocab)
    if args.sequences:
        mask = fixed_mask(args.seq_tokens, args.seq_trained, args.seq_turns)
        return [
            Sample(
                f"bench/{i}",
                [rng.randrange(vocab) for _ in range(args.seq_tokens)],
                mask,
                [uniform if m else 0.0 for m in mask],
                rng.gauss(0.0, 1.0),
            )
            for i in range(args.sequences)
        ]
    lo, hi, median = max(16, args.budget_tokens // 8), args.budget_tokens, 0.375 * args.budget_tokens
    samples, total = [], 0
    while total < args.step_tokens:
        n = int(min(hi, max(lo, rng.lognormvariate(math.log(median), 0.6))))
        mask = conversation_mask(n, rng)
        ids = [rng.randrange(vocab) for _ in range(n)]
        behaviour = [uniform if m else 0.0 for m in mask]
        samples.append(Sample(f"bench/{len(samples)}", ids, mask, behaviour, rng.gauss(0.0, 1.0)))
        total += n
    return samples


# ---------------------------------------------------------------------------------------------
# attention over packed sequences: the learner's own (learner/attention.py)


def install_attention(requested: str, device) -> tuple[str, str]:
    """The packed attention the learner uses on `device` ("varlen" asks for it; the kernel behind it is
    flash varlen where it is usable and passes its check, else one SDPA call per sequence).
    Returns (kernel used, why)."""
    from parley.learner import attention

    attention.resolve("varlen", device)
    return attention._kernel["name"], attention._kernel["why"]


def use_attention(model, name: str) -> None:
    from parley.learner import attention

    attention.use(model, attention.VARLEN if name == VARLEN else name)


# ---------------------------------------------------------------------------------------------
# phases (child processes)


def _device_dtype(args):
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device()), (torch.float32 if args.tiny else torch.bfloat16)
    return torch.device("cpu"), torch.float32


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def build_model(args, device, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with device:  # initialise directly on the device: a 4B model's random init on CPU takes minutes
        model = AutoModelForCausalLM.from_config(model_config(args), dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def measure(step, args, device, deadline: float, last_s: float | None) -> dict:
    """Warm-up then timed steps; a variant whose expected time would pass the deadline is skipped."""
    import torch

    if last_s is not None and time.time() + last_s * (args.warmup + args.steps) * 1.2 > deadline:
        return {"skipped": "time budget"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    _sync(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"step_s": times, "peak_gib": _peak_gib(device)}


def _plain(o):
    """JSON for numpy/torch scalars (the profiler's figures)."""
    return o.item() if hasattr(o, "item") else str(o)


def _save(result_path: str, rows: list[dict], extra: dict) -> None:
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": rows, **extra}, f, default=_plain)
    os.replace(tmp, result_path)  # written after every variant: a crash later keeps these


def phase_build(args) -> None:
    """Write the random model once (from_pretrained is how the learner loads its policy)."""
    device, dtype = _device_dtype(args)
    t0 = time.perf_counter()
    model = build_model(args, device, dtype)
    model.save_pretrained(args._model_dir)
    print(f"[build] model written to {args._model_dir} in {time.perf_counter() - t0:.1f} s", flush=True)


def phase_plain(args) -> None:
    """A plain PyTorch step: full (1, T, vocab) logits, log_softmax of the trained rows, the GRPO
    loss, backward per micro-batch, one fused AdamW step; no DeepSpeed, no reference model."""
    import torch

    from parley.learner import grpo
    from parley.learner.packing import Sample, build_batch, pack_by_tokens

    device, dtype = _device_dtype(args)
    t0 = time.perf_counter()
    model = build_model(args, device, dtype)
    built_s = time.perf_counter() - t0
    seen, n_actual = set(), 0
    for p in model.parameters():  # tied weights appear once
        if id(p) not in seen:
            seen.add(id(p))
            n_actual += p.numel()
    t0 = time.perf_counter()
    model.save_pretrained(args._model_dir)  # the learner phases load these very weights
    saved_s = time.perf_counter() - t0
    print(f"[plain] built in {built_s:.1f} s, {n_actual / 1e9:.3f} B parameters, saved in {saved_s:.1f} s", flush=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")

    vocab = model.config.vocab_size
    samples = draw_samples(args, vocab)
    micro = pack_by_tokens([len(s.token_ids) for s in samples], args.budget_tokens)
    packed = [build_batch([samples[j] for j in mb], device) for mb in micro]
    rng = random.Random(args.seed + 1)
    n = args.budget_tokens  # one unpacked sequence, every token trained: the ENVIRONMENT.md measurement
    single = [
        build_batch(
            [Sample("bench/single", [rng.randrange(vocab) for _ in range(n)], [1] * n, [-math.log(vocab)] * n, 1.0)],
            device,
        )
    ]

    def step(batches) -> None:
        n_total = sum(b.n_loss_tokens for b in batches)
        for b in batches:
            logits = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits  # (1, T, V)
            rows = logits[0].index_select(0, b.src).float()  # (N, V)
            logp = rows.log_softmax(-1).gather(1, b.targets[:, None])[:, 0]  # (N,)
            loss, _ = grpo.grpo_loss(
                logp, b.behaviour, b.advantages, torch.ones_like(b.behaviour, dtype=torch.bool), b.seq
            )
            (loss * (b.n_loss_tokens / n_total)).backward()
            del logits, rows, logp, loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows: list[dict] = []
    extra = {"n_params_actual": n_actual, "build_s": built_s, "save_s": saved_s}
    variants = [("sdpa", "single", single)] + [(a, "packed", packed) for a in args.attn_list]
    last = None
    for attn, layout, batches in variants:
        row = {
            "phase": "plain",
            "layout": layout,
            "attention": attn,
            "world": 1,
            "lengths": [n] if layout == "single" else [len(s.token_ids) for s in samples],
            "micro_batches": len(batches),
            "trained_tokens": sum(b.n_loss_tokens for b in batches),
        }
        try:
            if attn == "sdpa":
                use_attention(model, "sdpa")
            else:
                kernel, why = install_attention(attn, device)
                use_attention(model, VARLEN)
                row.update(attention=kernel, attention_note=why)
            row.update(measure(lambda: step(batches), args, device, args._deadline, last))
        except Exception as e:  # record it and go on: the other variants are still worth having
            row["error"] = f"{type(e).__name__}: {e}"
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "step_s" in row:
            last = statistics.median(row["step_s"]) * (len(packed) / len(batches))
        print(f"[plain] {_brief(row)}", flush=True)
        rows.append(row)
        _save(args._result, rows, extra)


def fill_service_reference(args, samples, dtype_name: str) -> float:
    """What the reference service (services/reference/server.py) computes, put into every sample's `ref`
    before the Trainer exists (so outside the timing, and before ZeRO-3's loading hook): the saved
    initial weights loaded plainly, one forward per trajectory with the shared log-prob function.
    The model is freed afterwards, so the training GPU holds no reference. Returns the seconds taken."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from parley.engines.logprobs import sequence_logprobs
    from parley.learner.trainer import resolve_dtype

    device, _ = _device_dtype(args)
    t0 = time.perf_counter()
    ref = (
        AutoModelForCausalLM.from_pretrained(
            args._model_dir, dtype=resolve_dtype(dtype_name), attn_implementation="sdpa"
        )
        .to(device)
        .eval()
    )
    for s in samples:
        lp = sequence_logprobs(ref, torch.from_numpy(s.token_ids).to(device), 1024)
        s.ref = np.concatenate([np.zeros(1, np.float32), lp.cpu().numpy()])  # token 0 has no prefix
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


# Kinds of device time in a profiled step, tried in this order against a kernel's (or, on CPU, an
# operator's) lower-cased name; the first that matches names its kind, "elementwise" otherwise.
KINDS = (
    # attention first: flash kernels carry cutlass types in their names
    ("attention", ("flash", "fmha", "attn", "scaled_dot_product")),
    # the log-probs over the vocabulary: log_softmax and its backward, the gather of the targets'
    # log-probs and the scatter of its backward (a (chunk, vocab) fp32 tensor each)
    ("softmax_ce", ("softmax", "logsumexp", "cross_entropy", "nll_loss", "gather", "scatter")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "gemv", "aten::mm", "aten::addmm")),
    ("communication", ("nccl", "all_reduce", "allreduce")),
    ("memcpy", ("memcpy", "memset")),  # DMA copies (host <-> device, device <-> device) and fills
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("compiled_fused", ("triton",)),  # compiled layers' fused norms, rotary, SwiGLU, residual adds
    ("cast_copy", ("copy", "contiguous", "clone")),  # dtype casts (the logits' .float()), layout copies
    ("reduction", ("reduce", "norm", "sum", "mean")),
)
TRACE_MAX_BYTES = 5 * 2**20  # a gzipped trace larger than this is not kept (the device tool brings back little)


def kernel_kind(name: str) -> str:
    """The kind (KINDS) of a CUDA kernel or CPU operator, from its name."""
    n = name.lower()
    for kind, keys in KINDS:
        if any(k in n for k in keys):
            return kind
    return "elementwise"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start_us, end_us) intervals: the device's busy time, where
    kernels of several streams overlap."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy / 1e6


def profile_records(prof, device_type: str) -> tuple[list, list, list]:
    """From a torch.profiler run: ([(name, seconds)] one per kernel launch or operator, [(start_us, end_us)]
    of the device's busy intervals, [(name, seconds)] of the host's CUDA runtime calls). On CUDA the
    kernels (and memcpy/memset) with their device time, and every cuda*/cu* runtime call (launches,
    copies, synchronizations: where the host waits); on CPU, where there are no kernels, every operator's
    self time and the top-level operators' spans, and no runtime calls."""
    import torch

    records, intervals, runtime = [], [], []
    if device_type == "cuda":
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                records.append((e.name, float(e.device_time) / 1e6))
                intervals.append((e.time_range.start, e.time_range.end))
            elif e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn"):
                runtime.append((e.name, (e.time_range.end - e.time_range.start) / 1e6))
    else:
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            if e.self_cpu_time_total > 0:
                records.append((e.name, float(e.self_cpu_time_total) / 1e6))
            if e.cpu_parent is None:
                intervals.append((e.time_range.start, e.time_range.end))
    return records, intervals, runtime


def summarize_profile(
    records: list[tuple[str, float]],
    intervals: list[tuple[float, float]],
    wall_s: float,
    runtime: list[tuple[str, float]] = (),
    top: int = 25,
) -> dict:
    """A profiled step in a few numbers: the `top` kernels by total time (with launch counts and kind),
    seconds and share of the step's wall time per kind (KINDS), and the device's idle time (wall less
    the union of its busy intervals): launch gaps, host syncs, Python between kernels. With the host's
    runtime calls: the 8 with the most time (count, seconds) and how often the host waited on the GPU
    (`host_syncs`: *Synchronize calls, each one a drained queue)."""
    by_name: dict[str, list] = {}
    for name, t in records:
        r = by_name.setdefault(name, [0.0, 0])
        r[0] += t
        r[1] += 1
    kinds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, (t, c) in by_name.items():
        k = kernel_kind(name)
        kinds[k] = kinds.get(k, 0.0) + t
        counts[k] = counts.get(k, 0) + c
    busy = busy_seconds(intervals)
    idle = max(0.0, wall_s - busy)
    wall = max(wall_s, 1e-12)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    calls: dict[str, list] = {}
    for name, t in runtime:
        r = calls.setdefault(name, [0, 0.0])
        r[0] += 1
        r[1] += t
    return {
        "wall_s": wall_s,
        "kernel_s": sum(t for t, _ in by_name.values()),
        "busy_s": busy,
        "idle_s": idle,
        "idle_share": idle / wall,
        "launches": sum(c for _, c in by_name.values()),
        "kinds_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "kinds_share": {k: v / wall for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kinds_launches": counts,
        "top": [
            {"kernel": k[:160], "s": t, "count": c, "share": t / wall, "kind": kernel_kind(k)} for k, (t, c) in ranked
        ],
        "host_syncs": sum(c for n, (c, _) in calls.items() if "Synchronize" in n),
        "host_runtime": {n: {"count": c, "s": t} for n, (c, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]},
    }


def profile_step(
    step, device, out_dir: str | None = None, name: str = "step", summary_file: bool = True, trace: bool = True
) -> dict:
    """One step under torch.profiler, summarised (summarize_profile). With `out_dir`: the summary as
    <out_dir>/profile_<name>.json (with `summary_file`) and, with `trace` and once per directory, the
    Chrome trace gzipped as trace_<name>.json.gz when it is under TRACE_MAX_BYTES (else dropped, and the
    summary says so)."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    wall = time.perf_counter() - t0
    records, intervals, runtime = profile_records(prof, device.type)
    summary = summarize_profile(records, intervals, wall, runtime)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if trace and not any(out.glob("trace_*.json.gz")):
            raw = out / f"trace_{name}.json"
            prof.export_chrome_trace(str(raw))
            gz = out / f"trace_{name}.json.gz"
            with open(raw, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
            if gz.stat().st_size > TRACE_MAX_BYTES:
                summary["trace"] = (
                    f"dropped: {gz.stat().st_size / 2**20:.1f} MiB gzipped > {TRACE_MAX_BYTES / 2**20:.0f}"
                )
                gz.unlink()
            else:
                summary["trace"] = gz.name
        if summary_file:
            (out / f"profile_{name}.json").write_text(json.dumps(summary, indent=1))
    return summary


def projected_peak(fitted: tuple[int, float] | None, persistent: float | None, mbt: int) -> float | None:
    """GiB a micro-batch of `mbt` tokens would peak at, from the largest that ran ((tokens, peak GiB)) and
    the memory held before any step (weights, optimizer state): the activations scale with the tokens.
    None without a measurement (CPU, or nothing ran yet)."""
    if fitted is None or persistent is None or mbt <= fitted[0]:
        return None
    return persistent + (fitted[1] - persistent) * mbt / fitted[0]


def phase_learner(args, zero: int, compile_mode: str = "auto", ref: str = "local", gc: bool = False) -> None:
    """parley's learner as it trains: Trainer(LearnerConfig) from the saved weights, then
    Trainer.train_step(samples) (packing, chunked log-probs of trained tokens, reference forward
    (ref "local") or the samples' reference log-probs (ref "service"), GRPO loss, DeepSpeed backward
    and step)."""
    import torch

    from parley.config.learner import LearnerConfig, LoraSettings
    from parley.learner.logprobs import token_logprobs
    from parley.learner.packing import build_batch, pack_by_tokens, shard_by_tokens
    from parley.learner.trainer import Trainer

    mbts = args.gc_mbt_list if gc else args.mbt_list
    # compiled LoRA layers are refused only beside a KL term (config.learner, compile_mode)
    cfg = LearnerConfig(
        zero_stage=zero,
        micro_batch_tokens=mbts[0],
        **({} if args.logit_chunk is None else {"logit_chunk_tokens": args.logit_chunk}),
        kl_coef=args.kl_coef,
        lr=1e-6,
        seed=args.seed,
        dtype="float32" if args.tiny else "auto",
        compile=compile_mode,
        lora=LoraSettings(enabled=args.lora_rank > 0, rank=max(args.lora_rank, 1), alpha=2.0 * max(args.lora_rank, 1)),
        offload_optimizer=args.offload_optimizer,
        gradient_checkpointing=gc,
    )
    tag = f"[zero{zero} compile={compile_mode}{' recompute' if gc else ''}{'' if ref == 'local' else ' ref ' + ref}]"
    samples = draw_samples(args, model_config(args).vocab_size)
    ref_fill_s = None
    if ref == "service":
        ref_fill_s = fill_service_reference(args, samples, cfg.dtype)
        print(
            f"{tag} reference log-probs of {len(samples)} trajectories computed beforehand in {ref_fill_s:.1f} s "
            "(not timed)",
            flush=True,
        )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, args._model_dir, reference=ref)
    init_s = time.perf_counter() - t0
    device, rank, world = trainer.device, trainer.rank, torch.distributed.get_world_size()
    device = torch.device(device) if not isinstance(device, torch.device) else device
    persistent = torch.cuda.memory_allocated(device) / GiB if device.type == "cuda" else None
    if rank == 0:
        print(
            f"{tag} Trainer ready in {init_s:.1f} s on {world} rank(s), default attention {trainer.attention}, "
            f"layers compiled: {trainer.compiled}"
            + (f", {persistent:.1f} GiB allocated" if persistent is not None else ""),
            flush=True,
        )

    lengths = [len(s.token_ids) for s in samples]
    # The attention check's probe: the same micro-batch on every rank (rank 0's first). Under ZeRO-3 a
    # forward is collective, and ranks with different batches would call lm_head a different number
    # of times (one parameter all-gather each): the collectives mismatch and NCCL hangs.
    shard0 = [samples[i] for i in shard_by_tokens(lengths, world)[0]]
    # at most 4,096 tokens: SDPA's (T, T) mask over a recompute phase's 32k tokens would cost more than the check
    first = pack_by_tokens([len(s.token_ids) for s in shard0], min(*mbts, 4096))[0]
    probe = build_batch([shard0[j] for j in first], device)
    models = [trainer.module] + ([trainer.reference] if trainer.reference is not None else [])

    def probe_logp():
        with torch.no_grad():
            lp, _ = token_logprobs(trainer.module, probe, cfg.logit_chunk_tokens, grad=False)
        return lp.float()

    rows: list[dict] = []
    # what `parley learner` itself runs with this config (learner.attention: flash varlen on CUDA)
    extra = {
        "init_s": init_s,
        "persistent_gib": persistent,
        "learner_default_attention": trainer.attention,
        "compile": compile_mode,
        "compiled": trainer.compiled,
        "ref_fill_s": ref_fill_s,
    }
    last = None
    variants = [(attn, mbt) for attn in args.attn_list for mbt in mbts]
    total_gib = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else None
    fitted: dict[str, tuple[int, float]] = {}  # attention -> (micro-batch tokens, peak GiB) of its largest run
    best: tuple | None = None  # (median s/step, variant) of the fastest variant: the one profiled
    checked: set[str] = set()  # attentions whose agreement with SDPA was checked
    for attn, mbt in variants:
        trainer.cfg.micro_batch_tokens = mbt  # read at every train_step (its packing)
        row = {
            "phase": f"learner ZeRO-{zero}"
            + ("" if compile_mode == "auto" else f" compile={compile_mode}")
            + (" recompute" if gc else "")
            + ("" if ref == "local" else f", ref {ref}"),
            "zero": zero,
            "compile": compile_mode,
            "compiled": trainer.compiled,
            "gradient_checkpointing": gc,
            "micro_batch_tokens": mbt,
            "logit_chunk_tokens": cfg.logit_chunk_tokens,
            "lora_rank": args.lora_rank,
            "layout": "packed",
            "attention": attn,
            "ref": ref,
            "world": world,
            "lengths": lengths,
            "kl_coef": args.kl_coef,
            "trained_tokens": int(sum(s.n_trained for s in samples)),
        }
        # every rank must take the same branch (the steps are collective): rank 0 decides. A micro-batch
        # size whose projected peak (from the largest that ran) passes the GPU's memory is not tried:
        # an out-of-memory costs a step's time and leaves the cache fragmented for the next variant
        need = projected_peak(fitted.get(attn), persistent, mbt)
        why = None
        if need is not None and total_gib is not None and need > 0.97 * total_gib:
            why = f"would not fit: {need:.0f} GiB projected of {total_gib:.0f}"
        elif last is not None and time.time() + last * (args.warmup + args.steps + 1) * 1.2 > args._deadline:
            why = "time budget"
        go = [why]
        if world > 1:
            torch.distributed.broadcast_object_list(go, src=0)
        if go[0] is not None:
            row["skipped"] = go[0]
        else:
            try:
                if attn == "sdpa":
                    for m in models:
                        use_attention(m, "sdpa")
                else:
                    kernel, why = install_attention(attn, device)
                    for m in models:
                        use_attention(m, VARLEN)
                    row.update(attention=kernel, attention_note=why)
                if attn != "sdpa" and attn not in checked:
                    checked.add(attn)
                    # same weights, both attentions: the packed kernel must be a drop-in for SDPA
                    use_attention(trainer.module, "sdpa")
                    ref_lp = probe_logp()
                    use_attention(trainer.module, VARLEN)
                    diff = (probe_logp() - ref_lp).abs()
                    row.update(
                        logp_max_abs_diff_vs_sdpa=float(diff.max()), logp_mean_abs_diff_vs_sdpa=float(diff.mean())
                    )
                stats: dict = {}
                first: dict = {}

                def step():
                    stats.update(trainer.train_step(samples))
                    if not first:
                        first.update(stats)

                row.update(measure(step, args, device, float("inf"), None))
                row["micro_batches"] = int(stats.get("micro_batches", 0))
                # the phase's very first step (first variant) is taken from the loaded weights: its kl_mean
                # and logp_mismatch say whether the policy starts where the reference does
                row["first_step_stats"] = {k: v for k, v in first.items() if isinstance(v, float)}
                row["last_step_stats"] = {k: v for k, v in stats.items() if isinstance(v, float)}
                last = statistics.median(row["step_s"])
                if row.get("peak_gib") is not None and mbt >= fitted.get(attn, (0, 0.0))[0]:
                    fitted[attn] = (mbt, row["peak_gib"])
                if best is None or last < best[0]:
                    best = (last, attn, mbt, step)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                if world > 1:
                    raise  # ranks may now disagree on what comes next; stop rather than hang
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            print(f"{tag} {_brief(row)}", flush=True)
            rows.append(row)
            _save(args._result, rows, extra)
    # the phase's fastest variant once more, under the profiler (one rank: a profile of rank 0 alone)
    if args.profile is not None and best is not None and world == 1 and time.time() + 3 * best[0] < args._deadline:
        _, attn, mbt, _ = best
        trainer.cfg.micro_batch_tokens = mbt
        for m in models:
            use_attention(m, "sdpa" if attn == "sdpa" else VARLEN)
        name = f"zero{zero}_{compile_mode}" + ("_recompute" if gc else "") + ("" if ref == "local" else f"_{ref}")

        def first(tokens: int) -> tuple[list, int]:
            """The samples from the start that fill `tokens` (at least one)."""
            few, n = [], 0
            for s in samples:
                if n + len(s.token_ids) > tokens and few:
                    break
                few.append(s)
                n += len(s.token_ids)
            return few, n

        total = sum(lengths)
        # a quarter of the step (at least 4 micro-batches, at most all of it), one more optimizer step: the
        # same micro-batches and kernels as the timed steps, and a profiler's event processing (host time
        # a few times the step's on the 4B shape) a quarter as long
        part, part_tokens = first(min(total, max(total // 4, 4 * mbt)))
        try:
            prof = profile_step(lambda: trainer.train_step(part), device, None, name)
            prof["profiled_tokens"] = part_tokens
            if args.profile and not any(Path(args.profile).glob("trace_*.json.gz")):
                # the trace of a whole 4B step is tens of MB gzipped: that of its first two micro-batches
                # (the samples that fill them, one more optimizer step) is what comes back
                few, n = first(2 * mbt)
                small = profile_step(
                    lambda: trainer.train_step(few), device, args.profile, name + "_2mb", summary_file=False
                )
                prof["trace"] = small.get("trace")
                prof["trace_step"] = {"tokens": n, "wall_s": small["wall_s"], "idle_share": small["idle_share"]}
            if args.profile:
                out = Path(args.profile)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"profile_{name}.json").write_text(json.dumps(prof, indent=1))
        except Exception as e:  # the timings stand without it
            prof = {"error": f"{type(e).__name__}: {e}"}
        extra["profile"] = {"attention": attn, "micro_batch_tokens": mbt, **prof}
        if "error" not in prof:
            print(
                f"{tag} profile of {prof['profiled_tokens']:,} tokens ({attn}, micro-batches of {mbt}): wall {prof['wall_s']:.3f} s, GPU busy "
                f"{prof['busy_s']:.3f} s, idle {prof['idle_share']:.0%}, {prof['launches']} launches, "
                f"{prof['host_syncs']} host syncs; by kind: "
                + ", ".join(f"{k} {v:.0%}" for k, v in prof["kinds_share"].items()),
                flush=True,
            )
            for t in prof["top"]:
                print(
                    f"{tag}   {t['s'] * 1e3:8.1f} ms {t['count']:6d}x  {t['kind']:<15} {t['kernel'][:100]}", flush=True
                )
        else:
            print(f"{tag} profile failed: {prof['error']}", flush=True)
        _save(args._result, rows, extra)


def _brief(row: dict) -> str:
    head = f"{row['layout']} {row['attention']}"
    if "error" in row:
        return f"{head}: FAILED {row['error']}"
    if "skipped" in row:
        return f"{head}: skipped ({row['skipped']})"
    med = statistics.median(row["step_s"])
    tok = sum(row["lengths"])
    mem = f", peak {row['peak_gib']:.1f} GiB" if row.get("peak_gib") is not None else ""
    return f"{head}: {med:.3f} s/step, {tok / med:,.0f} tokens/s{mem}"


# ---------------------------------------------------------------------------------------------
# parent: matmul peak, children, report


def matmul_peak(tiny: bool) -> dict:
    """Dense matmul rate: 8192^3 bf16 on a GPU (10 timed after 3 warm-ups, CUDA events);
    on CPU a 1024^3 fp32 product, only so the --tiny run has a denominator."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    dev = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    reps = 10
    for _ in range(3):
        c = a @ b
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            c = a @ b
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            c = a @ b
        seconds = time.perf_counter() - t0
    del a, b, c
    if cuda:
        torch.cuda.empty_cache()
    return {
        "tflops": 2 * n**3 * reps / seconds / 1e12,
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "device": dev,
    }


def machine_info() -> dict:
    import importlib.metadata as md

    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__}
    for pkg in ("transformers", "deepspeed"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    if torch.cuda.is_available():
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
            mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled(),
            cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
            gpu_mem_gib=torch.cuda.get_device_properties(0).total_memory / GiB,
        )
    else:
        info.update(gpu=None, gpus=0, cpu_threads=torch.get_num_threads())
    try:
        import torch.nn.attention.varlen  # noqa: F401

        info["varlen_attn"] = True
    except ImportError:
        info["varlen_attn"] = False
    return info


def run_child(args, phase: str, model_dir: str, deadline: float) -> tuple[list[dict], dict, str]:
    """Run one phase in a child process until the deadline; (rows, extra, status)."""
    fd, result = tempfile.mkstemp(prefix=f"bench_{phase}_", suffix=".json")
    os.close(fd)
    os.unlink(result)
    script = [str(Path(__file__).resolve())]
    if phase.startswith("zero") and args.gpus > 1:
        script = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}"] + script
    cmd = [
        sys.executable,
        *script,
        *sys.argv[1:],
        "--_phase",
        phase,
        "--_result",
        result,
        "--_deadline",
        str(deadline),
        "--_model-dir",
        model_dir,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    print(f"== phase {phase} ({deadline - time.time():.0f} s left)", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: a timeout kills all its ranks
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        status = "ok" if rc == 0 else f"exit code {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "killed at the time budget"
    print(f"== phase {phase}: {status} after {time.perf_counter() - t0:.0f} s", flush=True)
    rows, extra = [], {}
    if os.path.exists(result):
        with open(result) as f:
            data = json.load(f)
        rows, extra = data.pop("rows"), data
        os.unlink(result)
    return rows, extra, status


def compute(rows: list[dict], shape: dict, n_params: int, peak_tflops: float) -> None:
    """Add FLOPs, TFLOP/s, MFU and ratios to every measured row (in place)."""
    for r in rows:
        if "step_s" not in r:
            continue
        t = statistics.median(r["step_s"])
        tokens = sum(r["lengths"])
        # a LoRA learner computes no weight gradients for the frozen base: 4 N a token (learner.flops)
        policy = train_flops(shape, n_params, r["lengths"], frozen_base=bool(r.get("lora_rank")))
        full = train_flops(shape, n_params, r["lengths"])
        # the reference forward, when the learner runs it (ref "service" computed it before the step): a
        # forward's 2 N a token whatever the policy trains (a third of full fine-tuning's, not of LoRA's 4 N)
        local_ref = r.get("kl_coef", 0) > 0 and r.get("ref", "local") == "local"
        ref = (train_flops(shape, n_params, r["lengths"], reference_forward=True) - full) if local_ref else 0.0
        denom = t * peak_tflops * 1e12 * r["world"]
        r.update(
            s_per_step=t,
            tokens=tokens,
            tokens_per_s=tokens / t,
            flops=policy + ref,
            tflops_per_gpu=(policy + ref) / t / 1e12 / r["world"],
            mfu=(policy + ref) / denom,
            policy_mfu=policy / denom,
            flops_basis="4N (LoRA)" if r.get("lora_rank") else "6N",
            # one denominator for the docs: the datasheet's dense bf16 rate (H100 SXM and H200)
            mfu_datasheet=(policy + ref) / (t * DATASHEET_TFLOPS * 1e12 * r["world"]),
            mfu_6n_datasheet=(full + ref) / (t * DATASHEET_TFLOPS * 1e12 * r["world"]),
        )
    plain = {r["attention"]: r for r in rows if r["phase"] == "plain" and r["layout"] == "packed" and "mfu" in r}
    for r in rows:
        if "mfu" in r and r["phase"] != "plain":
            same = plain.get(r["attention"]) or plain.get("sdpa")
            if same is not None:
                r["vs_plain"] = {
                    "attention": same["attention"],
                    "mfu_ratio": r["mfu"] / same["mfu"],
                    "policy_mfu_ratio": r["policy_mfu"] / same["mfu"],
                    "tokens_per_s_ratio": r["tokens_per_s"] / same["tokens_per_s"],
                }
    # the same learner row with the reference service against its own frozen copy, in the same run
    local = {
        (r["zero"], r.get("compile"), r["attention"], r["world"]): r
        for r in rows
        if "mfu" in r and r.get("ref") == "local" and "zero" in r
    }
    for r in rows:
        key = (r.get("zero"), r.get("compile"), r["attention"], r["world"])
        same = local.get(key) if r.get("ref") == "service" else None
        if "mfu" in r and same is not None:
            r["vs_ref_local"] = {
                "step_s_ratio": r["s_per_step"] / same["s_per_step"],
                "tokens_per_s_ratio": r["tokens_per_s"] / same["tokens_per_s"],
            }


def table(report: dict) -> str:
    peak = report["peak"]
    m = report["machine"]
    lines = [
        f"{m.get('gpu') or 'CPU'}; torch {m['torch']}, transformers {m['transformers']}, deepspeed {m['deepspeed']}; "
        f"matmul peak {peak['tflops']:.0f} TFLOP/s ({peak['n']}^3 {peak['dtype']}); "
        f"{report['model']['params'] / 1e9:.3f} B params, {report['model']['layers']} layers; "
        f"step: {report['batch']['sequences']} sequences, {report['batch']['tokens']} tokens "
        f"({report['batch']['min_len']}-{report['batch']['max_len']}), "
        f"{report['batch']['trained_fraction']:.0%} trained, "
        f"micro-batch budget {report['batch']['budget_tokens']}",
        "",
        "| run | layout | attention | GPUs | micro-batch tokens | micro-batches | s/step | tokens/s | TFLOP/s/GPU "
        "| MFU | policy MFU | MFU / plain | MFU (989.4, FLOPs basis) | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        head = (
            f"| {r['phase']} | {r['layout']} | {r['attention']} | {r['world']} | {r.get('micro_batch_tokens', '')} "
            f"| {r.get('micro_batches', '')} |"
        )
        if "mfu" not in r:
            why = r.get("error") or f"skipped: {r.get('skipped', 'no result')}"
            lines.append(f"{head} {why} | | | | | | | |")
            continue
        ratio = f"{r['vs_plain']['mfu_ratio']:.2f} (vs {r['vs_plain']['attention']})" if "vs_plain" in r else ""
        policy = f"{r['policy_mfu']:.1%}" if r["policy_mfu"] != r["mfu"] else ""
        mem = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else ""
        lines.append(
            f"{head} {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.0f} | "
            f"{r['mfu']:.1%} | {policy} | {ratio} | {r['mfu_datasheet']:.1%} ({r['flops_basis']}) | {mem} |"
        )
    for r in report["rows"]:
        if "vs_ref_local" in r:
            lines.append(
                f"\n{r['phase']} {r['attention']}: step time {r['vs_ref_local']['step_s_ratio']:.2f}x the "
                "same row with the local reference"
            )
    for p in report["phases"]:
        if p["status"] != "ok":
            lines.append(f"\nphase {p['phase']}: {p['status']}")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    # DeepSpeed calls collectives that newer torch marks deprecated, once per layer and step
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning)
    if args._phase is not None:
        if args._phase == "build":
            phase_build(args)
        elif args._phase == "plain":
            phase_plain(args)
        else:  # "zero<stage>[:<compile>][-<ref>][+gc]"
            name, _, gc = args._phase.partition("+")
            head, _, ref = name.removeprefix("zero").partition("-")
            stage, _, mode = head.partition(":")
            phase_learner(args, int(stage), mode or "auto", ref or "local", gc == "gc")
        return 0

    start = time.time()
    deadline = start + args.budget_s
    out = args.out or (os.path.join(os.environ["OUT"], "learner_gpu.json") if os.environ.get("OUT") else None)
    info = machine_info()
    print(f"machine: {json.dumps(info)}", flush=True)
    peak = matmul_peak(args.tiny)
    print(f"matmul peak: {peak['tflops']:.1f} TFLOP/s ({peak['n']}^3 {peak['dtype']} on {peak['device']})", flush=True)
    shape = shape_of(args)
    n_params = count_params(shape)
    vocab = shape["vocab"]
    samples = draw_samples(args, vocab)
    lengths = [len(s.token_ids) for s in samples]
    report = {
        "machine": info,
        "peak": peak,
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "model": {**shape, "params": n_params},
        "batch": {
            "sequences": len(lengths),
            "tokens": sum(lengths),
            "min_len": min(lengths),
            "max_len": max(lengths),
            "trained_fraction": sum(s.n_trained for s in samples) / sum(lengths),
            "budget_tokens": args.budget_tokens,
            "lengths": lengths,
        },
        "flops_formula": "per sequence of s tokens: train = 6*N*s + 6*L*Hq*d*s^2 (causal attention); "
        "forward = train/3; learner rows add the reference forward when kl_coef > 0",
        "rows": [],
        "phases": [],
    }

    def write() -> None:
        compute(report["rows"], shape, n_params, peak["tflops"])
        report["table_md"] = table(report)
        report["elapsed_s"] = time.time() - start
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(report, indent=1))
            Path(out).with_suffix(".md").write_text(report["table_md"] + "\n")

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="parley_bench_model_")
    have = args.model_dir is not None and (Path(model_dir) / "config.json").is_file()
    try:
        phases = ["plain"] if not args.skip_plain else (["build"] if args.zero_stages and not have else [])
        phases += [
            f"zero{z}"
            + ("" if c == "auto" else f":{c}")
            + ("" if ref == "local" else f"-{ref}")
            + ("+gc" if g == "on" else "")
            for z in args.zero_stages
            for g in args.gc_list
            for c in args.compile_list
            for ref in args.ref_list
        ]
        for phase in phases:
            if deadline - time.time() < 20:
                report["phases"].append({"phase": phase, "status": "skipped: time budget"})
                continue
            rows, extra, status = run_child(args, phase, model_dir, deadline)
            report["rows"] += rows
            report["phases"].append({"phase": phase, "status": status, **extra})
            if phase in ("build", "plain") and not (Path(model_dir) / "config.json").exists():
                print("the model was not written; the learner phases cannot run", flush=True)
                break
            write()
    finally:
        if args.model_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)
    write()
    print("\n" + report["table_md"], flush=True)
    if out:
        print(f"\nwrote {out}", flush=True)
    measured = [r for r in report["rows"] if "mfu" in r]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
