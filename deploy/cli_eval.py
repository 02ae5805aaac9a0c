"""`parley eval`, `parley replay`, `parley select` and `parley data check`: option parsing only. The work
lives in evaluation/commands.py (replay, eval local / nats / fleet), evaluation/runner.py,
evaluation/evallog.py, evaluation/benchmark.py, evaluation/selection.py and evaluation/leakage.py,
imported when a command runs so that `parley --help` stays light. Registered by deploy/commands.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from parley.deploy.common import (
    ConfigOpt,
    DryRunOpt,
    NatsOpt,
    RunOpt,
    SetOpt,
    check_models,
    dry_run,
    model_fields,
    refuse,
    resolve,
    run_async_main,
    setup_logging,
)
from parley.deploy.flags import flag, with_flags

data_app = typer.Typer(help="Dataset tools: leakage checks between training and eval data.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    data_app.command("check", help="Report prompts and reference targets shared by a train and an eval file.")(
        data_check_cmd
    )
    app.add_typer(data_app, name="data")
    app.command("select", help="Name the best evaluated version of a run by a benchmark metric, with its interval.")(
        select_cmd
    )
    app.command("replay", help="Re-score logged conversations without generating and print the benchmark table.")(
        replay_cmd
    )
    app.command(
        "eval",
        help="Run the benchmark: conditions over the same items and simulator seeds, table with paired statistics.",
    )(eval_cmd)


def _fail(cmd: str, message: str, code: int = 2):
    typer.echo(f"parley {cmd}: {message}", err=True)
    raise typer.Exit(code)


def data_check_cmd(
    eval_: Annotated[
        str,
        typer.Option(
            "--eval",
            help="Eval data: 'bundled', a CollabLLM .parquet/.jsonl file or a Hub dataset id (ORG/NAME[@REV][#SPLIT]).",
        ),
    ],
    train: Annotated[
        str,
        typer.Option("--train", help="Training data: 'bundled', a CollabLLM .parquet/.jsonl file or a Hub dataset id."),
    ] = "bundled",
) -> None:
    """Exit 1 when the files share reference targets (label leakage); shared prompts alone are reported."""
    from parley.evaluation.leakage import describe
    from parley.tasks.data import find_overlap, load_items

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


MetricOpt = Annotated[
    str | None,
    typer.Option(
        "--metric",
        help="A selectable column of the run's environment (collabllm_medium: bleu | interactivity | mr; "
        "default: the environment's own choice, mr there); the training reward is refused.",
    ),
]


def select_cmd(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (reads RUN_DIR/eval; see docs/benchmark.md).")],
    metric: MetricOpt = None,
) -> None:
    from parley.evaluation.selection import SelectionError, check_metric, run_environment, select_best

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
            _fail(
                "replay",
                f"--weights {text!r}: write name=number pairs separated by commas, e.g. bleu=1,interactivity=1,token_amount=-0.1",
            )
    return "scorer.weights={" + ", ".join(pairs) + "}"


@with_flags(flag("scorer.bleu_variant", help="BLEU for the replayed rewards; after --scoring's"))
def replay_cmd(
    logs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Eval logs or scored-trajectory dumps (.parquet / .jsonl), directories of them, or a "
            "run directory (its learner archive: every trained and dropped sample of the run)."
        ),
    ] = None,
    stream: Annotated[
        str | None,
        typer.Option("--stream", help="Also read a run's stored 'eval' or 'scored' stream from NATS (--nats, --run)."),
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            "--weights",
            help="Reward weights, e.g. bleu=1,interactivity=1,token_amount=-0.1 (default: the config's scorer.weights).",
        ),
    ] = None,
    scoring: Annotated[
        str | None,
        typer.Option(
            "--scoring",
            help="A named scoring variant: collabllm = the paper's (character BLEU as NLTK computes it, 3-level interactivity, judge extraction); default: the config's [scorer].",
        ),
    ] = None,
    judge: Annotated[
        bool,
        typer.Option(
            "--judge/--no-judge",
            help="Re-judge every conversation with the judge service on --nats (else reuse stored verdicts).",
        ),
    ] = False,
    judge_url: Annotated[
        str | None,
        typer.Option(
            "--judge-url",
            help="Re-judge with another judge: an OpenAI-compatible endpoint (e.g. http://host:8000/v1), asked "
            "from this process with the [judge] prompts; needs --judge-model.",
        ),
    ] = None,
    judge_model: Annotated[
        str | None, typer.Option("--judge-model", help="The model name the --judge-url endpoint serves.")
    ] = None,
    deterministic: Annotated[
        bool,
        typer.Option(
            "--deterministic",
            help="Play the run (a run directory) again with the policy of [actor.engine] and the logged simulator "
            "and judge answers; check the policy's tokens match token for token. Exit 1 on a difference.",
        ),
    ] = False,
    baseline: Annotated[
        str | None, typer.Option("--baseline", help="Condition the others are compared with (default: the first).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write table.md, table.csv, chart.png and records.parquet here.")
    ] = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    flagged=(),
) -> None:
    """Without --judge nothing is generated or judged: BLEU is recomputed from each stored document,
    interactivity and token counts are reused, and the reward column applies the weights."""
    if deterministic:
        _deterministic(logs, config, sets, nats, run, dry)
        return
    if bool(judge_url) != bool(judge_model):
        _fail("replay", "--judge-url and --judge-model go together: the endpoint and the model name it serves")
    extra = [_weight_override(weights)] if weights else []
    if scoring is not None:  # the run's environment names its variants
        env = resolve(config, sets, nats=nats, run=run, extra=extra).env.load()
        variants = env.scoring_variants
        if scoring not in variants:
            allowed = f"use one of {', '.join(variants)}" if variants else f"environment {env.name!r} names none"
            _fail("replay", f"--scoring {scoring!r} not allowed; {allowed} (or leave it out for the config's [scorer])")
        extra += [f'scorer.{k}="{v}"' for k, v in variants[scoring].items()]
    extra += flagged  # after --scoring: an explicit --bleu-variant wins
    cfg = resolve(config, sets, nats=nats, run=run, extra=extra)
    if not logs and not stream:
        _fail("replay", "nothing to replay: give log files and/or --stream eval|scored")
    if stream not in (None, "eval", "scored"):
        _fail("replay", f"--stream {stream!r} not allowed; use eval or scored (TRAJ has no verdicts to reuse)")
    setup_logging("replay")
    from parley.evaluation.evallog import read_records
    from parley.learner.checkpoint import archive_dir

    records = []
    for path in logs or []:
        if archive_dir(path).is_dir():  # a run directory: the learner's archive, which outlives the streams
            path = archive_dir(path)
        try:
            records += read_records(path)
        except (FileNotFoundError, ValueError, TypeError) as e:
            _fail("replay", str(e))
    if dry:
        dry_run(
            cfg, notes=f"replay: {len(records)} logged records" + (f", then the {stream!r} stream" if stream else "")
        )
    from parley.evaluation.commands import replay

    other = _openai_judge(cfg, judge_url, judge_model) if judge_url else None
    run_async_main(replay, cfg, records, stream, judge, baseline, out, scoring, other)


def _openai_judge(cfg, url: str, model: str):
    """The judge at an OpenAI-compatible `url` serving `model`, asked in this process with the run's
    [judge] settings and prompts (services.judge.server.Judge behind services.judge.client.LocalJudge)."""
    import msgspec

    from parley.engines.backend import OpenAIBackend
    from parley.services.judge.client import LocalJudge
    from parley.services.judge.server import Judge

    try:
        backend_cfg = msgspec.structs.replace(cfg.judge, backend="openai", base_url=url, model_name=model)
        return LocalJudge(Judge(OpenAIBackend(backend_cfg), backend_cfg))
    except (TypeError, ValueError) as e:
        _fail("replay", f"--judge-url {url!r} --judge-model {model!r}: {e}")


def _deterministic(logs, config, sets, nats, run, dry) -> None:
    """`parley replay --deterministic RUN_DIR`: evaluation.commands.replay_deterministic."""
    from parley.learner.checkpoint import archive_dir

    if not logs or len(logs) != 1 or not archive_dir(logs[0]).is_dir():
        _fail("replay", f"--deterministic takes one run directory (holding learner/archive/), got {logs or []}")
    cfg = resolve(config, sets, nats=nats, run=run)
    if dry:
        dry_run(cfg, notes=f"replay --deterministic: {logs[0]}")
    setup_logging("replay")
    from parley.evaluation.commands import replay_deterministic

    run_dir = logs[0]

    def weights_of(version: int) -> Path | None:
        """The weights the learner kept of `version` (safetensors), while it still holds them."""
        from parley.learner.checkpoint import weights_dir

        path = weights_dir(run_dir, version)
        return path if any(path.glob("*.safetensors")) else None

    run_async_main(replay_deterministic, cfg, archive_dir(run_dir), weights_of)


@with_flags(
    flag("actor.sampling.temperature", help="Policy sampling temperature"),
    flag("data.allow_overlap", help="Run even if eval items share reference targets with the training data"),
)
def eval_cmd(
    conditions: Annotated[
        list[str] | None,
        typer.Option("--condition", "-C", help="name=MODEL_OR_CHECKPOINT[,system_prompt=FILE] (repeatable)."),
    ] = None,
    baseline: Annotated[
        str | None, typer.Option("--baseline", help="Condition the others are compared with (default: the first).")
    ] = None,
    items: Annotated[
        str | None, typer.Option("--items", help="Eval items file (default: the config's eval split).")
    ] = None,
    protocol: Annotated[
        str | None,
        typer.Option(
            "--protocol",
            help="A named benchmark that fixes the settings and the arms: card = the CollabLLM model card's "
            "(the simulator opens, 14 messages, 4096 tokens, lazy_full, thinking off, n = 100; arms -C base=MODEL, "
            "any -C versions, and proact added on the base model; docs/benchmark.md).",
        ),
    ] = None,
    n_items: Annotated[
        int | None,
        typer.Option(
            "--n-items",
            help="Use the first N eval items (0 or left out: all; --protocol card: 100); more than there are is refused.",
        ),
    ] = None,
    seeds: Annotated[
        int | None, typer.Option("--seeds", help="Simulator seeds per item, the same for every condition (default 1).")
    ] = None,
    sim_prompt: Annotated[
        str | None,
        typer.Option(
            "--user-sim-prompt",
            help="lazy_full | lazy_summary | cooperative (default: the environment's; an environment with a programmatic user takes none).",
        ),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--assistant-max-tokens", help="Tokens per assistant turn (default 4096).")
    ] = None,
    max_new_turns: Annotated[
        int | None, typer.Option("--max-new-turns", help="Messages (user and assistant) per conversation (default 14).")
    ] = None,
    thinking: Annotated[
        bool | None,
        typer.Option("--thinking/--no-thinking", help="Chat-template thinking for the policy (default off)."),
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", help="Conversations of one condition in flight (default 8).")
    ] = None,
    services: Annotated[
        str,
        typer.Option(
            "--services",
            help="local: simulator and judge engines in this process; nats: the running `parley sim` / `parley judge` services; fleet: as nats, and each condition is played by a `parley actor` and scored by a `parley scorer` started for it.",
        ),
    ] = "local",
    out: Annotated[Path | None, typer.Option("--out", help="Output directory (default: RUN_DIR/benchmark).")] = None,
    policy_version: Annotated[
        int,
        typer.Option(
            "--policy-version",
            help="Training version the conditions' checkpoints hold, stored in every record (-1: not a run's version).",
        ),
    ] = -1,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help='Instead of conditions, play one version per JSON line on standard input ({"version": N, "model": DIR, "out": DIR}) with one policy engine that loads each version\'s weights in place; each is answered on standard output. The learner\'s periodic eval runs this (--services nats only).',
        ),
    ] = False,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    nats: NatsOpt = None,
    run: RunOpt = None,
    dry: DryRunOpt = False,
    flagged=(),
) -> None:
    """Every condition plays the same items from scratch (the simulated user speaks first) with the same
    simulator seeds; each conversation is judged, stored in records.parquet (and on the run's EVAL stream
    with --services nats), and the table with paired statistics is printed and written."""

    from parley.config.actor import SIM_PROMPTS

    cfg = resolve(config, sets, nats=nats, run=run, extra=flagged)
    if services not in ("local", "nats", "fleet"):
        _fail("eval", f"--services {services!r} not allowed; use local, nats or fleet")
    if follow and (conditions or services != "nats"):
        _fail(
            "eval",
            "--follow reads its versions from standard input and plays them through the NATS services: "
            "leave out -C and pass --services nats",
        )
    if follow and protocol:
        _fail("eval", "--follow plays the periodic eval's versions under [rollout]; leave out --protocol")
    if not follow and not conditions:
        _fail("eval", "no condition: pass -C name=MODEL_OR_CHECKPOINT (repeatable), or --follow")
    conditions = conditions or []
    try:
        env = cfg.env.load()
    except ValueError as e:
        _fail("eval", str(e))
    from parley.evaluation import protocols

    fixed = dict(
        sim_prompt=sim_prompt,
        max_new_turns=max_new_turns,
        assistant_max_tokens=max_tokens,
        enable_thinking=thinking,
        seeds=seeds,
    )
    proto = None
    if protocol is not None:
        try:
            proto = protocols.protocol(protocol)
        except ValueError as e:
            _fail("eval", str(e))
        if env.name != proto.environment:
            _fail(
                "eval",
                f"--protocol {protocol} is the benchmark of environment {proto.environment!r}; this run's is "
                f"{env.name!r} (set [env] name, or drop --protocol)",
            )
    sim_prompt = sim_prompt or ""
    if sim_prompt and not env.needs_simulator:
        _fail(
            "eval",
            f"--user-sim-prompt {sim_prompt!r}: environment {env.name!r} plays a programmatic user; leave it out",
        )
    if sim_prompt and sim_prompt not in SIM_PROMPTS:
        _fail("eval", f"--user-sim-prompt {sim_prompt!r} not allowed; use one of {', '.join(SIM_PROMPTS)}")
    from parley.evaluation.leakage import LeakageError, guard_environment
    from parley.evaluation.runner import EvalSettings, eval_items, parse_condition

    out = out or cfg.run_dir / ("eval" if follow else "benchmark")
    try:
        conds = [parse_condition(c) for c in conditions]
        asked = ""
        if proto is not None:  # the protocol's settings and arms, checked against what was given
            asked = f"--n-items {n_items}" if n_items is not None else f"--protocol {proto.name} (n = {proto.n_items})"
            applied = protocols.apply(proto, fixed, conds, baseline, n_items)
            fixed, conds, baseline, n_items = applied.settings, applied.conditions, applied.baseline, applied.n_items
        names = [c.name for c in conds]
        if baseline is not None and baseline not in names:
            raise ValueError(f"--baseline {baseline!r} is not one of the conditions {names}")
        settings = EvalSettings(  # what neither the options nor --protocol fix stays EvalSettings' default
            **{
                k: fixed[k]
                for k in ("assistant_max_tokens", "max_new_turns", "seeds", "enable_thinking")
                if fixed[k] is not None
            },
            **({} if concurrency is None else {"concurrency": concurrency}),
            sim_prompt=fixed["sim_prompt"] or "",
            run=cfg.run.name,
            sampling=cfg.actor.sampling,
        )
        train, held = eval_items(cfg.data, items, env)
        if not held:
            raise ValueError("no eval items: pass --items FILE, or set [data] eval_path or eval_fraction > 0")
        if n_items is not None and n_items < 0:
            raise ValueError(f"--n-items {n_items}: expected N >= 0 (0 or left out: all eval items)")
        if n_items:
            # --follow is the periodic eval's child: its [learner] eval_items is "at most", as it always was
            if not follow:
                source = f"--items {items}" if items else "the eval split of [data]"
                protocols.check_n(n_items, len(held), source, asked)
            held = held[:n_items]
        # the learner's guard (learner.service), over the environment's leakage keys (a dry run writes nothing)
        guard_environment(env.tasks, train, held, cfg.data.allow_overlap, None if dry else out)
    except (ValueError, FileNotFoundError) as e:  # LeakageError is a ValueError
        _fail("eval", str(e), code=1 if isinstance(e, LeakageError) else 2)
    fields = {f"--condition {c.name}": c.model for c in conds}
    if services == "local":  # the simulator's and judge's engines start here
        fields |= {k: v for k, v in model_fields(cfg).items() if k.startswith(("sim.", "judge."))}
    problems = check_models(fields, read_config=False)
    if problems:
        refuse("eval", problems)
    notes = f"eval: conditions {', '.join(names) or '(--follow)'} on {len(held)} held-out items; out {out}"
    if proto is not None:
        notes += "\n" + protocols.describe(proto, conds, baseline, len(held))
    if dry:
        dry_run(cfg, notes=notes)
    if proto is not None:
        typer.echo(f"parley eval: {protocols.describe(proto, conds, baseline, len(held))}", err=True)
        protocols.write_record(proto, conds, baseline, len(held), out)
    setup_logging("eval")
    if follow:
        from parley.evaluation.commands import follow as follow_versions

        run_async_main(follow_versions, cfg, held, settings, env)
        return
    from parley.evaluation.commands import run_eval

    run_async_main(
        run_eval,
        cfg,
        conds,
        held,
        settings,
        services,
        baseline or conds[0].name,
        out,
        policy_version,
        env,
        _in_process(cfg),
    )


def _in_process(cfg):
    """The simulator and judge `--services local` runs in this process: the roles' own classes, built
    here (evaluation/ imports no role) and only when a local engine is opened for them."""
    from parley.evaluation.commands import InProcess

    def simulator(backend):
        from parley.services.sim.server import Simulator

        return Simulator(backend, cfg.sim)

    def judge(backend):
        from parley.services.judge.server import Judge

        return Judge(backend, cfg.judge)

    return InProcess(simulator=simulator, judge=judge)
