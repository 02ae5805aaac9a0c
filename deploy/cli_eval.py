"""`parley eval`, `parley replay`, `parley select` and `parley data check`: option parsing only. The work
lives in evaluation/runner.py, evaluation/evallog.py, evaluation/benchmark.py, evaluation/selection.py and
evaluation/leakage.py, imported when a command runs so that `parley --help` stays light. Registered by
deploy/commands.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from deploy.common import ConfigOpt, NatsOpt, RunOpt, SetOpt, resolve, run_async_main, setup_logging

data_app = typer.Typer(help="Dataset tools: leakage checks between training and eval data.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    data_app.command("check", help="Report prompts and reference targets shared by a train and an eval file.")(data_check_cmd)
    app.add_typer(data_app, name="data")
    app.command("select", help="Name the best evaluated version of a run by a benchmark metric, with its interval.")(select_cmd)
    app.command("replay", help="Re-score logged conversations without generating and print the benchmark table.")(replay_cmd)
    app.command("eval", help="Run the benchmark: conditions over the same items and simulator seeds, table with paired statistics.")(eval_cmd)


def _fail(cmd: str, message: str, code: int = 2):
    typer.echo(f"parley {cmd}: {message}", err=True)
    raise typer.Exit(code)


def data_check_cmd(
    eval_: Annotated[str, typer.Option("--eval", help="Eval data: 'bundled' or a CollabLLM .parquet/.jsonl file.")],
    train: Annotated[str, typer.Option("--train", help="Training data: 'bundled' or a CollabLLM .parquet/.jsonl file.")] = "bundled",
) -> None:
    """Exit 1 when the files share reference targets (label leakage); shared prompts alone are reported."""
    from tasks.data import find_overlap, load_items
    from evaluation.leakage import describe

    try:
        train_items, eval_items = load_items(train), load_items(eval_)
    except (FileNotFoundError, ValueError) as e:
        _fail("data check", str(e))
    overlap = find_overlap(train_items, eval_items)
    typer.echo(describe(overlap, len(train_items), len(eval_items)))
    if overlap.leaks:
        _fail(
            "data check",
            f"{len(overlap.references)} reference targets of {eval_} also appear in {train}; "
            "eval on them measures memorization (runs refuse to start unless --allow-overlap)",
            code=1,
        )


MetricOpt = Annotated[Optional[str], typer.Option(
    "--metric", help="A selectable column of the run's environment (collabllm_medium: bleu | interactivity | mr; "
                     "default: the environment's own choice, mr there); the training reward is refused.")]


def select_cmd(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (reads RUN_DIR/eval; see docs/benchmark.md).")],
    metric: MetricOpt = None,
) -> None:
    from evaluation.selection import SelectionError, check_metric, run_environment, select_best

    try:
        env = run_environment(run_dir)
        metric = check_metric(env.eval.select if metric is None else metric, env=env)
        sel = select_best(run_dir, metric, env=env)
    except (SelectionError, ValueError) as e:  # ValueError: an environment that is not installed
        _fail("select", str(e))
    typer.echo(sel.describe())
    for version, mean, n in sel.ranking:
        typer.echo(f"  v{version:<5} {metric} {mean:.4f}  n={n}")


def _weight_override(text: str) -> str:
    """'bleu=1,interactivity=0.5,token_amount=-0.1' -> the TOML override of scorer.weights."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            pairs.append(f"{name.strip()} = {float(value)}")
        except ValueError:
            sep = ""
        if not sep:
            _fail("replay", f"--weights {text!r}: write name=number pairs separated by commas, e.g. bleu=1,interactivity=1,token_amount=-0.1")
    return "scorer.weights={" + ", ".join(pairs) + "}"


def replay_cmd(
    logs: Annotated[
        Optional[list[Path]],
        typer.Argument(help="Eval logs or scored-trajectory dumps (.parquet / .jsonl), directories of them, or a "
                            "run directory (its learner archive: every trained and dropped sample of the run)."),
    ] = None,
    stream: Annotated[
        Optional[str], typer.Option("--stream", help="Also read a run's stored 'eval' or 'scored' stream from NATS (--nats, --run).")
    ] = None,
    weights: Annotated[
        Optional[str], typer.Option("--weights", help="Reward weights, e.g. bleu=1,interactivity=1,token_amount=-0.1 (default: the config's scorer.weights).")
    ] = None,
    bleu_variant: Annotated[Optional[str], typer.Option("--bleu-variant", help="sacrebleu | char (default: the config's scorer.bleu_variant).")] = None,
    scoring: Annotated[
        Optional[str], typer.Option("--scoring", help="A named scoring variant: collabllm = the paper's (character BLEU as NLTK computes it, 3-level interactivity, judge extraction); default: the config's [scorer].")
    ] = None,
    judge: Annotated[
        bool, typer.Option("--judge/--no-judge", help="Re-judge every conversation with the judge service on --nats (else reuse stored verdicts).")
    ] = False,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Condition the others are compared with (default: the first).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Also write table.md, table.csv, chart.png and records.parquet here.")] = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
) -> None:
    """Without --judge nothing is generated or judged: BLEU is recomputed from each stored document,
    interactivity and token counts are reused, and the reward column applies the weights."""
    from scorer.config import SCORING_VARIANTS

    extra = [_weight_override(weights)] if weights else []
    if scoring is not None:
        if scoring not in SCORING_VARIANTS:
            _fail("replay", f"--scoring {scoring!r} not allowed; use one of {', '.join(SCORING_VARIANTS)} (or leave it out for the config's [scorer])")
        extra += [f'scorer.{k}="{v}"' for k, v in SCORING_VARIANTS[scoring].items()]
    if bleu_variant:  # after --scoring: an explicit variant wins
        extra.append(f'scorer.bleu_variant="{bleu_variant}"')
    cfg = resolve(config, sets, nats=nats, run=run, extra=extra)
    if not logs and not stream:
        _fail("replay", "nothing to replay: give log files and/or --stream eval|scored")
    if stream not in (None, "eval", "scored"):
        _fail("replay", f"--stream {stream!r} not allowed; use eval or scored (TRAJ has no verdicts to reuse)")
    setup_logging("replay")
    from evaluation.evallog import read_records

    from learner.checkpoint import archive_dir

    records = []
    for path in logs or []:
        if archive_dir(path).is_dir():  # a run directory: the learner's archive, which outlives the streams
            path = archive_dir(path)
        try:
            records += read_records(path)
        except (FileNotFoundError, ValueError, TypeError) as e:
            _fail("replay", str(e))
    run_async_main(_replay, cfg, records, stream, judge, baseline, out, scoring)


async def _replay(stop, cfg, records, stream, judge, baseline, out, scoring=None) -> int:
    from protocol.messages import EvalRecord
    from evaluation.benchmark import METRICS, summarize, to_markdown, write_table
    from evaluation.evallog import from_scored, read_stream, rejudge, reweight, stored_interactivity_scale, write_parquet

    nc = None
    if stream or judge:
        from protocol.connect import connect

        nc = await connect(cfg.nats.url, name="parley-replay", first_timeout=cfg.nats.connect_timeout_s)
    try:
        if stream:
            stored = await read_stream(nc.jetstream(), cfg.run.name, stream)
            records += [r if isinstance(r, EvalRecord) else from_scored(r) for r in stored]
        if not records:
            typer.echo("parley replay: the logs hold no records", err=True)
            return 2
        sc = cfg.scorer
        clamps = {k: (v[0], v[1]) for k, v in sc.clamps.items()}
        if judge:
            from rollout.judge import JudgeClient, JudgeFailed, JudgeUnavailable
            from rollout.score import Unscorable

            client = JudgeClient(nc, timeout=sc.judge_timeout_s, concurrency=sc.judge_concurrency)
            try:
                records = await rejudge(records, client, sc)
            except (JudgeUnavailable, JudgeFailed, Unscorable) as e:
                typer.echo(f"parley replay: {e}", err=True)
                return 1
        else:
            try:
                # A named variant fixes the scale; otherwise the stored ratings are reused on whatever scale they are.
                records = reweight(records, sc.weights, clamps=clamps, bleu_variant=sc.bleu_variant,
                                   interactivity=sc.interactivity if scoring else None)
            except ValueError as e:
                typer.echo(f"parley replay: {e}", err=True)
                return 2
    finally:
        if nc is not None:
            await nc.drain()
    conditions = list(dict.fromkeys(r.condition for r in records))
    try:
        table = summarize(records, baseline or conditions[0], metrics=(*METRICS, "reward"))
    except ValueError as e:
        typer.echo(f"parley replay: {e}", err=True)
        return 2
    typer.echo(to_markdown(table))
    weights = ", ".join(f"{k}={v:g}" for k, v in sc.weights.items())
    scales = sc.interactivity if judge else "/".join(sorted({stored_interactivity_scale(r) for r in records}))
    typer.echo(f"{len(records)} conversations, BLEU {sc.bleu_variant}, interactivity {scales}, "
               f"reward weights {weights}, {'re-judged' if judge else 'stored verdicts'}")
    if out:
        paths = write_table(table, out)
        paths["records"] = write_parquet(records, Path(out) / "records.parquet")
        typer.echo("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def eval_cmd(
    conditions: Annotated[
        list[str], typer.Option("--condition", "-C", help="name=MODEL_OR_CHECKPOINT[,system_prompt=FILE] (repeatable).")
    ],
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Condition the others are compared with (default: the first).")] = None,
    items: Annotated[Optional[str], typer.Option("--items", help="Eval items file (default: the config's eval split).")] = None,
    n_items: Annotated[int, typer.Option("--n-items", help="Use the first N eval items (0 = all; the reference uses 100).")] = 0,
    seeds: Annotated[int, typer.Option("--seeds", help="Simulator seeds per item, the same for every condition.")] = 1,
    sim_prompt: Annotated[str, typer.Option("--user-sim-prompt", help="lazy_full | lazy_summary | cooperative (default: the environment's; an environment with a programmatic user takes none).")] = "",
    max_tokens: Annotated[int, typer.Option("--assistant-max-tokens", help="Tokens per assistant turn.")] = 4096,
    max_new_turns: Annotated[int, typer.Option("--max-new-turns", help="Messages (user and assistant) per conversation.")] = 14,
    thinking: Annotated[bool, typer.Option("--thinking/--no-thinking", help="Chat-template thinking for the policy.")] = False,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Policy sampling temperature (default: the config's actor.temperature).")] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Conversations of one condition in flight.")] = 8,
    services: Annotated[
        str, typer.Option("--services", help="local: simulator and judge engines in this process; nats: the running `parley sim` / `parley judge` services; fleet: as nats, and each condition is played by a `parley actor` and scored by a `parley scorer` started for it.")
    ] = "local",
    allow_overlap: Annotated[bool, typer.Option("--allow-overlap", help="Run even if eval items share reference targets with the training data.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (default: RUN_DIR/benchmark).")] = None,
    policy_version: Annotated[
        int, typer.Option("--policy-version", help="Training version the conditions' checkpoints hold, stored in every record (-1: not a run's version).")
    ] = -1,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
) -> None:
    """Every condition plays the same items from scratch (the simulated user speaks first) with the same
    simulator seeds; each conversation is judged, stored in records.parquet (and on the run's EVAL stream
    with --services nats), and the table with paired statistics is printed and written."""
    from actors.config import SIM_PROMPTS

    cfg = resolve(config, sets, nats=nats, run=run)
    if services not in ("local", "nats", "fleet"):
        _fail("eval", f"--services {services!r} not allowed; use local, nats or fleet")
    try:
        env = cfg.env.load()
    except ValueError as e:
        _fail("eval", str(e))
    if sim_prompt and not env.needs_simulator:
        _fail("eval", f"--user-sim-prompt {sim_prompt!r}: environment {env.name!r} plays a programmatic user; leave it out")
    if sim_prompt and sim_prompt not in SIM_PROMPTS:
        _fail("eval", f"--user-sim-prompt {sim_prompt!r} not allowed; use one of {', '.join(SIM_PROMPTS)}")
    from evaluation.runner import EvalSettings, eval_items, parse_condition
    from evaluation.leakage import LeakageError, guard_environment

    out = out or cfg.run_dir / "benchmark"
    try:
        conds = [parse_condition(c) for c in conditions]
        names = [c.name for c in conds]
        if baseline is not None and baseline not in names:
            raise ValueError(f"--baseline {baseline!r} is not one of the conditions {names}")
        settings = EvalSettings(
            sim_prompt=sim_prompt, assistant_max_tokens=max_tokens, max_new_turns=max_new_turns, seeds=seeds,
            thinking=thinking, temperature=cfg.actor.temperature if temperature is None else temperature,
            top_p=cfg.actor.top_p, concurrency=concurrency, run=cfg.run.name,
        )
        train, held = eval_items(cfg.data, items, env)
        held = held[:n_items] if n_items > 0 else held
        if not held:
            raise ValueError("no eval items: pass --items FILE, or set [data] eval_path or eval_fraction > 0")
        # the learner's guard (learner.service): collabllm_medium's keys are its reference and prompt
        guard_environment(env.tasks, train, held, allow_overlap or cfg.data.allow_overlap, out)
    except (ValueError, FileNotFoundError) as e:  # LeakageError is a ValueError
        _fail("eval", str(e), code=1 if isinstance(e, LeakageError) else 2)
    setup_logging("eval")
    run_async_main(_eval, cfg, conds, held, settings, services, baseline or conds[0].name, out, policy_version, env)


async def _eval(stop, cfg, conds, held, settings, services, baseline, out, policy_version=-1, env=None) -> int:
    import asyncio

    import msgspec

    from protocol.bus import Poison, Retry
    from evaluation.fleet import FleetError
    from evaluation.runner import EvalServices, NotScored, Policy, run_eval
    from rollout.judge import LocalJudge
    from rollout.sim import LocalSim
    from evaluation.evallog import write_parquet

    env = env or cfg.env.load()
    nc = sim = judge = None
    closers = []
    if services in ("nats", "fleet"):
        from rollout.sim import SimClient
        from protocol import topology
        from protocol.bus import publish
        from protocol.connect import connect
        from rollout.judge import JudgeClient

        nc = await connect(cfg.nats.url, name="parley-eval", first_timeout=cfg.nats.connect_timeout_s,
                           creds=cfg.nats.creds or None, ca_file=cfg.nats.ca_file or None)
        js = nc.jetstream()
        await topology.ensure_topology(js, cfg.run.name, cfg.bus)
        # an environment without an LLM user or judge metrics asks no such service
        if env.needs_simulator:
            sim = SimClient(nc, timeout_s=cfg.actor.sim_timeout_s, wait_s=cfg.actor.sim_wait_s)
        if env.needs_judge:
            judge = JudgeClient(nc, timeout=cfg.scorer.judge_timeout_s, concurrency=cfg.scorer.judge_concurrency)

        async def publish_record(rec):
            await publish(js, cfg.run.name, "eval", rec)
    else:
        from engines.backend import LocalBackend, make_backend
        from actors.sim import Simulator
        from scorer.judge import Judge

        sim_backend = judge_backend = None
        if env.needs_simulator:  # blocks while a local engine loads; none for a programmatic user
            sim_backend = make_backend(cfg.sim)
            closers.append(sim_backend.close)
            sim = LocalSim(Simulator(sim_backend, cfg.sim))
        if env.needs_judge:
            if sim_backend is not None and cfg.judge.backend == cfg.sim.backend == "vllm" and cfg.judge.engine == cfg.sim.engine:
                # One engine serves both roles when they name the same model and settings.
                judge_backend = LocalBackend(sim_backend.engine, sim_backend.tokenizer, model_name=sim_backend.model_name,
                                             template_kwargs=sim_backend.template_kwargs, owns_engine=False)
            else:
                judge_backend = make_backend(cfg.judge)
                closers.append(judge_backend.close)
            judge = LocalJudge(Judge(judge_backend, cfg.judge))
        publish_record = None

    async def open_policy(model: str) -> Policy:
        from engines.backend import open_engine

        # The policy engine takes the actor's engine settings with the condition's model or checkpoint.
        engine, tokenizer, _ = open_engine(msgspec.structs.replace(cfg.actor.engine, model=model))

        async def close():
            await asyncio.to_thread(engine.shutdown)

        return Policy(engine=engine, tokenizer=tokenizer, version=policy_version, close=close)

    svc = EvalServices(open_policy=open_policy, sim=sim, judge=judge, scorer_cfg=cfg.scorer,
                       template_kwargs=dict(cfg.actor.engine.chat_template_kwargs), env=env)
    done: list = []  # finished conversations, kept when the run is interrupted
    missing: list[NotScored] = []  # per conversation: not played or not scored, and why

    async def on_record(rec):
        done.append(rec)
        if publish_record is not None:
            await publish_record(rec)

    if services == "fleet":
        work = asyncio.create_task(_fleet(nc, js, cfg, conds, held, settings, out, policy_version, stop, on_record,
                                          missing.append, env))
    else:
        if services == "nats" and sim is not None and judge is not None:  # the bounds slow services are waited for
            typer.echo(f"parley eval: waits for the judge up to [scorer] judge_wait_s={cfg.scorer.judge_wait_s:.0f}s per "
                       f"conversation ({settings.judge_attempts} verdicts at most), for the simulator {sim.attempts} x "
                       f"[actor] sim_timeout_s={sim.timeout_s:.0f}s per message; what is still missing then is reported", err=True)
        work = asyncio.create_task(run_eval(conds, held, settings, svc, on_record, missing.append))
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() or stop.is_set():  # Ctrl-C / SIGTERM: keep what is finished, skip the table
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            if done:
                path = write_parquet(done, Path(out) / "records.parquet")
                typer.echo(f"parley eval: interrupted; {len(done)} finished conversations in {path}", err=True)
            return 130
        try:
            records = work.result()
        # Retry / Poison: the simulator service answered garbage or stayed unreachable (rollout.sim.SimClient)
        except (FleetError, Retry, Poison) as e:
            if done:
                write_parquet(done, Path(out) / "records.parquet")
            hint = "" if isinstance(e, FleetError) else "; is `parley sim` (or `parley services`) running on this NATS?"
            typer.echo(f"parley eval: {e}{hint}", err=True)
            return 1
    finally:
        stopped.cancel()
        for close in closers:
            await close()
        if nc is not None:
            await nc.drain()
    return _report(records, missing, len(conds) * len(held) * settings.seeds, baseline, out, env)


def _report(records, missing, expected: int, baseline: str, out, env=None) -> int:
    """Write the records, the per-conversation report of what was not scored, and the table of what was.
    Exit 0 with a table (some conversations may be unscored, each named); 3 when nothing was scored:
    no table then, and no traceback, only the reasons."""
    from evaluation.benchmark import summarize, to_markdown, write_table
    from evaluation.evallog import write_parquet
    from evaluation.runner import write_unscored

    out = Path(out)
    path = write_parquet(records, out / "records.parquet") if records else None
    report = write_unscored(missing, out)
    scored = [r for r in records if r.metrics]
    if missing:
        typer.echo(f"parley eval: {expected - len(scored)} of {expected} conversations not scored ({report}):", err=True)
        for m in missing:
            typer.echo(f"  {m.describe()}", err=True)
        if path is not None and len(scored) < len(records):
            typer.echo(f"  the played ones can be scored later with `parley replay {path} --judge`", err=True)
    if not scored:
        typer.echo(f"parley eval: no conversation was scored, so there is no table; the reasons are above and in {report}", err=True)
        return 3
    try:
        table = summarize(scored, baseline, env=env)
    except ValueError as e:  # e.g. the baseline condition has no scored conversation
        typer.echo(f"parley eval: no table: {e}", err=True)
        return 3
    paths = write_table(table, out)
    typer.echo(to_markdown(table))
    typer.echo(f"wrote {path}, {report}, " + ", ".join(str(p) for p in paths.values()))
    return 0


async def _fleet(nc, js, cfg, conds, held, settings, out, policy_version, stop, on_record, on_missing, env=None) -> list:
    """--services fleet: one condition after another, each through its own actor and scorer."""
    import logging

    from deploy.config import dump_config
    from evaluation.fleet import FleetSettings, play_condition_fleet
    from evaluation.runner import NotScored, make_tasks

    log = logging.getLogger("parley.eval")
    import msgspec

    fleet_dir = Path(out) / "fleet"
    fleet_dir.mkdir(parents=True, exist_ok=True)
    config_path = fleet_dir / "config.toml"
    # The actors sample as the in-process modes do: the eval's temperature, top_p, thinking and concurrency.
    engine = msgspec.structs.replace(
        cfg.actor.engine, chat_template_kwargs={**cfg.actor.engine.chat_template_kwargs, "enable_thinking": settings.thinking})
    actor = msgspec.structs.replace(cfg.actor, temperature=settings.temperature, top_p=settings.top_p,
                                    concurrency=settings.concurrency, engine=engine)
    config_path.write_text(dump_config(msgspec.structs.replace(cfg, actor=actor)))
    sim_model = cfg.sim.engine.model if cfg.sim.backend == "vllm" else cfg.sim.model_name
    fs = FleetSettings(config_path=config_path, logs_dir=fleet_dir, sim_model=sim_model, policy_version=policy_version,
                       env={"PARLEY_NATS_URL": cfg.nats.url})  # the URL this eval resolved, over any inherited one
    tasks = make_tasks(held, settings, env)
    records = []
    for cond in conds:
        t0 = time.perf_counter()
        recs, lost = await play_condition_fleet(nc, js, cfg, cond, tasks, fs, stop, on_record)
        log.info("condition %s: %d conversations in %.1fs through the fleet (%d unscored, %d lost)", cond.name, len(recs),
                 time.perf_counter() - t0, sum(not r.metrics for r in recs), len(lost))
        by_task = {t.task_id: t for t in tasks}
        for task_id in lost:
            task = by_task[task_id]
            on_missing(NotScored(eval_id=f"{cond.name}/{task.item_id}/{task.seed}", condition=cond.name, item_id=task.item_id,
                                 stage="conversation", reason="the fleet's actor dead-lettered the task (see the fleet logs)"))
        for rec in recs:
            if not rec.metrics:
                on_missing(NotScored(eval_id=rec.eval_id, condition=cond.name, item_id=rec.item_id, stage="judge",
                                     reason="the fleet's scorer dead-lettered the trajectory (see the fleet logs)"))
        records += recs
        if stop.is_set():
            break
    return records
