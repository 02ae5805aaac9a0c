"""Does the learner's GRPO step read memory it never wrote? The same steps on the same batches, run
once per fill of the memory the step will be given: the results must not depend on the fill.

    python bench/learner_poison.py --model smol --json OUT/learner_poison.json      # on a GPU (part K)
    python bench/learner_poison.py --model tiny --steps 3                           # on this CPU

Why: on the H200 (2026-12-05, docs/gpu.md "Side by side with TRL") three part P runs in which the
learner kept its cached GPU memory between steps (b894bc7, reverted) saw the policy's entropy rise
in the first steps (1.2-1.7 by step 4), where every run that handed the cache back after each step
saw it fall (0.87-0.89 at step 4 in the two lag-0 runs of that morning); the actors agreed with the
learner all along (log-prob gap 0.011-0.047), so the learner's updates themselves differed. A kernel
or a buffer that reads memory before writing it would do exactly that: memory fresh from the driver
is usually zeros, memory from PyTorch's cache holds the previous step's values.

How. One Trainer ([learner] as configured: bf16, ZeRO-2, compiled layers and varlen attention on a
GPU) per fill, built afresh each time from the same weights (torch seed 0), then `--steps` GRPO steps
on fixed random batches shaped like part P's (8 sequences of 150-260 tokens, a third of each trained,
temperature 0.7, group advantages). Before every step:
  - on CUDA, PyTorch's caching allocator is filled: every cached block is handed back, then one
    large block (twice the first step's reserved peak) and 2 MiB small-pool segments (512 MiB in all)
    are allocated, written with the fill value (float32) and freed, so the step's temporaries are
    carved out of memory that holds the fill;
  - on CPU, the allocator cannot be filled from outside: the fill "nan" turns on torch's
    deterministic mode with `fill_uninitialized_memory` (every torch.empty comes back NaN); the fill
    "0" leaves both off. Only "0" and "nan" exist there.
The fills: "0" twice (what a run repeated gives: the GPU's own nondeterminism), "nan" (any read of a
value never written spreads NaN into the loss or the gradient: the step is skipped or its figures
go NaN) and "1e4" (a finite value the size of garbage). On CUDA a run "unfilled" comes first: every
cached block handed back before each step, as the learner's release_cache does; its first step's
reserved peak sizes the fills. Per step: loss, grad_norm, entropy, skipped,
and a fingerprint of the weights after it (the float64 sum of each parameter). The verdict compares
each fill's run with the first "0" run, against what the second "0" run differs by.

`--cache-ab` (CUDA; part K runs it after the fills) asks the question those runs leave open, with the
learner as it runs live instead: every step followed by a cuda_ipc version packed into one of six
buffers ([weights] kind cuda_ipc, as part P), nothing of the bench's own between steps (the
fingerprints stay on the device until the run ends, where the fills above empty and fill the cache
and synchronize before every step: between steps only the learner's own pack, which waits for its
copy, as live), and [learner] gpu_cache "release" twice, then "keep_when_room" twice. Part K's first run (2026-12-05,
H100) found the fills bit-identical, while part P's runs with the cache kept still saw the entropy
rise (docs/gpu.md, "Three seeds on an H100"). The verdict: does keeping the cache move the figures
beyond what two runs of one setting differ by (exit 1 if so)? Each of its steps also keeps its train_s
and where it went (learner.steplog.PHASES), printed as medians of steps 2..N per setting: the learner's
step alone on the GPU, against the live run's, where it shares the GPU with the actors' engines.

Nothing in parley imports this file. tests/e2e/test_learner_uninitialized.py runs it on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from parley.learner.steplog import PHASES  # noqa: E402

FILLS = ("0", "0", "nan", "1e4")
UNFILLED = "unfilled"  # CUDA: every cached block handed back before each step (what release_cache does)
CPU_FILLS = ("0", "0", "nan")
FIELDS = ("loss", "grad_norm", "entropy", "skipped")
SMALL_POOL_BYTES = 512 << 20  # what is written through the small pool's 2 MiB segments
SMALL_BLOCK = 1 << 20  # PyTorch's small pool takes blocks up to 1 MiB


def batches(vocab: int, steps: int, seed: int = 0, n: int = 8) -> list[list]:
    """`steps` lists of n Samples: random tokens, lengths 150-260, the last two thirds trained (a
    prompt, then the policy's turns), behaviour log-probs near what a 0.7 sampler gives, and
    group-normalized advantages of random 0/1 rewards (never all equal)."""
    import numpy as np

    from parley.learner.packing import Sample

    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        rewards = rng.integers(0, 2, n).astype(float)
        rewards[0], rewards[1] = 0.0, 1.0
        adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        group = []
        for i in range(n):
            length = int(rng.integers(150, 261))
            ids = rng.integers(3, vocab, length)
            mask = np.zeros(length, dtype=bool)
            mask[length // 3 :] = True
            behaviour = np.where(mask, -rng.uniform(0.05, 3.0, length), 0.0).astype(np.float32)
            group.append(Sample(f"s{step}-{i}", ids, mask, behaviour, float(adv[i]), temperature=0.7))
        out.append(group)
    return out


def fill_cuda_cache(value: float, large_bytes: int, device) -> None:
    """Hand every cached block back, then leave PyTorch's cache holding `value` (float32) in one
    block of `large_bytes` and in SMALL_POOL_BYTES of small-pool segments."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    large = torch.empty(large_bytes // 4, dtype=torch.float32, device=device)
    large.fill_(value)
    small = [
        torch.empty(SMALL_BLOCK // 4, dtype=torch.float32, device=device)
        for _ in range(SMALL_POOL_BYTES // SMALL_BLOCK)
    ]
    for t in small:
        t.fill_(value)
    torch.cuda.synchronize(device)
    del large, small  # freed to the cache, not to the driver: the step's allocations reuse them


def step_row(stats: dict) -> dict:
    """What a run keeps of a train step's stats: FIELDS and its micro-batches."""
    return {**{k: float(stats.get(k, float("nan"))) for k in FIELDS}, "micro_batches": int(stats["micro_batches"])}


def run_fill(
    model_dir: str, fill: str, steps: int, zero: int, dtype: str, large_bytes: int | None = None, **learner
) -> dict:
    """One Trainer, `steps` steps with the memory filled with `fill` before each: per step the
    FIELDS and the weights' fingerprint; and the reserved peak of the first step (CUDA). `learner`:
    more [learner] settings (e.g. micro_batch_tokens)."""
    import torch

    from parley.config.learner import LearnerConfig
    from parley.learner.trainer import Trainer

    cuda = torch.cuda.is_available()
    if not cuda and fill not in CPU_FILLS:
        raise ValueError(f"fill {fill!r} needs CUDA; on CPU the fills are {sorted(set(CPU_FILLS))}")
    deterministic = not cuda and fill == "nan"
    if deterministic:
        import torch.utils.deterministic

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    if cuda:
        # every run compiles its layers afresh: one that met dynamo's recompile limit after the runs
        # before it would run eager kernels, and differ by their rounding, not by what it read
        torch._dynamo.reset()
    try:
        trainer = Trainer(
            LearnerConfig(zero_stage=zero, dtype=dtype, kl_coef=0.0, behaviour_correction="truncated_is", **learner),
            model_dir,
        )
        try:
            vocab = trainer.module.get_input_embeddings().weight.shape[0]
            rows, peak = [], None
            for i, samples in enumerate(batches(vocab, steps)):
                if cuda and fill == UNFILLED:
                    torch.cuda.synchronize(trainer.device)
                    torch.cuda.empty_cache()
                elif cuda:
                    fill_cuda_cache(float(fill), large_bytes, trainer.device)
                if cuda:
                    torch.cuda.reset_peak_memory_stats(trainer.device)
                st = trainer.train_step(samples)
                if cuda and i == 0:
                    peak = torch.cuda.max_memory_reserved(trainer.device)
                sums = [float(p.detach().double().sum()) for p in trainer.module.parameters()]
                rows.append({**step_row(st), "fingerprint": sums})
        finally:
            trainer.close()
    finally:
        if deterministic:
            torch.utils.deterministic.fill_uninitialized_memory = False
            torch.use_deterministic_algorithms(False)
    return {"fill": fill, "steps": rows, "reserved_peak_bytes": peak}


CACHE_AB = ("release", "release", "keep_when_room", "keep_when_room")


def run_cache(model_dir: str, gpu_cache: str, steps: int, zero: int, dtype: str, **learner) -> dict:
    """One Trainer as the live learner on a GPU it shares with actors (CUDA only): [weights] kind
    cuda_ipc, a version packed after every step (Trainer.pack_weights, as weights.publish does),
    [learner] gpu_cache as given, and nothing of ours between steps (the weights' fingerprints are
    summed on the device and read when the run ends). Rows as run_fill's, with
    each step's cache_released_gib."""
    import torch

    from parley.config.learner import LearnerConfig
    from parley.learner.trainer import Trainer
    from parley.weights.config import CudaIpcWeights

    if not torch.cuda.is_available():
        raise ValueError("--cache-ab needs CUDA: gpu_cache and cuda_ipc act on a GPU only")
    torch._dynamo.reset()  # every run compiles afresh (run_fill says why)
    trainer = Trainer(
        LearnerConfig(
            zero_stage=zero,
            dtype=dtype,
            kl_coef=0.0,
            behaviour_correction="truncated_is",
            gpu_cache=gpu_cache,
            **learner,
        ),
        model_dir,
        weights=CudaIpcWeights(max_buffers=6, hold_s=1.0),
    )
    try:
        vocab = trainer.module.get_input_embeddings().weight.shape[0]
        rows, prints = [], []
        for i, samples in enumerate(batches(vocab, steps)):
            st = trainer.train_step(samples)
            trainer.pack_weights(i + 1)
            prints.append(torch.stack([p.detach().double().sum() for p in trainer.module.parameters()]))
            rows.append(
                {
                    **step_row(st),
                    "cache_released_gib": float(st.get("cache_released_gib", float("nan"))),
                    # the step's time and where it went, alone on the GPU (the live run shares it with actors)
                    **{k: float(st[k]) for k in ("train_s", *PHASES)},
                }
            )
        for row, fp in zip(rows, prints):
            row["fingerprint"] = fp.tolist()
    finally:
        trainer.close()
    return {"fill": f"gpu_cache={gpu_cache}", "gpu_cache": gpu_cache, "steps": rows}


def cache_verdict(runs: list[dict]) -> dict:
    """The first "release" run against the first "keep_when_room" one, beside what two runs of each
    setting differ by (the noise: the larger of the two). The cache moves the steps when a field
    differs by more than 4x the noise, or is not finite in one run only."""
    by = {}
    for r in runs:
        by.setdefault(r["gpu_cache"], []).append(r)
    release, keep = by["release"], by["keep_when_room"]
    noises = [compare(*pair[:2]) for pair in (release, keep) if len(pair) > 1]
    noise = {k: max((n[k] for n in noises), default=0.0) for k in (*FIELDS, "weights_rel")}
    d = compare(release[0], keep[0])
    moves = any(not math.isfinite(d[k]) or d[k] > max(4 * noise[k], 1e-12) for k in d)
    return {"noise": noise, "diff": d, "cache_moves_steps": moves}


def _diff(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b)


def compare(base: dict, other: dict) -> dict:
    """Largest difference of each field over the steps, and of the weights' fingerprint (relative to
    the largest parameter sum), between two runs."""
    out = {}
    for k in FIELDS:
        out[k] = max(_diff(x[k], y[k]) for x, y in zip(base["steps"], other["steps"]))
    worst = 0.0
    for x, y in zip(base["steps"], other["steps"]):
        scale = max(max(abs(v) for v in x["fingerprint"]), 1e-12)
        worst = max(worst, max(_diff(a, b) / scale for a, b in zip(x["fingerprint"], y["fingerprint"])))
    out["weights_rel"] = worst
    return out


def verdict(runs: list[dict]) -> dict:
    """Each run against the first run of fill "0"; `noise` is what the second run of "0" differs by. A
    fill whose difference exceeds the noise in any field (or is not finite) read memory it never wrote."""
    base = next(r for r in runs if r["fill"] == "0")
    repeats = [r for r in runs if r["fill"] == "0" and r is not base]
    noise = compare(base, repeats[0]) if repeats else {k: 0.0 for k in (*FIELDS, "weights_rel")}
    rows = []
    for r in runs:
        if r is base:
            continue
        d = compare(base, r)
        if r["fill"] == base["fill"]:
            reads = None  # the noise itself
        else:
            reads = any(not math.isfinite(d[k]) or d[k] > max(4 * noise[k], 1e-12) for k in d)
        rows.append({"fill": r["fill"], "diff": d, "reads_unwritten": reads})
    return {
        "noise": noise,
        "fills": rows,
        "reads_unwritten": any(r["reads_unwritten"] for r in rows if r["reads_unwritten"] is not None),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny", help="tiny, smol (engines.models.ensure_model) or a model directory")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per fill (default 4)")
    p.add_argument("--zero", type=int, default=2, help="ZeRO stage (default 2, the learner's)")
    p.add_argument("--dtype", default="auto", help="[learner] dtype (auto: bf16 on a GPU, fp32 on CPU)")
    p.add_argument(
        "--fills",
        default=None,
        help=f'comma-separated fills, "0" at least once, twice for the noise (default {",".join(FILLS)}; '
        f'on CPU {",".join(CPU_FILLS)}); on CUDA a run "{UNFILLED}" comes first and sizes the fills',
    )
    p.add_argument(
        "--compile",
        default=None,
        choices=("auto", "layers", "off"),
        help="[learner] compile (default: the learner's, auto: layers on a GPU under ZeRO-2)",
    )
    p.add_argument(
        "--attention",
        default=None,
        choices=("auto", "sdpa", "varlen"),
        help="[learner] attention (default: the learner's, auto: flash varlen on a GPU)",
    )
    p.add_argument(
        "--cache-ab",
        action="store_true",
        help="(CUDA) instead of the fills: the live learner's steps with a cuda_ipc version packed after "
        "each, [learner] gpu_cache release twice and keep_when_room twice",
    )
    p.add_argument("--json", default=None, help="write the runs and the verdict here")
    args = p.parse_args(argv)

    import torch

    from parley.engines.models import ensure_model

    cuda = torch.cuda.is_available()
    if args.cache_ab and not cuda:
        p.error("--cache-ab needs CUDA: [learner] gpu_cache and cuda_ipc weights act on a GPU only")
    model_dir = args.model if os.path.isdir(args.model) else str(ensure_model(args.model))
    learner = {k: v for k, v in (("compile", args.compile), ("attention", args.attention)) if v is not None}
    if args.cache_ab:
        return cache_ab(model_dir, args, learner)
    fills = args.fills.split(",") if args.fills else list(FILLS if cuda else CPU_FILLS)
    for f in fills:  # a readable error before any work
        try:
            float(f)
        except ValueError:
            p.error(f"--fills: {f!r} is not a number (e.g. 0, nan, 1e4)")
    if not cuda and set(fills) - set(CPU_FILLS):
        p.error(f"--fills {args.fills}: on CPU only {' and '.join(sorted(set(CPU_FILLS)))} (no allocator to fill)")
    if "0" not in fills:
        p.error('--fills needs "0": the other fills are compared with it')
    if cuda:
        fills = [UNFILLED] + fills
    large = None
    runs = []
    for f in fills:
        r = run_fill(model_dir, f, args.steps, args.zero, args.dtype, large, **learner)
        if f == UNFILLED:  # later runs fill twice its first step's reserved peak
            large = 2 * (r["reserved_peak_bytes"] or (1 << 30))
        runs.append(r)
        last = r["steps"][-1]
        print(
            f"[poison] fill {f}: " + ", ".join(f"{k} {last[k]:.6g}" for k in FIELDS) + f" at step {args.steps}",
            flush=True,
        )
    v = verdict(runs)
    for row in v["fills"]:
        print(
            f"[poison] fill {row['fill']}: "
            + ", ".join(f"{k} {d:.3g}" for k, d in row["diff"].items())
            + ("" if row["reads_unwritten"] is None else f" -> reads unwritten memory: {row['reads_unwritten']}")
        )
    print("[poison] noise (fill 0 twice): " + ", ".join(f"{k} {d:.3g}" for k, d in v["noise"].items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "model": args.model,
                    "steps": args.steps,
                    "zero": args.zero,
                    "learner": learner,
                    "verdict": v,
                    "runs": runs,
                },
                indent=1,
            )
        )
    return 1 if v["reads_unwritten"] else 0


def cache_ab(model_dir: str, args, learner: dict) -> int:
    import torch

    runs = []
    for mode in CACHE_AB:
        r = run_cache(model_dir, mode, args.steps, args.zero, args.dtype, **learner)
        runs.append(r)
        last = r["steps"][-1]
        print(
            f"[cache] gpu_cache {mode}: "
            + ", ".join(f"{k} {last[k]:.6g}" for k in FIELDS)
            + f" at step {args.steps}; released GiB a step: "
            + " ".join(f"{row['cache_released_gib']:.2f}" for row in r["steps"]),
            flush=True,
        )
        later = r["steps"][1:] or r["steps"]  # step 1 compiles
        medians = {k: statistics.median(row[k] for row in later) for k in ("train_s", *PHASES)}
        print(
            f"[cache] gpu_cache {mode}: steps 2..N, median s: " + ", ".join(f"{k} {v:.4f}" for k, v in medians.items()),
            flush=True,
        )
    v = cache_verdict(runs)
    print(
        "[cache] release against keep_when_room: "
        + ", ".join(f"{k} {d:.3g}" for k, d in v["diff"].items())
        + f" -> the kept cache moves the steps: {v['cache_moves_steps']}"
    )
    print("[cache] noise (each setting twice): " + ", ".join(f"{k} {d:.3g}" for k, d in v["noise"].items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "model": args.model,
                    "steps": args.steps,
                    "zero": args.zero,
                    "learner": learner,
                    "weights": "cuda_ipc, max_buffers 6, hold_s 1.0",
                    "verdict": v,
                    "runs": runs,
                },
                indent=1,
            )
        )
    return 1 if v["cache_moves_steps"] else 0


if __name__ == "__main__":
    sys.exit(main())
