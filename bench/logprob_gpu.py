"""bf16 log-prob agreement on a GPU (issue 16): the behaviour log-probs vLLM returns while sampling
(engines.engine.PolicyEngine, bf16, CUDA graphs unless --eager) against the log-probs the learner
recomputes for the same tokens (learner.logprobs.token_logprobs over a transformers model, packed
micro-batches as learner.trainer builds them), in bf16 and in fp32, on a Qwen3-4B-shaped checkpoint
with random weights. Prints the distribution of the differences and what they do to the
importance ratio exp(learner - behaviour); writes JSON with --json. Run by hand on the GPU
machine (docs/gpu.md has the command); nothing in parley imports this file.

    python3 bench/logprob_gpu.py --model /tmp/m4b --build 4b --json $OUT/logprob_gpu.json
    python3 bench/logprob_gpu.py --model /tmp/m4b --kv-cache-dtype fp8 --json $OUT/logprob_gpu_fp8.json  # fp8 KV
    python3 bench/logprob_gpu.py --model smol --no-torch-compile --json $OUT/logprob_nocompile.json
    python3 bench/logprob_gpu.py --model smol --no-torch-compile --cudagraph-mode FULL_DECODE_ONLY

The prompts (--n of them, --plen tokens each) go in at once, more tokens than one step's budget, so
vLLM's chunked prefill mixes prefill and decode in its steps, as the actor's do.

--reload: the same after a weight swap in the running engine, as an actor's is between versions. The
engine first samples --n other prompts on the weights it started with (graphs and caches exercised;
the measured prompts then take nothing from the prefix cache), then loads a perturbed copy of them in
place (each weight times 1 + --noise x a standard normal; by default through the workers' load of
named tensors, the path an actor's GPU-buffer and packed versions take, or with --reload-path file
through PolicyEngine.reload_weights) and samples the measured prompts. The learner's log-probs are
recomputed under the perturbed weights, and also under the original ones (`original_bf16_vs_vllm`): an
engine that still samples from its old weights after the swap is nearer the original than the copy.

    python3 bench/logprob_gpu.py --model smol --reload --json $OUT/logprob_reload.json
    python3 bench/logprob_gpu.py --model smol --no-torch-compile --reload --json $OUT/logprob_nocompile_reload.json

--prefix: the same for a conversation's next turn. A first round plays --n other prompts; each measured
prompt is one of those sequences (prompt and output) plus --plen // 4 new tokens, so vLLM prefills it
from its prefix cache and computes only the new tokens over the cached context; the measured prompts go
in 5 ms apart, so those prefills share steps with the earlier ones' decodes (full CUDA graphs replay
such steps whole under --no-torch-compile --cudagraph-mode FULL; the compiled engine runs their
attention outside its graphs). The JSON counts the prompt tokens taken from the cache.

    python3 bench/logprob_gpu.py --model smol --no-torch-compile --prefix --json $OUT/logprob_nocompile_prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parley.engines.config import KVCacheDtype  # noqa: E402  (no torch, no vLLM: --help stays fast)


def stats(d) -> dict:
    """Summary of the per-token differences d (learner - vLLM), a float64 tensor."""
    import torch

    a = d.abs()
    q = torch.quantile(a, torch.tensor([0.5, 0.9, 0.99, 0.999], dtype=torch.float64))
    ratio = torch.exp(d)
    return {
        "tokens": int(d.numel()),
        "mean": float(d.mean()),
        "std": float(d.std()),
        "mean_abs": float(a.mean()),
        "p50_abs": float(q[0]),
        "p90_abs": float(q[1]),
        "p99_abs": float(q[2]),
        "p999_abs": float(q[3]),
        "max_abs": float(a.max()),
        # the PPO ratio at the behaviour policy itself: how often bf16 noise alone leaves [1-0.2, 1+0.28]
        "ratio_outside_clip": float(((ratio < 0.8) | (ratio > 1.28)).double().mean()),
        "ratio_p99_dev": float(torch.quantile((ratio - 1).abs(), 0.99)),
    }


async def sample(args, prompts, reload_dir=None, warm=None, vocab=0):
    import numpy as np

    from parley.engines.engine import EngineSettings, PolicyEngine

    settings = EngineSettings(
        model=args.model,
        dtype="bfloat16",
        # --prefix: a first round's sequence, its extension and a second output
        max_model_len=args.plen + args.tokens + 8 + ((args.plen // 4 or 1) + args.tokens if args.prefix else 0),
        kv_cache_bytes=None,
        gpu_memory_utilization=args.gpu_mem,
        enforce_eager=args.eager,
        json_compact=False,
        kv_cache_dtype=args.kv_cache_dtype,
        # vLLM's compilation mode NONE (0) with CUDA graphs of the given kind (FULL: of mixed prefill and
        # decode steps too where the attention backend replays them; FULL_DECODE_ONLY: decode steps)
        extra={"compilation_config": {"mode": 0, "cudagraph_mode": args.cudagraph_mode}}
        if args.no_torch_compile
        else {},
    )
    t0 = time.perf_counter()
    engine = PolicyEngine(settings)
    start = time.perf_counter() - t0

    async def play(ps, stagger_s: float = 0.0):
        async def one(i, p):
            await asyncio.sleep(i * stagger_s)  # staggered: a prompt's prefill lands beside others' decodes
            return await engine.generate(p, max_tokens=args.tokens, seed=i)

        return await asyncio.gather(*[one(i, p) for i, p in enumerate(ps)])

    try:
        if args.prefix:  # a conversation's next turn: each measured prompt extends a first round's sequence,
            # whose KV the prefix cache holds (the same weights, no salt change), by --plen // 4 new tokens
            first = await play(warm)
            rng = np.random.default_rng(1)
            prompts = [
                w + list(o.token_ids) + rng.integers(10, vocab - 10, size=max(1, args.plen // 4)).tolist()
                for w, o in zip(warm, first)
            ]
            outs = await play(prompts, stagger_s=0.005)
        elif reload_dir is None:
            outs = await play(prompts)
        else:  # a round on the starting weights, the swap an actor makes between versions, the measured round
            await play(warm)  # other prompts: the measured round takes nothing from the prefix cache
            t1 = time.perf_counter()
            if args.reload_path == "file":
                await engine.reload_weights(reload_dir, version=1)
                how = "file (vLLM's layer-wise reload)"
            else:  # the actors' path from the learner's buffers: named tensors handed to the worker's load
                how = await engine._llm.collective_rpc(_bare_load, args=(str(reload_dir),))
                engine._weights_epoch += 1  # as a version load does: prompts salted anew
            print(f"[logprob] loaded the perturbed weights in {time.perf_counter() - t1:.2f} s: {how}", flush=True)
            outs = await play(prompts)
    finally:
        engine.shutdown()
    return outs, start, prompts


def _bare_load(worker, path: str) -> str:
    """In the engine's worker (collective_rpc sends this function, VLLM_ALLOW_INSECURE_SERIALIZATION=1):
    the checkpoint's tensors, on the model's device, through parley's worker load of named tensors
    (weights.worker.WorkerExtension._parley_load_named), as a version from the learner's buffers."""
    from safetensors.torch import load_file

    device = next(worker.model_runner.get_model().parameters()).device
    named = [(k, v.to(device)) for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()]
    return worker._parley_load_named(named, 1)


def perturbed_copy(model_dir: str, dest: Path, noise: float, seed: int = 0) -> Path:
    """A copy of checkpoint `model_dir` in `dest` with every weight w replaced by w * (1 + noise * N(0, 1))
    (bf16, as the engine serves it), tokenizer files alongside."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.parameters():  # parameters() gives a tied weight once: perturbed once
            t.mul_(1 + noise * torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    for f in Path(model_dir).iterdir():  # tokenizer and chat template: the engine reads them from here too
        if f.is_file() and not (dest / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy2(f, dest / f.name)
    return dest


def learner_logprobs(args, samples, dtype, model_dir=None):
    import torch
    from transformers import AutoModelForCausalLM

    from parley.learner.logprobs import token_logprobs
    from parley.learner.packing import build_batch, pack_by_tokens

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = model_dir or args.model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    out = [None] * len(samples)
    for group in pack_by_tokens([len(s.token_ids) for s in samples], args.budget):
        batch = build_batch([samples[i] for i in group], device)
        lp, _ = token_logprobs(model, batch, chunk=1024, grad=False)
        for j, i in enumerate(group):
            out[i] = lp[batch.seq == j].double().cpu()
    del model
    torch.cuda.empty_cache()
    return torch.cat(out)


def main(args) -> dict:
    import numpy as np
    import torch

    from bench.common import random_qwen3
    from parley.engines.models import ensure_model
    from parley.learner.packing import Sample

    if args.build:
        t0 = time.perf_counter()
        random_qwen3(args.build, args.model)
        print(f"[logprob] built {args.build} checkpoint in {args.model} ({time.perf_counter() - t0:.0f} s)", flush=True)
    args.model = str(ensure_model(args.model))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab - 10, size=args.plen).tolist() for _ in range(args.n)]
    warm = [rng.integers(10, vocab - 10, size=args.plen).tolist() for _ in range(args.n)]
    reload_dir = None
    if args.reload:
        import os
        import tempfile

        if args.reload_path == "bare":  # the engine core takes a function (_bare_load) only so
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

        reload_dir = perturbed_copy(args.model, Path(tempfile.mkdtemp(prefix="logprob_reload_")), args.noise)
    outs, start, prompts = asyncio.run(sample(args, prompts, reload_dir, warm, vocab))
    behaviour = torch.tensor([lp for o in outs for lp in o.logprobs], dtype=torch.float64)
    samples = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        mask = [0] * len(p) + [1] * len(o.token_ids)
        samples.append(Sample(f"s{i}", p + list(o.token_ids), mask, [0.0] * len(p) + list(o.logprobs), 0.0))
    result = {
        "model": args.model,
        "samples": len(samples),
        "engine_start_s": start,
        "eager": args.eager,
        "torch_compile": not args.no_torch_compile,
        "cudagraph_mode": args.cudagraph_mode if args.no_torch_compile else None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "reload": f"perturbed copy, noise {args.noise}, {args.reload_path} path" if args.reload else None,
        "prefix": args.prefix,
        # prompt tokens the measured round took from vLLM's prefix cache (--prefix: a first round's sequences)
        "cached_prompt_tokens": sum(o.cached_tokens for o in outs),
        "prompt_tokens": sum(len(p) for p in prompts),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    try:
        import vllm

        result["vllm"] = vllm.__version__
    except ImportError:  # pragma: no cover
        pass
    lp16 = learner_logprobs(args, samples, torch.bfloat16, reload_dir)
    lp32 = learner_logprobs(args, samples, torch.float32, reload_dir)
    if reload_dir is not None:  # which weights did the engine sample from after the swap?
        result["original_bf16_vs_vllm"] = stats(learner_logprobs(args, samples, torch.bfloat16) - behaviour)
    result["learner_bf16_vs_vllm"] = stats(lp16 - behaviour)
    result["learner_fp32_vs_vllm"] = stats(lp32 - behaviour)
    result["learner_bf16_vs_fp32"] = stats(lp16 - lp32)
    per_seq = torch.stack([(lp16[s] - behaviour[s]).sum() for s in _slices(outs)])
    result["sequence_logratio_bf16_abs"] = {"mean": float(per_seq.abs().mean()), "max": float(per_seq.abs().max())}
    return result


def _slices(outs):
    i = 0
    for o in outs:
        yield slice(i, i + len(o.token_ids))
        i += len(o.token_ids)


def table(r: dict) -> str:
    lines = [
        "| comparison | tokens | mean | std | mean abs | p50 abs | p90 abs | p99 abs | p99.9 abs | max abs | "
        "ratio outside [0.8, 1.28] |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ("learner_bf16_vs_vllm", "learner_fp32_vs_vllm", "learner_bf16_vs_fp32", "original_bf16_vs_vllm"):
        if key not in r:
            continue
        s = r[key]
        lines.append(
            f"| {key} | {s['tokens']} | {s['mean']:+.4f} | {s['std']:.4f} | {s['mean_abs']:.4f} | "
            f"{s['p50_abs']:.4f} | {s['p90_abs']:.4f} | {s['p99_abs']:.4f} | {s['p999_abs']:.4f} | "
            f"{s['max_abs']:.4f} | {100 * s['ratio_outside_clip']:.2f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (built there with --build), or tiny / smol")
    p.add_argument("--build", choices=["0.6b", "4b"], default=None, help="build a random Qwen3 of this shape first")
    p.add_argument("--n", type=int, default=64, help="sampled sequences")
    p.add_argument("--plen", type=int, default=128, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=512, help="new tokens per sequence")
    p.add_argument(
        "--budget", type=int, default=8192, help="packed micro-batch tokens (the learner's micro_batch_tokens)"
    )
    p.add_argument("--gpu-mem", type=float, default=0.5)
    p.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs / torch.compile")
    p.add_argument(
        "--no-torch-compile",
        action="store_true",
        help="vLLM without torch.compile (compilation mode NONE), with --cudagraph-mode's CUDA graphs",
    )
    p.add_argument(
        "--cudagraph-mode",
        default="FULL",
        help="with --no-torch-compile: vLLM's cudagraph_mode (FULL, FULL_DECODE_ONLY, ...)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=get_args(KVCacheDtype),
        default="auto",
        help="vLLM's KV cache format ([actor.engine] kv_cache_dtype): fp8's share of the gap to the learner",
    )
    p.add_argument(
        "--reload",
        action="store_true",
        help="sample once, load a perturbed copy of the weights in place (as between versions), sample again, compare",
    )
    p.add_argument("--noise", type=float, default=0.05, help="with --reload: the perturbation's relative size")
    p.add_argument(
        "--reload-path",
        choices=["bare", "file"],
        default="bare",
        help="with --reload: the tensors through the workers' load (the actors' path from the learner's "
        "buffers; default) or the checkpoint files through vLLM's layer-wise reload",
    )
    p.add_argument(
        "--prefix",
        action="store_true",
        help="measure a next turn: each prompt extends a first round's sequence, whose KV the prefix cache "
        "holds (prefill over cached context, as a conversation's later turns)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.cudagraph_mode != "FULL" and not a.no_torch_compile:
        p.error(f"--cudagraph-mode {a.cudagraph_mode} is read with --no-torch-compile only: add it, or drop the mode")
    if a.prefix and a.reload:
        p.error(
            "--prefix and --reload: a swap salts the prompts anew, so the next turn would take nothing from the cache; give one"
        )
    if a.noise <= 0 and a.reload:
        p.error(f"--noise {a.noise}: a perturbation must be > 0 to tell the two weights apart")
    r = main(a)
    print(table(r))
    print(json.dumps({k: v for k, v in r.items() if not isinstance(v, dict)}))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
