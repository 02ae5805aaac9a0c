"""The learning benchmark of issue 20: does a policy trained on `hidden_goal` get better at it?

For each seed: `parley up --env hidden_goal` trains the policy through the real roles (nats-server,
actor with the programmatic user in-process, scorer without a judge, DeepSpeed learner) for N steps
on that seed's goals; then the held-out goals of that seed are played by version 0 (the base model)
and by version N (the last weights, exported from the run), through evaluation.runner as `parley
eval` plays them, and scored by the environment's reward. It prints per seed the held-out means of
every hidden_goal column at both versions with the item-paired difference, then the paired mean
difference of goal_match over the seeds with its 95% t interval (t over the per-seed differences,
n - 1 degrees of freedom). Figures and the command: docs/benchmarks.md ("Learning on hidden_goal").

    python bench/env_learning.py --out runs/env_learning

Its defaults are the run `parley up --env hidden_goal` makes (read from environments/hidden_goal
PRESET: preset_defaults), over seeds 0, 1 and 2.

Nothing in parley imports this file; CI does not run it (tests/integration/test_bench_smoke.py may).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = "hidden_goal"
METRIC = "goal_match"


def preset_defaults() -> dict:
    """The argument defaults: the settings of hidden_goal's preset (what `parley up --env hidden_goal`
    trains), read from the config they resolve to, so the two cannot drift apart."""
    from parley.config.run import default_config_path, load_config
    from parley.environments.hidden_goal import PRESET

    cfg = load_config(default_config_path(), [f"env.name={json.dumps(ENV)}", *PRESET])
    lc, options = cfg.learner, cfg.env.options
    return {
        "steps": lc.steps,
        "n": cfg.rollout.n,
        "groups_per_step": lc.groups_per_step,
        "lr": lc.lr,
        "max_tokens": cfg.rollout.max_tokens,
        "max_new_turns": cfg.rollout.max_new_turns,
        "n_items": options["n_items"],
        "nudge": options["nudge"],
        "answer": options["answer"],
        "kl_coef": lc.kl_coef,
        "eval_fraction": cfg.data.eval_fraction,
        "train_temperature": cfg.actor.sampling.temperature,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smol", help="policy: smol | tiny | a checkpoint dir")
    p.add_argument(
        "--seeds",
        default="0,1,2",
        help="comma-separated seeds: each draws its own goals and split "
        "([env] options.seed, [data] split_seed) and its own training",
    )
    p.add_argument("--steps", type=int, help="GRPO steps per seed (N <= 30)")
    p.add_argument("--n", type=int, help="group size ([rollout] n)")
    p.add_argument("--groups-per-step", type=int, help="[learner] groups_per_step")
    p.add_argument("--lr", type=float, help="[learner] lr")
    p.add_argument("--max-tokens", type=int, help="tokens per assistant turn, in training and eval")
    p.add_argument("--max-new-turns", type=int, help="messages added after the opening line")
    p.add_argument("--n-items", type=int, help="goals drawn per seed ([env] options.n_items)")
    p.add_argument("--nudge", help="[env] options.nudge: fixed | slots (the user names the slots not asked yet)")
    p.add_argument(
        "--answer", help="[env] options.answer: final (the FINAL line) | mentions (the last message's words)"
    )
    p.add_argument("--kl-coef", type=float, help="[learner] kl_coef (0: no reference forward pass in a step)")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="> 0: train a LoRA adapter of this rank ([learner.lora], alpha 2 x rank, every linear "
        "layer; the actors serve it as a vLLM adapter); 0: full fine-tuning",
    )
    p.add_argument("--eval-fraction", type=float, help="goals held out ([data] eval_fraction)")
    p.add_argument("--eval-seeds", type=int, default=2, help="conversations per held-out goal and version")
    p.add_argument(
        "--train-temperature",
        type=float,
        help="actor.sampling.temperature: the policy samples at it in training, the learner recomputes softmax(logits / T)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="the eval's sampling temperature (default: --train-temperature, the distribution that was trained)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one seed's `parley up` may take")
    p.add_argument("--eval-items", type=int, default=0, help="evaluate only the first K held-out goals (0 = all)")
    p.add_argument(
        "--eval-only", action="store_true", help="skip training: evaluate version 0 only (to debug the eval)"
    )
    p.add_argument("--trained", action="store_true", help="skip training: evaluate the runs already under --out")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "env_learning")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.set_defaults(**preset_defaults())
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.temperature is None:
        args.temperature = args.train_temperature
    if not 1 <= args.steps <= 30:
        p.error(f"--steps {args.steps}: the benchmark trains 1..30 steps")
    if not args.seeds:
        p.error("--seeds: give at least one seed")
    return args


def env_options(args, seed: int) -> dict:
    return {"n_items": args.n_items, "seed": seed, "nudge": args.nudge, "answer": args.answer}


def overrides(args, seed: int) -> list[str]:
    """The run's settings, as `--set` overrides of the embedded default (deploy/configs/default.toml)."""
    options = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env_options(args, seed).items())
    return [
        f"env.name={json.dumps(ENV)}",
        f"env.options={{{options}}}",
        f"data.eval_fraction={args.eval_fraction}",
        f"data.split_seed={seed}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}",
        f"rollout.max_new_turns={args.max_new_turns}",
        f"learner.groups_per_step={args.groups_per_step}",
        f"learner.lr={args.lr}",
        f"learner.kl_coef={args.kl_coef}",
        f"actor.sampling.temperature={args.train_temperature}",
        f"learner.checkpoint_every={args.steps}",  # one DeepSpeed checkpoint, after the last step
        f"learner.seed={seed}",
        f"policy.model={json.dumps(args.model)}",
        f"actor.engine.model={json.dumps(args.model)}",
        "learner.eval_every=0",  # the held-out eval is this script's, after training
        "learner.keep_versions=2",
    ] + (
        [
            "learner.lora.enabled=true",
            f"learner.lora.rank={args.lora_rank}",
            f"learner.lora.alpha={2.0 * args.lora_rank}",
            f"actor.engine.max_lora_rank={args.lora_rank}",
        ]
        if args.lora_rank
        else []
    )


def train(args, seed: int, run_dir: Path) -> float:
    """`parley up` for args.steps steps; its output goes to RUN_DIR/up.log. Returns the wall time."""
    cmd = [
        sys.executable,
        "-m",
        "parley.deploy.cli",
        "up",
        "--env",
        ENV,
        "--steps",
        str(args.steps),
        "--no-live",
        "--run-dir",
        str(run_dir),
    ]
    for o in overrides(args, seed):
        cmd += ["--set", o]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / f"seed{seed}.cmd").write_text(" ".join(cmd) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    with (run_dir.parent / f"seed{seed}.up.log").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, timeout=args.timeout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"seed {seed}: `parley up` exited {proc.returncode} after {seconds:.0f}s; "
            f"see {run_dir.parent / f'seed{seed}.up.log'} and {run_dir / 'logs'}"
        )
    return seconds


def data_config(args, seed: int):
    from parley.config.learner import DataConfig

    return DataConfig(eval_fraction=args.eval_fraction, split_seed=seed)


async def evaluate(args, seed: int, versions: dict[int, str]) -> list:
    """Play the seed's held-out goals with each version (version -> weights dir, "" = the base model)
    on one engine, reloading the weights in place between versions. Returns the EvalRecords."""
    import msgspec

    from parley.config.scorer import ScorerConfig
    from parley.engines.backend import open_engine
    from parley.engines.config import EngineConfig
    from parley.environments import registry
    from parley.evaluation.runner import Condition, EvalServices, EvalSettings, Policy, run_eval
    from parley.protocol.messages import Sampling

    env = registry.load(ENV, env_options(args, seed))
    _, held = env.tasks.train_eval(data_config(args, seed))
    held = held[: args.eval_items] if args.eval_items > 0 else held
    engine_cfg = EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=256 << 20)
    engine, tok, _ = await asyncio.to_thread(open_engine, engine_cfg)
    settings = EvalSettings(
        sim_prompt="",
        assistant_max_tokens=args.max_tokens,
        max_new_turns=args.max_new_turns,
        seeds=args.eval_seeds,
        sampling=Sampling(temperature=args.temperature),
        concurrency=16,
        run=f"bench-s{seed}",
    )
    records = []
    try:
        for version, weights in versions.items():
            if weights:
                await engine.reload_weights(weights, version=version)

            async def open_policy(model, version=version):
                return Policy(engine=engine, tokenizer=tok, version=version)

            services = EvalServices(open_policy=open_policy, sim=None, judge=None, scorer_cfg=ScorerConfig(), env=env)
            cond = Condition(name=f"v{version}", model=weights or args.model)
            t0 = time.perf_counter()
            recs = await run_eval([cond], held, settings, services)
            print(
                f"seed {seed}: v{version} played {len(recs)} conversations in {time.perf_counter() - t0:.0f}s",
                flush=True,
            )
            records += [msgspec.structs.replace(r, version=version) for r in recs]
    finally:
        await asyncio.to_thread(engine.shutdown)
    return records


def export_last(run_dir: Path, version: int, merge: bool = False) -> Path:
    """The version as a standalone checkpoint; a LoRA run's merged into its base (`parley export --merge`)."""
    from parley.learner.checkpoint import export_version

    return export_version(run_dir, version, run_dir / "export" / f"v{version}", merge=merge)


def one_seed(args, seed: int) -> dict:
    from parley.environments import registry
    from parley.evaluation.benchmark import summarize, to_markdown
    from parley.evaluation.evallog import write_parquet

    run_dir = args.out / f"seed{seed}"
    train_s = 0.0
    versions = {0: ""}
    if not args.eval_only:
        train_s = 0.0 if args.trained else train(args, seed, run_dir)
        versions[args.steps] = str(export_last(run_dir, args.steps, merge=args.lora_rank > 0))
    t0 = time.perf_counter()
    records = asyncio.run(evaluate(args, seed, versions))
    eval_s = time.perf_counter() - t0
    write_parquet(records, args.out / f"seed{seed}.records.parquet")
    env = registry.load(ENV, env_options(args, seed))
    scored = [r for r in records if r.metrics]
    table = summarize(scored, baseline="v0", env=env)
    (args.out / f"seed{seed}.table.md").write_text(to_markdown(table))
    rows = {r.condition: r for r in table.rows}
    out = {
        "seed": seed,
        "train_s": round(train_s, 1),
        "eval_s": round(eval_s, 1),
        "items": rows["v0"].n,
        "unscored": len(records) - len(scored),
        "final_line": {
            c: sum(
                "final:" in (r.messages[-1].content.lower() if r.messages else "") for r in records if r.condition == c
            )
            / max(1, sum(r.condition == c for r in records))
            for c in rows
        },
        "means": {c: row.means for c, row in rows.items()},
    }
    last = f"v{args.steps}"
    if last in rows:
        d = rows[last].diffs[METRIC]
        out["item_paired"] = {"diff": d.mean_diff, "ci": [d.ci_low, d.ci_high], "p": d.p, "n": d.n}
    return out


def summary_table(args, results: list[dict]) -> tuple[str, dict]:
    from parley.evaluation.benchmark import paired_stats

    last = f"v{args.steps}"
    lines = [
        f"| seed | items | train (s) | eval (s) | v0 {METRIC} | {last} {METRIC} | diff [95% CI over items] "
        f"| v0 exact | {last} exact | v0 turns | {last} turns | FINAL line v0 / {last} |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        m0, m1 = r["means"]["v0"], r["means"].get(last, {})
        ip = r.get("item_paired")
        diff = f"{ip['diff']:+.3f} [{ip['ci'][0]:+.3f}, {ip['ci'][1]:+.3f}]" if ip else "-"
        lines.append(
            f"| {r['seed']} | {r['items']} | {r['train_s']:.0f} | {r['eval_s']:.0f} | {m0[METRIC]:.3f} | "
            f"{m1.get(METRIC, float('nan')):.3f} | {diff} | {m0['exact']:.3f} | {m1.get('exact', float('nan')):.3f} | "
            f"{m0['assistant_turns']:.2f} | {m1.get('assistant_turns', float('nan')):.2f} | "
            f"{r['final_line']['v0']:.2f} / {r['final_line'].get(last, float('nan')):.2f} |"
        )
    data: dict = {"seeds": results}
    trained = [r for r in results if last in r["means"]]
    if trained:
        s = paired_stats([r["means"][last][METRIC] for r in trained], [r["means"]["v0"][METRIC] for r in trained])
        data["paired_over_seeds"] = {
            "metric": METRIC,
            "diff": s.mean_diff,
            "ci": [s.ci_low, s.ci_high],
            "t": s.t,
            "df": s.df,
            "p": s.p,
            "n": s.n,
        }
        lines += [
            "",
            f"{METRIC} {last} - v0, paired over {s.n} seeds: {s.mean_diff:+.4f}, 95% CI "
            f"[{s.ci_low:+.4f}, {s.ci_high:+.4f}] (t = {s.t:.2f}, df = {s.df}, p = {s.p:.3g}; "
            f"t interval over the per-seed differences)",
        ]
    return "\n".join(lines), data


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for seed in args.seeds:
        results.append(one_seed(args, seed))
        (args.out / "results.json").write_text(json.dumps(results, indent=1))  # what is done survives a crash
        print(summary_table(args, results)[0], flush=True)
    table, data = summary_table(args, results)
    details = (
        f"{args.model}, {ENV} (nudge {args.nudge}, answer {args.answer}), {args.steps} steps x {args.groups_per_step} groups x n={args.n}, lr {args.lr}, "
        + (f"LoRA rank {args.lora_rank}, " if args.lora_rank else "full fine-tuning, ")
        + f"kl_coef {args.kl_coef}, temperature {args.train_temperature} (eval {args.temperature}), max_tokens {args.max_tokens}, max_new_turns {args.max_new_turns}, load {os.getloadavg()[0]:.1f}"
    )
    report(
        "env_learning",
        details,
        time.perf_counter() - t0,
        table,
        {**data, "args": {k: str(v) for k, v in vars(args).items()}},
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
