"""Learning check for the staleness defaults: does an asynchronous run (max_staleness 1 or 2,
stale_policy drop or correct) reach the same reward as the synchronous one in no more steps?

Real parts: the toy Qwen3 (engines.models.build_tiny) trained by learner.trainer.Trainer (DeepSpeed
ZeRO-2 on CPU/gloo) with the GRPO objective of learner.grpo, exactly as `parley learner` steps.
The rollouts are sampled from the policy itself, temperature 1, with the behaviour log-probs
recorded by the sampling model. The reward is synthetic and computed from the sampled tokens: the
share of sampled tokens whose id is below 256 (about 12% for the random toy model).

Staleness is replayed, not guessed: for every step, bench/async_vs_sync.py's simulate() (the
feeder's gate, the actor's task slots, oldest complete group first, the drop rule) on the same
long-tailed workload gives each trained group's lag L; the group is sampled from the weights of
version (step - L). So the drop runs train only groups with L <= max_staleness, the correct runs
also the stragglers beyond it, in the proportions the throughput bench measures.

Each version's reward is measured on fixed held-out prompts sampled from the current weights
(not on the stale training samples). A run reaches the target at the first step whose mean reward
over the last `--window` versions is >= `--target`.

    nice -n 10 .venv/bin/python bench/staleness_learning.py                # 5 configurations x 3 seeds
    nice -n 10 .venv/bin/python bench/staleness_learning.py --seeds 1 --configs 0:drop 2:correct
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT, NEW = 6, 16  # prompt and sampled tokens per sequence
GOOD_BELOW = 256  # reward: share of sampled token ids below this


def reward(ids, prompt_len: int = PROMPT):
    """(B,) share of the sampled tokens (after the prompt) whose id is below GOOD_BELOW."""
    return (ids[:, prompt_len:] < GOOD_BELOW).float().mean(dim=1)


def sample(model, prompts, n: int, gen):
    """n samples of NEW tokens per prompt from `model` (temperature 1, no top-p: the distribution
    the learner's log-probs describe), and the raw log-prob of each sampled token."""
    import torch

    ids = torch.tensor([p for p in prompts for _ in range(n)])
    lps = []
    with torch.no_grad():
        for _ in range(NEW):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            lps.append(logp.gather(1, nxt)[:, 0])
            ids = torch.cat([ids, nxt], dim=1)
    return ids, torch.stack(lps, dim=1)


def schedule(staleness: int, policy: str, steps: int) -> list[list[int]]:
    """Per step, the lag of each trained group, from the throughput bench's simulation (its default
    workload: 4 groups x n = 4 per step, 16 slots, lognormal rollouts, a 0.4 s step)."""
    from bench.async_vs_sync import Workload, simulate

    a = argparse.Namespace(
        groups_per_step=4, n=4, task_slots=0, slots=16, step_s=0.4, stale_policy=policy, old_gate=False
    )
    return simulate(staleness, a, Workload(0.25, 1.0), steps=steps)["lags"]


def one_run(model_dir: Path, staleness: int, policy: str, seed: int, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from parley.config.learner import LearnerConfig
    from parley.learner.grpo import group_advantages
    from parley.learner.packing import Sample
    from parley.learner.trainer import Trainer

    lags = schedule(staleness, policy, args.max_steps)
    cfg = LearnerConfig(
        zero_stage=2,
        lr=args.lr,
        kl_coef=0.0,
        max_staleness=staleness,
        stale_policy=policy,
        seed=seed,
        micro_batch_tokens=1024,
    )
    trainer = Trainer(cfg, model_dir)
    sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(1000 + seed)
    eval_gen = torch.Generator().manual_seed(2000 + seed)
    eval_prompts = [torch.randint(3, 2000, (PROMPT,), generator=eval_gen).tolist() for _ in range(args.eval_prompts)]
    snapshots = {0: {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}}
    history, reached, stats = [], None, []
    try:
        for step in range(args.max_steps + 1):
            cpu0 = time.process_time()
            sampler.load_state_dict(snapshots[step])
            g = torch.Generator().manual_seed(3000 + seed)  # the same eval draws for every version
            ids, _ = sample(sampler, eval_prompts, args.eval_samples, g)
            history.append(float(reward(ids).mean()))
            window = history[-args.window :]
            if reached is None and len(window) == args.window and statistics.fmean(window) >= args.target:
                reached = step
                break
            if step == args.max_steps:
                break
            group_lags = lags[step]
            prompts = [torch.randint(3, 2000, (PROMPT,), generator=gen).tolist() for _ in group_lags]
            samples = []
            # the groups of one behaviour version are sampled together (one batch per version)
            for behaviour in sorted({max(0, step - lag) for lag in group_lags}):
                mine = [gi for gi, lag in enumerate(group_lags) if max(0, step - lag) == behaviour]
                sampler.load_state_dict(snapshots[behaviour])
                ids, lps = sample(sampler, [prompts[gi] for gi in mine], args.n, gen)  # (len(mine) * n, ...)
                adv = group_advantages(reward(ids).reshape(len(mine), args.n)).reshape(-1)  # (len(mine) * n,)
                for j in range(ids.shape[0]):
                    samples.append(
                        Sample(
                            f"s{step}-{mine[j // args.n]}-{j % args.n}",
                            ids[j].tolist(),
                            [0] * PROMPT + [1] * NEW,
                            [0.0] * PROMPT + lps[j].tolist(),
                            float(adv[j]),
                        )
                    )
            cpu = time.process_time()
            st = trainer.train_step(samples)
            if args.verbose:
                print(
                    f"  step {step}: reward {history[-1]:.3f}, lags {group_lags}, clip_frac {st.get('clip_frac', 0):.3f}, "
                    f"train {st['train_s']:.2f} s wall {time.process_time() - cpu:.2f} s cpu, "
                    f"sampling {cpu - cpu0:.2f} s cpu",
                    flush=True,
                )
            stats.append(
                {
                    "max_lag": max(group_lags),
                    "clip_frac": st.get("clip_frac", 0.0),
                    "ratio_max": st.get("ratio_max", 1.0),
                }
            )
            snapshots[step + 1] = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
            for old in [v for v in snapshots if v < step + 1 - max(group_lags + [10])]:
                del snapshots[old]
    finally:
        trainer.close()
    stale = [s for s in stats if s["max_lag"] > 0]
    return {
        "max_staleness": staleness,
        "stale_policy": policy,
        "seed": seed,
        "reached": reached,
        "rewards": history,
        "final": history[-1],
        "groups_beyond_bound": sum(lag > staleness for st in lags[: len(stats)] for lag in st),
        "clip_frac_stale_steps": statistics.fmean(s["clip_frac"] for s in stale) if stale else 0.0,
        "ratio_max": max((s["ratio_max"] for s in stats), default=1.0),
    }


def reseeded(base: Path, out: Path, seed: int) -> Path:
    """The toy model of `base` (its tokenizer and config) with weights initialised from `seed`,
    as build_tiny(seed=seed) would make them, without training the tokenizer again."""
    if seed == 0:
        return base
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(base, out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base)).to(torch.float32)
    model.save_pretrained(out)
    return out


def seed_runs(model_dir: Path, configs, seed: int, args) -> list[dict]:
    """Every configuration for one seed (one process of the pool when --jobs > 1)."""
    import logging
    import os

    import torch

    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # The toy's matrices are tiny: more threads only add synchronisation, which on a shared
    # machine (a thread waiting for one that is not scheduled) costs more than the work.
    torch.set_num_threads(args.threads)
    rows = []
    for k, pol in configs:
        t = time.perf_counter()
        r = one_run(model_dir, k, pol, seed, args)
        r["wall_s"] = time.perf_counter() - t
        rows.append(r)
        print(
            f"max_staleness {k} {pol} seed {seed}: target at step {r['reached']}, "
            f"final {r['final']:.2f}, {r['wall_s']:.0f} s",
            flush=True,
        )
    return rows


def table(rows: list[dict], args) -> str:
    configs = []
    for r in rows:
        key = (r["max_staleness"], r["stale_policy"])
        if key not in configs:
            configs.append(key)
    lines = [
        f"target: mean reward over {args.window} versions >= {args.target} (start ~0.12), "
        f"at most {args.max_steps} steps; lr {args.lr}; {args.n} samples x 4 groups per step",
        "",
        "| max_staleness | stale_policy | steps to target per seed | mean | groups beyond the bound "
        "| clip frac (steps with lag > 0) | ratio max | reward at the end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, p in configs:
        rs = [r for r in rows if (r["max_staleness"], r["stale_policy"]) == (k, p)]
        steps = [r["reached"] for r in rs]
        shown = ", ".join(str(s) if s is not None else f">{args.max_steps}" for s in steps)
        mean = statistics.fmean(s if s is not None else args.max_steps + 1 for s in steps)
        finals = ", ".join(f"{r['final']:.2f}" for r in rs)
        mean_s = f"{mean:.1f}" + ("" if all(s is not None for s in steps) else " (a seed missed: counted max+1)")
        lines.append(
            f"| {k}{' (sync)' if k == 0 else ''} | {p} | {shown} | {mean_s} | "
            f"{sum(r['groups_beyond_bound'] for r in rs)} | {statistics.fmean(r['clip_frac_stale_steps'] for r in rs):.3f} | "
            f"{max(r['ratio_max'] for r in rs):.2f} | {finals} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["0:drop", "1:drop", "2:drop", "1:correct", "2:correct"],
        help="max_staleness:stale_policy pairs (0 = synchronous)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (toy model init, prompts, sampling)")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--target", type=float, default=0.5, help="reward level to reach")
    p.add_argument("--window", type=int, default=3, help="versions averaged for the target")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--n", type=int, default=4, help="samples per group (the throughput bench's n)")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--jobs", type=int, default=3, help="processes: the seeds run side by side")
    p.add_argument("--verbose", action="store_true", help="print every step")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    configs = []
    for c in args.configs:
        k, _, pol = c.partition(":")
        if not k.isdigit() or pol not in ("drop", "correct"):
            raise SystemExit(f"--configs {c!r}: use max_staleness:stale_policy, e.g. 2:correct")
        configs.append((int(k), pol))

    import os

    from parley.engines.models import build_tiny

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="parley-stl-") as tmp:
        base = build_tiny(Path(tmp) / "tiny0", seed=0)
        models = {s: reseeded(base, Path(tmp) / f"tiny{s}", s) for s in range(args.seeds)}
        jobs = [(models[s], configs, s, args) for s in range(args.seeds)]
        if args.jobs > 1:
            import multiprocessing

            with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
                per_seed = pool.starmap(seed_runs, jobs)
        else:
            per_seed = [seed_runs(*j) for j in jobs]
    rows = [
        r
        for k, pol in configs
        for runs in per_seed
        for r in runs
        if (r["max_staleness"], r["stale_policy"]) == (k, pol)
    ]
    seconds = time.perf_counter() - t0
    print(f"staleness learning check: {os.cpu_count()} cores, {seconds:.0f} s")
    print(table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
