"""One GRPO step of parley's learner beside one of TRL's GRPOTrainer, on the same batch from the same
weights, on CPU: do the two optimizer steps agree?

    python bench/step_match.py --json bench/results/raw/step_match_smol.json  # SmolLM2, fp32, ~6 min on 2 cores
    python bench/step_match.py --micro-batch-tokens 64 --trl-micro-batch 2    # several micro-batches a side
    python bench/step_match.py --dtype bfloat16                               # bf16 weights on both sides

(PYTHONPATH: the repository, then a site with TRL 1.16 and datasets, after the venv's own packages.)

What it does.
1. The batch: one group of rollout.n hidden_goal conversations played on CPU from the initial weights
   by parley's conversation loop (bench/peer_trl.py's Player on HFEngine: transformers' generate, fp32,
   the recipe's sampling), scored by parley's scorer. Tasks are the feeder's, in its order; the first
   group whose rewards are not all equal is taken (--groups caps the tries). Written once per model
   (WORK/batch-MODEL.pkl; --fresh plays it again). The random `tiny` model never reaches a goal, so all
   its groups score alike (-0.15): --model smol (the default) is the one that gives a batch.
2. parley: the real learner, learner.trainer.Trainer(LearnerConfig) on DeepSpeed (gloo, one process),
   with the recipe's [learner] (bench/peer_trl.load_recipe: hidden_goal's preset, behaviour_correction
   = "truncated_is") but dtype = --dtype and compile off; samples by learner.grpo.samples_of from the
   group; one train_step per --micro-batch-tokens value. Recorded: the loss, DeepSpeed's gradient norm,
   the full gradient before the optimizer (deepspeed.utils.safe_get_full_grad, before engine.step: the
   unclipped, accumulated gradient), per-token log-probs / advantages / IS weights, the weights after.
   Also the gradient of the same loss in one plain-torch pass over the whole batch (the reference the
   micro-batch accumulation must reproduce).
3. TRL: trl.GRPOTrainer with peer_trl.trl_kwargs(cfg) (max_steps = 1, no vLLM on CPU), fed the same
   conversations by a rollout_func (peer_trl.trl_sample: prompt_ids, completion_ids, env_mask, the
   behaviour log-probs) and the same reward totals. On the GPU TRL runs with vLLM and so applies its
   token_truncate IS weight min(exp(logp_old - logp_vllm), is_cap); without vLLM TRL skips it, so it is
   switched on here (the config's vllm_importance_sampling_* and `trainer.use_vllm = True` after the
   trainer is built: the rollout_func path touches no vLLM object; --no-trl-is leaves it off). One
   run per --trl-micro-batch (per_device_train_batch_size; the rest by gradient accumulation).
   Recorded: the loss, the pre-clip gradient (in Trainer._clip_grad_norm, before it clips), its norm,
   the advantages, masks, log-probs and IS weights TRL used, the weights after.
4. Compared (each side in a process of its own: DeepSpeed's process group and accelerate's state do not
   share one): rewards, advantages, trained tokens, per-token log-probs and IS weights; the loss; the
   gradient before clipping (cosine, norm ratio, max |diff|, overall and worst tensor); the update
   dtheta = theta_after - theta_before (the same). One Adam step from zero state moves each weight by
   about lr * g / (|g| + eps), i.e. lr * sign(g): dtheta is nearly blind to the gradient's scale
   (normalization, clipping, accumulation factors), so the gradient comparison is the one that tells
   whether the losses are the same; dtheta tells whether the optimizers are.

Nothing in parley imports this file; TRL is needed only by the TRL side (not for --help). The unit test
of the comparison math is tests/unit/test_bench_step_match.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/step_match.py`
    sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "bfloat16")


# ---- the comparison math (pure; tests/unit/test_bench_step_match.py) ----------------------------


def compare(a, b) -> dict[str, float]:
    """Two tensors of one shape (flattened, float64): cosine, |b| / |a|, max |a - b|, |a - b| / |a|."""
    import torch

    x, y = a.detach().double().flatten(), b.detach().double().flatten()
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    na, nb = float(x.norm()), float(y.norm())
    cos = float(torch.dot(x, y) / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    diff = float((x - y).norm())
    return {
        "cos": cos,
        "norm_a": na,
        "norm_b": nb,
        "ratio": nb / na if na > 0 else (1.0 if nb == 0 else math.inf),
        "max_abs": float((x - y).abs().max()) if x.numel() else 0.0,
        "rel": diff / na if na > 0 else (0.0 if diff == 0 else math.inf),
    }


def compare_dicts(a: dict, b: dict) -> dict[str, Any]:
    """Per-tensor and overall compare() of two {name: tensor} with the same names; `worst` is the
    tensor of lowest cosine."""
    import torch

    if set(a) != set(b):
        raise ValueError(f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
    names = sorted(a)
    per = {n: compare(a[n], b[n]) for n in names}
    overall = compare(
        torch.cat([a[n].double().flatten() for n in names]), torch.cat([b[n].double().flatten() for n in names])
    )
    worst = min(names, key=lambda n: per[n]["cos"]) if names else None
    return {"overall": overall, "worst": worst, "worst_cos": per[worst]["cos"] if worst else None, "per_tensor": per}


def deltas(before: dict, after: dict) -> dict:
    """{name: after - before} in float64."""
    return {n: after[n].double() - before[n].double() for n in before}


def clip_coef(norm: float, max_norm: float) -> float:
    """The factor torch's clip_grad_norm_ (and DeepSpeed's) scales gradients by: min(1, max / (norm + 1e-6))."""
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0


def adam_first_update(grad, lr: float, eps: float = 1e-8, betas: tuple[float, float] = (0.9, 0.999)):
    """The change torch's AdamW (no weight decay) makes at its first step from zero state: m = (1-b1) g,
    v = (1-b2) g^2, bias-corrected to g and g^2, so -lr * g / (sqrt(g^2) + eps)."""
    b1, b2 = betas
    m = (1 - b1) * grad / (1 - b1)
    v = (1 - b2) * grad * grad / (1 - b2)
    return -lr * m / (v.sqrt() + eps)


def per_sample_lists(values, seq, n_samples: int) -> list[list[float]]:
    """A packed per-token vector and its sample index (seq) as one list per sample, in order."""
    out: list[list[float]] = [[] for _ in range(n_samples)]
    for v, s in zip(values, seq):
        out[int(s)].append(float(v))
    return out


def max_list_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |a - b| over two ragged lists of the same shape (inf if the shapes differ)."""
    if [len(x) for x in a] != [len(x) for x in b]:
        return math.inf
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


# ---- the batch -------------------------------------------------------------------------------------


def recipe(args):
    from bench.peer_trl import load_recipe

    return load_recipe(args.config, args.sets, env=args.env, steps=args.groups, model=args.model)


def make_batch(args, out: Path) -> dict:
    """Play groups from the initial weights until one has rewards that are not all equal; pickle it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.peer_trl import HFEngine, Player, Record, build_items
    from parley.engines.models import ensure_model
    from parley.rollout.score import score_trajectory

    cfg = recipe(args)
    env = cfg.env.load()
    items = build_items(cfg, env)
    path = ensure_model(cfg.policy.model)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    player = Player(cfg, env, items, tok, Record(t0=time.time()))
    n = cfg.rollout.n
    tried = []
    for task in items.train[: args.groups]:
        trajs = player.play(HFEngine(model, tok), [(task.task_id, k) for k in range(n)], player.train_policy, 0)
        scored = [
            asyncio.run(score_trajectory(t, None, cfg.scorer, reward=env.reward, scorer="step_match")) for t in trajs
        ]
        totals = [s.total for s in scored]
        tried.append({"task_id": task.task_id, "rewards": totals})
        print(f"[step_match] group {task.task_id}: rewards {[round(r, 4) for r in totals]}", flush=True)
        if len(set(totals)) > 1:
            batch = {"task_id": task.task_id, "scored": scored, "model_path": str(path), "tried": tried}
            out.write_bytes(pickle.dumps(batch))
            return batch
    raise SystemExit(f"step_match.py: no group of the first {args.groups} had rewards that differ: {tried}")


# ---- parley's side ----------------------------------------------------------------------------------


def parley_side(args, batch: dict, mbt: int, out: Path) -> None:
    import msgspec
    import torch
    from transformers import AutoModelForCausalLM

    import parley.learner.trainer as trainer_mod
    from parley.learner import grpo
    from parley.learner.groups import Group, Taken
    from parley.learner.logprobs import token_logprobs
    from parley.learner.packing import build_batch

    cfg = recipe(args)
    lc = msgspec.structs.replace(cfg.learner, dtype=args.dtype, compile="off", micro_batch_tokens=mbt)
    group = Group(batch["task_id"], first_seen=0.0, samples={s.sample: s for s in batch["scored"]})
    samples = grpo.samples_of(
        [Taken(group, correct=False, staleness=0)], scale=lc.scale_advantages, std=lc.adv_std, ref=False
    )
    ids = [s.traj_id for s in samples]
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16

    # the same loss in one plain-torch pass over the whole batch (what accumulation must reproduce)
    plain = AutoModelForCausalLM.from_pretrained(batch["model_path"], dtype=dtype, attn_implementation="sdpa")
    whole = build_batch(samples)
    logp, _ = token_logprobs(plain, whole, grad=True)
    loss, _ = grpo.batch_loss(logp, whole, lc)
    loss.backward()
    plain_grad = {n: p.grad.detach().float().clone() for n, p in plain.named_parameters() if p.grad is not None}
    plain_loss = float(loss.detach())
    del plain

    # the learner, with hooks that only read
    tokens: list[dict] = []
    built: list[list[str]] = []
    real_build, real_loss = trainer_mod.build_batch, grpo.batch_loss

    def build(samples_, device="cpu"):
        built.append([s.traj_id for s in samples_])
        return real_build(samples_, device)

    def batch_loss(logp_, b, cfg_, ref=None):
        loss_, st = real_loss(logp_, b, cfg_, ref)
        names = built[-1]
        cur = logp_.detach().float()
        tokens.append(
            {
                "traj": [ids.index(names[int(s)]) for s in b.seq.tolist()],
                "logp": cur.tolist(),
                "behaviour": b.behaviour.tolist(),
                "adv": b.advantages.tolist(),
                "is_weight": torch.exp((cur - b.behaviour).clamp(-20, 20)).clamp(max=lc.is_cap).tolist(),
                "loss": float(loss_.detach()),
                "n": b.n_loss_tokens,
            }
        )
        return loss_, st

    trainer_mod.build_batch, trainer_mod.grpo.batch_loss = build, batch_loss
    tr = trainer_mod.Trainer(lc, batch["model_path"])
    named = [(n, p) for n, p in tr.module.named_parameters() if p.requires_grad]
    before = {n: p.detach().float().clone() for n, p in named}
    grads: dict = {}
    opt = tr.engine.optimizer
    if hasattr(opt, "unscale_and_clip_grads"):  # ZeRO 1-2: the flat fp32 gradient partition, before it is clipped
        name_of = {id(p): n for n, p in named}
        real_clip = opt.unscale_and_clip_grads
        group = iter(range(len(opt.round_robin_bit16_groups)))

        def clip(flat, total_norm):
            i, off = next(group), 0  # one rank: the partition is the whole group, its parameters in order
            for p in opt.round_robin_bit16_groups[i]:
                grads[name_of[id(p)]] = flat[0][off : off + p.numel()].detach().float().clone().view(p.shape)
                off += p.numel()
            return real_clip(flat, total_norm)

        opt.unscale_and_clip_grads = clip
    else:  # ZeRO-0: the gradients are the parameters' own until the step clips them
        real_step = tr.engine.step

        def step(*a, **k):
            grads.update({n: p.grad.detach().float().clone() for n, p in named if p.grad is not None})
            return real_step(*a, **k)

        tr.engine.step = step
    stats = tr.train_step(samples)
    after = {n: p.detach().float().clone() for n, p in named}
    torch.save(
        {
            "side": "parley",
            "micro_batch_tokens": mbt,
            "learner": msgspec.to_builtins(lc),
            "stats": stats,
            "advantages": [s.advantage for s in samples],
            "rewards": [s.total for s in batch["scored"]],
            "n_trained": sum(s.n_trained for s in samples),
            "tokens": tokens,
            "before": before,
            "after": after,
            "grad": grads,
            "plain_grad": plain_grad,
            "plain_loss": plain_loss,
        },
        out,
    )


# ---- TRL's side -------------------------------------------------------------------------------------


def trl_side(args, batch: dict, micro: int, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.peer_trl import pickle_site_modules_by_name, trl_kwargs, trl_sample

    pickle_site_modules_by_name()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    cfg = recipe(args)
    lc = cfg.learner
    tok = AutoTokenizer.from_pretrained(batch["model_path"])
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    kw = trl_kwargs(cfg, output_dir=str(args.work / f"trl-{micro}"), vllm=False, gpu=False, micro_batch=micro)
    kw.update(max_steps=1, model_init_kwargs={"dtype": args.dtype}, bf16=False)
    if args.trl_is:  # what trl_kwargs sets under vLLM (the GPU run), switched on below without vLLM
        kw.update(
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=lc.is_cap if lc.behaviour_correction == "truncated_is" else lc.dual_clip,
        )
    scored = sorted(batch["scored"], key=lambda s: s.sample)
    samples = [trl_sample(s.trajectory) for s in scored]
    fixed = {k: [s[k] for s in samples] for k in samples[0]}
    fixed["parley_total"] = [s.total for s in scored]
    calls = []

    def rollout_func(prompts, trainer):
        if list(prompts) != [batch["task_id"]] * len(scored):
            raise RuntimeError(f"TRL asked for {prompts}, not the group {batch['task_id']} x {len(scored)}")
        calls.append(len(prompts))
        return {k: list(v) for k, v in fixed.items()}

    def parley_total(prompts, completions, parley_total, **_):
        return parley_total

    logs: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args_, state, control, logs=None, **k):
            if logs:
                seen.append(dict(logs))

    seen = logs
    trainer = GRPOTrainer(
        model=batch["model_path"],
        reward_funcs=parley_total,
        args=GRPOConfig(**kw),
        train_dataset=Dataset.from_dict({"prompt": [batch["task_id"]] * 4}),
        processing_class=tok,
        rollout_func=rollout_func,
        callbacks=[Logs()],
    )
    if args.trl_is:
        trainer.use_vllm = True  # only the IS branches read it on the rollout_func path
        trainer._last_loaded_step = trainer.state.global_step  # no vLLM weight sync before the rollout
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    before = {n: p.detach().float().clone() for n, p in named}
    gen: dict = {}
    losses: list[float] = []
    grads: dict = {}
    real_gen, real_loss, real_clip = (
        trainer._generate_and_score_completions,
        trainer._compute_loss,
        trainer._clip_grad_norm,
    )

    def generate(inputs):
        o = real_gen(inputs)
        for k in (
            "advantages",
            "completion_mask",
            "tool_mask",
            "old_per_token_logps",
            "sampling_per_token_logps",
            "importance_sampling_ratio",
            "num_items_in_batch",
        ):
            if k in o and o[k] is not None:
                gen[k] = o[k].detach().float().clone() if torch.is_tensor(o[k]) else o[k]
        return o

    def compute_loss(model, inputs):
        loss = real_loss(model, inputs)
        losses.append(float(loss.detach()))
        return loss

    def clip(model):
        for n, p in named:
            grads[n] = p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(before[n])
        return real_clip(model)

    trainer._generate_and_score_completions, trainer._compute_loss, trainer._clip_grad_norm = (
        generate,
        compute_loss,
        clip,
    )
    trainer.train()
    after = {n: p.detach().float().clone() for n, p in named}
    mask = gen["completion_mask"] * gen.get("tool_mask", 1.0)
    per_row = lambda t: [t[i][mask[i] > 0].tolist() for i in range(t.shape[0])]  # noqa: E731
    torch.save(
        {
            "side": "trl",
            "micro_batch": micro,
            "trl_config": {k: v for k, v in kw.items() if isinstance(v, (int, float, str, bool, type(None)))},
            "use_vllm_is": args.trl_is,
            "logs": logs,
            "rollout_calls": calls,
            "advantages": gen["advantages"].tolist(),
            "num_items_in_batch": float(gen["num_items_in_batch"]),
            "mask_per_row": [int(x) for x in mask.sum(1).tolist()],
            "old_logp": per_row(gen["old_per_token_logps"]) if "old_per_token_logps" in gen else None,
            "sampling_logp": per_row(gen["sampling_per_token_logps"]) if "sampling_per_token_logps" in gen else None,
            "is_weight": per_row(gen["importance_sampling_ratio"]) if "importance_sampling_ratio" in gen else None,
            "losses": losses,
            "before": before,
            "after": after,
            "grad": grads,
        },
        out,
    )


# ---- the comparison ---------------------------------------------------------------------------------


def fmt(c: dict) -> str:
    return f"cos {c['cos']:.6f} (1-cos {1 - c['cos']:.2g})  |b|/|a| {c['ratio']:.6f}  max|a-b| {c['max_abs']:.3g}  |a-b|/|a| {c['rel']:.3g}"


def summarize(p: dict, t: dict, max_norm: float, lr: float) -> dict[str, Any]:
    """parley's record `p` against TRL's `t`: what each side trained on and what its step did."""
    n = len(p["advantages"])
    lp = {
        k: per_sample_lists([v for m in p["tokens"] for v in m[k]], [s for m in p["tokens"] for s in m["traj"]], n)
        for k in ("logp", "behaviour", "adv", "is_weight")
    }
    trl_norm = next((float(x["grad_norm"]) for x in t["logs"] if "grad_norm" in x), math.nan)
    trl_loss_logged = next((float(x["loss"]) for x in t["logs"] if "loss" in x), math.nan)
    g = compare_dicts(p["grad"], t["grad"])
    gp = compare_dicts(p["plain_grad"], p["grad"])
    gpt = compare_dicts(p["plain_grad"], t["grad"])
    dp, dt = deltas(p["before"], p["after"]), deltas(t["before"], t["after"])
    d = compare_dicts(dp, dt)
    # what one AdamW step from each side's own (clipped) gradient predicts: where dtheta differs, is it the optimizer?
    cp, ct = clip_coef(p["stats"]["grad_norm"], max_norm), clip_coef(trl_norm, max_norm)
    pred_p = {k: adam_first_update(v.double() * cp, lr) for k, v in p["grad"].items()}
    pred_t = {k: adam_first_update(v.double() * ct, lr) for k, v in t["grad"].items()}
    return {
        "rewards": p["rewards"],
        "advantages": {
            "parley": p["advantages"],
            "trl": t["advantages"],
            "max_abs_diff": max(abs(a - b) for a, b in zip(p["advantages"], t["advantages"])),
        },
        "trained_tokens": {
            "parley": p["n_trained"],
            "trl": t["num_items_in_batch"],
            "parley_per_sample": [len(x) for x in lp["logp"]],
            "trl_per_sample": t["mask_per_row"],
        },
        "logp_max_abs_diff": max_list_diff(lp["logp"], t["old_logp"]) if t["old_logp"] else None,
        "behaviour_max_abs_diff": max_list_diff(lp["behaviour"], t["sampling_logp"]) if t["sampling_logp"] else None,
        "is_weight_max_abs_diff": max_list_diff(lp["is_weight"], t["is_weight"]) if t["is_weight"] else None,
        "is_weight_mean": {
            "parley": sum(map(sum, lp["is_weight"])) / max(1, sum(map(len, lp["is_weight"]))),
            "trl": (sum(map(sum, t["is_weight"])) / max(1, sum(map(len, t["is_weight"])))) if t["is_weight"] else None,
        },
        "loss": {
            "parley": p["stats"]["loss"],
            "parley_plain": p["plain_loss"],
            "trl": sum(t["losses"]),
            "trl_logged": trl_loss_logged,
        },
        "grad_norm": {
            "parley": p["stats"]["grad_norm"],
            "parley_plain": gp["overall"]["norm_a"],
            "trl": trl_norm,
            "trl_measured": g["overall"]["norm_b"],
        },
        "clip_coef": {"parley": cp, "trl": ct},
        "micro_batches": {
            "parley": p["stats"]["micro_batches"],
            "trl": t["trl_config"].get("gradient_accumulation_steps"),
        },
        "grad": {k: v for k, v in g.items() if k != "per_tensor"},
        "grad_parley_vs_plain": {k: v for k, v in gp.items() if k != "per_tensor"},
        "grad_trl_vs_plain": {k: v for k, v in gpt.items() if k != "per_tensor"},
        "dtheta": {k: v for k, v in d.items() if k != "per_tensor"},
        "dtheta_parley_vs_adam_prediction": compare_dicts(pred_p, dp)["overall"],
        "dtheta_trl_vs_adam_prediction": compare_dicts(pred_t, dt)["overall"],
        "dtheta_per_tensor": {
            k: {"cos": v["cos"], "ratio": v["ratio"], "max_abs": v["max_abs"]} for k, v in d["per_tensor"].items()
        },
        "grad_per_tensor": {
            k: {"cos": v["cos"], "ratio": v["ratio"], "max_abs": v["max_abs"]} for k, v in g["per_tensor"].items()
        },
    }


def table(label: str, s: dict) -> str:
    L = [f"== {label}"]
    L.append(f"rewards            {[round(r, 4) for r in s['rewards']]}")
    L.append(
        f"advantages         max |parley - trl| {s['advantages']['max_abs_diff']:.3g}  (parley {[round(a, 4) for a in s['advantages']['parley']]})"
    )
    tt = s["trained_tokens"]
    L.append(
        f"trained tokens     parley {tt['parley']}  trl {tt['trl']:.0f}  per sample equal: {tt['parley_per_sample'] == tt['trl_per_sample']}"
    )
    for k in ("logp", "behaviour", "is_weight"):
        v = s[f"{k}_max_abs_diff"]
        L.append(f"{k + ' max|diff|':<19}{'n/a' if v is None else f'{v:.3g}'}")
    L.append(
        f"IS weight mean     parley {s['is_weight_mean']['parley']:.6f}  trl {s['is_weight_mean']['trl'] if s['is_weight_mean']['trl'] is None else round(s['is_weight_mean']['trl'], 6)}"
    )
    lo = s["loss"]
    L.append(
        f"loss               parley {lo['parley']:.6g} (plain one pass {lo['parley_plain']:.6g})  trl {lo['trl']:.6g} (logged {lo['trl_logged']:.6g})"
    )
    gn = s["grad_norm"]
    L.append(
        f"grad norm (pre-clip) parley {gn['parley']:.6g} (plain {gn['parley_plain']:.6g})  trl {gn['trl']:.6g} (measured {gn['trl_measured']:.6g});  clip coef parley {s['clip_coef']['parley']:.4g} trl {s['clip_coef']['trl']:.4g}"
    )
    L.append(f"micro-batches      parley {s['micro_batches']['parley']:.0f}  trl {s['micro_batches']['trl']}")
    L.append(
        f"grad  parley vs trl     {fmt(s['grad']['overall'])}  worst {s['grad']['worst']} 1-cos {1 - s['grad']['worst_cos']:.2g}"
    )
    L.append(f"grad  plain vs parley   {fmt(s['grad_parley_vs_plain']['overall'])}")
    L.append(f"grad  plain vs trl      {fmt(s['grad_trl_vs_plain']['overall'])}")
    L.append(
        f"dθ    parley vs trl     {fmt(s['dtheta']['overall'])}  worst {s['dtheta']['worst']} 1-cos {1 - s['dtheta']['worst_cos']:.2g}"
    )
    L.append(f"dθ    adam(g) vs parley {fmt(s['dtheta_parley_vs_adam_prediction'])}")
    L.append(f"dθ    adam(g) vs trl    {fmt(s['dtheta_trl_vs_adam_prediction'])}")
    return "\n".join(L)


# ---- the driver -------------------------------------------------------------------------------------


def child(args, side: str, value: int, out: Path) -> None:
    """Run one side in a fresh process (DeepSpeed's process group and accelerate's state stay apart)."""
    cmd = [sys.executable, __file__, "--side", side, "--side-value", str(value), "--work", str(args.work)]
    cmd += ["--model", args.model, "--dtype", args.dtype, "--env", args.env, "--groups", str(args.groups)]
    cmd += ["--config", str(args.config)] + [x for s in args.sets for x in ("--set", s)]
    cmd += [] if args.trl_is else ["--no-trl-is"]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-8000:])
        raise SystemExit(f"step_match.py: the {side} side ({value}) failed (rc {res.returncode})")
    print(f"[step_match] {side} {value}: {time.time() - t0:.0f} s", flush=True)


def parse_args(argv=None):
    from bench.peer_trl import DEFAULT_CONFIG, DEFAULT_ENV

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--model", default="smol", help="smol | tiny | a checkpoint dir")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weights both sides train (parley: DeepSpeed bf16 keeps fp32 master weights; TRL: AdamW on bf16 weights)",
    )
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the parley run config the recipe is read from")
    p.add_argument("--env", default=DEFAULT_ENV, help="environment (its preset is laid under --set)")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)"
    )
    p.add_argument("--groups", type=int, default=8, help="tasks to try until a group's rewards differ")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        nargs="+",
        default=[16384, 64],
        help="parley's micro_batch_tokens, one step each (16384: the recipe's, one micro-batch; small: several)",
    )
    p.add_argument(
        "--trl-micro-batch",
        type=int,
        nargs="+",
        default=[8, 2],
        help="TRL's per_device_train_batch_size, one step each (8: the whole group in one)",
    )
    p.add_argument(
        "--no-trl-is",
        dest="trl_is",
        action="store_false",
        help="leave TRL's vLLM importance-sampling weight off (TRL's own behaviour without vLLM)",
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/step_match"), help="the batch and each side's record")
    p.add_argument("--fresh", action="store_true", help="play a new batch even if WORK/batch.pkl exists")
    p.add_argument("--json", type=Path, default=None, help="write the comparisons here")
    p.add_argument("--side", choices=("parley", "trl"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--side-value", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    tag = f"{args.model}-{args.dtype}"
    batch_file = args.work / f"batch-{args.model}.pkl"
    if args.side:
        batch = pickle.loads(batch_file.read_bytes())
        out = args.work / f"{args.side}-{tag}-{args.side_value}{'' if args.trl_is else '-nois'}.pt"
        (parley_side if args.side == "parley" else trl_side)(args, batch, args.side_value, out)
        return 0
    t0 = time.time()
    batch = (
        pickle.loads(batch_file.read_bytes())
        if batch_file.exists() and not args.fresh
        else make_batch(args, batch_file)
    )
    print(
        f"[step_match] batch: task {batch['task_id']}, rewards {[round(s.total, 4) for s in batch['scored']]}",
        flush=True,
    )
    for m in args.micro_batch_tokens:
        child(args, "parley", m, args.work)
    for m in args.trl_micro_batch:
        child(args, "trl", m, args.work)
    import torch

    cfg = recipe(args)
    lc = cfg.learner
    nois = "" if args.trl_is else "-nois"
    results = {}
    for m in args.micro_batch_tokens:
        p = torch.load(args.work / f"parley-{tag}-{m}.pt", weights_only=False)
        for b in args.trl_micro_batch:
            t = torch.load(args.work / f"trl-{tag}-{b}{nois}.pt", weights_only=False)
            label = f"parley micro_batch_tokens={m} ({p['stats']['micro_batches']:.0f} micro-batches) vs TRL per_device_train_batch_size={b}"
            s = summarize(p, t, lc.grad_clip, lc.lr)
            results[label] = s
            print(table(label, s), flush=True)
    data = {
        "command": " ".join(sys.argv),
        "model": args.model,
        "dtype": args.dtype,
        "trl_is": args.trl_is,
        "task_id": batch["task_id"],
        "groups_tried": batch["tried"],
        "seconds": round(time.time() - t0, 1),
        "results": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
