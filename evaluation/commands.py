"""What `parley replay` and `parley eval` do once their options are parsed (deploy/cli_eval.py parses
them and calls these through run_async_main): `replay` re-scores logged records and prints the table;
`run_eval` plays the benchmark with the simulator and judge in this process, through the NATS services,
or through a fleet of actors and scorers (evaluation/fleet.py), and `report` writes what came of it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def eval_engine(actor_engine, model: str | None = None):
    """The [actor.engine] section as the eval's policy engine opens it, on `model` (None: the actor's):
    each version or checkpoint measured over KV of its own weights (no prefix cache kept across versions)
    and in the model's dtype (an fp8 KV cache is the actor's trade of speed for exactness, not the weights'
    score). deploy.memory plans the periodic eval's engine from it too."""
    import msgspec

    return msgspec.structs.replace(
        actor_engine,
        model=actor_engine.model if model is None else model,
        prefix_cache_across_versions=False,
        kv_cache_dtype="auto",
    )


def _out(message: str) -> None:
    print(message, flush=True)


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class InProcess:
    """The simulator and judge `--services local` runs in this process, built by the caller from a
    backend (deploy/ builds services.sim.server.Simulator and services.judge.server.Judge: evaluation/ imports no role).
    simulator(backend) answers `reply(SimRequest)`, judge(backend) answers `handle(op, JudgeRequest)`."""

    simulator: Callable[[Any], Any]
    judge: Callable[[Any], Any]


async def replay(stop, cfg, records, stream, judge, baseline, out, scoring=None, other_judge=None) -> int:
    """`parley replay` after its options: re-judge (`judge`: the judge service on the bus; or
    `other_judge`, a judge the caller built, e.g. on an OpenAI-compatible endpoint) or re-weight the
    records (and those of the run's stored `stream`), print the table and write it to `out`. The exit code."""
    from parley.evaluation.benchmark import METRICS, flags_markdown, summarize, to_markdown, write_table
    from parley.evaluation.evallog import (
        as_records,
        read_stream,
        rejudge,
        reweight,
        stored_interactivity_scale,
        write_parquet,
    )

    nc = None
    judge = judge or other_judge is not None
    if stream or (judge and other_judge is None):
        from parley.runtime.role import connect_nats

        nc = await connect_nats(cfg.nats, name="parley-replay")
    try:
        if stream:
            stored = await read_stream(nc.jetstream(), cfg.run.name, stream)
            records += as_records(stored)
        if not records:
            _err("parley replay: the logs hold no records")
            return 2
        sc = cfg.scorer
        clamps = {k: (v[0], v[1]) for k, v in sc.clamps.items()}
        if judge:
            from parley.rollout.score import Unscorable
            from parley.services.judge.client import JudgeClient, JudgeFailed, JudgeUnavailable

            client = other_judge or JudgeClient(nc, timeout=sc.judge_timeout_s, concurrency=sc.judge_concurrency)
            try:
                records = await rejudge(records, client, sc)
            except (JudgeUnavailable, JudgeFailed, Unscorable) as e:
                _err(f"parley replay: {e}")
                return 1
        else:
            try:
                # A named variant fixes the scale; otherwise the stored ratings are reused on whatever scale they are.
                records = reweight(
                    records,
                    sc.weights,
                    clamps=clamps,
                    bleu_variant=sc.bleu_variant,
                    interactivity=sc.interactivity if scoring else None,
                )
            except ValueError as e:
                _err(f"parley replay: {e}")
                return 2
    finally:
        if nc is not None:
            await nc.drain()
    conditions = list(dict.fromkeys(r.condition for r in records))
    try:
        table = summarize(records, baseline or conditions[0], metrics=(*METRICS, "reward"))
    except ValueError as e:
        _err(f"parley replay: {e}")
        return 2
    _out(to_markdown(table))
    if text := flags_markdown(table):
        _out(text)
    weights = ", ".join(f"{k}={v:g}" for k, v in sc.weights.items())
    scales = sc.interactivity if judge else "/".join(sorted({stored_interactivity_scale(r) for r in records}))
    _out(
        f"{len(records)} conversations, BLEU {sc.bleu_variant}, interactivity {scales}, "
        f"reward weights {weights}, {'re-judged' if judge else 'stored verdicts'}"
    )
    if out:
        paths = write_table(table, out)
        paths["records"] = write_parquet(records, Path(out) / "records.parquet")
        _out("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


async def replay_deterministic(stop, cfg, archive: Path, weights_of=None) -> int:
    """`parley replay --deterministic RUN_DIR`: the run's archived samples (`archive`, the learner's
    archive of RUN_DIR) played again with the configured policy ([actor.engine] for version 0, then each
    version whose weights `weights_of(version)` finds in RUN_DIR) and the logged simulator and judge
    answers (evaluation/replay.py); the exit code is 0 only when every replayed sample matched."""
    import msgspec

    from parley.engines.backend import open_engine
    from parley.evaluation.replay import logged_samples
    from parley.evaluation.replay import replay_deterministic as replay_all

    try:
        records = logged_samples(archive)
    except FileNotFoundError as e:
        _err(f"parley replay: {e}")
        return 2
    # the replay plays each version over KV of its own: exact, whatever the run's prefix_cache_across_versions
    exact = msgspec.structs.replace(cfg.actor.engine, prefix_cache_across_versions=False)
    engine, tokenizer, path = open_engine(exact, sampled_logprobs=True)  # blocks while vLLM loads
    try:
        report = await replay_all(
            records,
            engine,
            tokenizer,
            max_model_len=cfg.actor.engine.max_model_len,
            rollout=cfg.rollout,
            reward=cfg.env.load().reward,
            weights_of=weights_of,
        )
    finally:
        engine.shutdown()
    _out(report.describe())
    _out(f"policy {cfg.actor.engine.model} ({path}); {len(records)} logged samples")
    return 0 if report.ok else 1


async def run_eval(
    stop,
    cfg,
    conds,
    held,
    settings,
    services,
    baseline,
    out,
    policy_version=-1,
    env=None,
    in_process: InProcess | None = None,
    open_policy=None,
) -> int:
    """`parley eval` after its options: every condition played and judged as `services` says (local needs
    `in_process`), the records on the run's EVAL stream with nats, then `report`. The exit code.
    `open_policy(model) -> Policy` replaces the default, SwappingPolicies (one engine start per base model,
    the checkpoints of that base swapped into it; `follow` keeps one engine that follows versions)."""
    import asyncio

    from parley.evaluation.evallog import write_parquet
    from parley.evaluation.fleet import FleetError
    from parley.evaluation.runner import EvalServices, NotScored, SwappingPolicies
    from parley.evaluation.runner import run_eval as play_conditions
    from parley.protocol.bus import Poison, Retry
    from parley.services.judge.client import LocalJudge
    from parley.services.sim.client import LocalSim

    env = env or cfg.env.load()
    nc = sim = judge = None
    closers = []
    if services in ("nats", "fleet"):
        from parley.protocol import topology
        from parley.protocol.bus import publish
        from parley.runtime.role import connect_nats
        from parley.services.judge.client import JudgeClient
        from parley.services.sim.client import SimClient

        nc = await connect_nats(cfg.nats, name="parley-eval")
        js = nc.jetstream()
        await topology.ensure_topology(js, cfg.run.name, cfg.bus, stores_versions=False)
        # an environment without an LLM user or judge metrics asks no such service
        if env.needs_simulator:
            sim = SimClient(nc, timeout_s=cfg.actor.sim_timeout_s, wait_s=cfg.actor.sim_wait_s)
        if env.needs_judge:
            judge = JudgeClient(nc, timeout=cfg.scorer.judge_timeout_s, concurrency=cfg.scorer.judge_concurrency)

        async def publish_record(rec):
            await publish(js, cfg.run.name, "eval", rec)
    else:
        from parley.engines.backend import LocalBackend, make_backend

        if in_process is None:
            raise ValueError("--services local needs the in-process simulator and judge builders (InProcess)")

        sim_backend = judge_backend = None
        if env.needs_simulator:  # blocks while a local engine loads; none for a programmatic user
            sim_backend = make_backend(cfg.sim)
            closers.append(sim_backend.close)
            sim = LocalSim(in_process.simulator(sim_backend))
        if env.needs_judge:
            if (
                sim_backend is not None
                and cfg.judge.backend == cfg.sim.backend == "vllm"
                and cfg.judge.engine == cfg.sim.engine
            ):
                # One engine serves both roles when they name the same model and settings.
                judge_backend = LocalBackend(
                    sim_backend.engine,
                    sim_backend.tokenizer,
                    model_name=sim_backend.model_name,
                    template_kwargs=sim_backend.template_kwargs,
                    owns_engine=False,
                )
            else:
                judge_backend = make_backend(cfg.judge)
                closers.append(judge_backend.close)
            judge = LocalJudge(in_process.judge(judge_backend))
        publish_record = None

    def start_engine(model: str):
        from parley.engines.backend import open_engine

        # the actor's engine settings with the condition's model or checkpoint (eval_engine)
        engine, tokenizer, _ = open_engine(eval_engine(cfg.actor.engine, model))
        return engine, tokenizer

    local: list = []  # what names this process's local engines, for their watch (watch_engines)
    if open_policy is None:  # checkpoints of one base share one engine: their weights are swapped in
        open_policy = SwappingPolicies(start_engine, version=policy_version)
        closers.append(open_policy.close)
        local.append(lambda p=open_policy: p.engine)
    if services == "local":
        local += [lambda b=b: getattr(b, "engine", None) for b in (sim_backend, judge_backend) if b is not None]

    svc = EvalServices(
        open_policy=open_policy,
        sim=sim,
        judge=judge,
        scorer_cfg=cfg.scorer,
        template_kwargs=dict(cfg.actor.engine.template_kwargs),
        env=env,
    )
    done: list = []  # finished conversations, kept when the run is interrupted
    missing: list[NotScored] = []  # per conversation: not played or not scored, and why

    async def on_record(rec):
        done.append(rec)
        if publish_record is not None:
            await publish_record(rec)

    if services == "fleet":
        work = asyncio.create_task(
            fleet(nc, js, cfg, conds, held, settings, out, policy_version, stop, on_record, missing.append, env)
        )
    else:
        if services == "nats" and sim is not None and judge is not None:  # the bounds slow services are waited for
            _err(
                f"parley eval: waits for the judge up to [scorer] judge_wait_s={cfg.scorer.judge_wait_s:.0f}s per "
                f"conversation ({settings.judge_attempts} verdicts at most), for the simulator {sim.attempts} x "
                f"[actor] sim_timeout_s={sim.timeout_s:.0f}s per message; what is still missing then is reported"
            )
        work = asyncio.create_task(play_conditions(conds, held, settings, svc, on_record, missing.append))
    # `halt`: the stop, or a local engine found dead or stalled (watch_engines)
    halt, failed = asyncio.Event(), []
    stopped = asyncio.create_task(watch_engines(lambda: [get() for get in local], stop, halt, failed))
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() or halt.is_set():  # Ctrl-C / SIGTERM: keep what is finished, skip the table
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            if done:
                path = write_parquet(done, Path(out) / "records.parquet")
                _err(f"parley eval: interrupted; {len(done)} finished conversations in {path}")
            return _engine_failed(failed, "parley eval", "run it again; the finished conversations are kept") or 130
        try:
            records = work.result()
        # Retry / Poison: the simulator service answered garbage or stayed unreachable (services.sim.client.SimClient)
        except (FleetError, Retry, Poison) as e:
            if done:
                write_parquet(done, Path(out) / "records.parquet")
            hint = "" if isinstance(e, FleetError) else "; is `parley sim` (or `parley services`) running on this NATS?"
            _err(f"parley eval: {e}{hint}")
            return 1
        except Exception as e:
            from parley.engines.backend import is_fatal

            if not is_fatal(e):
                raise
            # a local engine (the in-process judge's or simulator's) died under a conversation before
            # its watch saw it: the same end as the watch's
            if done:
                write_parquet(done, Path(out) / "records.parquet")
            failed.append(e)
            return _engine_failed(failed, "parley eval", "run it again; the finished conversations are kept")
    finally:
        halt.set()
        await asyncio.gather(stopped, return_exceptions=True)
        for close in closers:
            await close()
        if nc is not None:
            await nc.drain()
    return report(records, missing, len(conds) * len(held) * settings.seeds, baseline, out, env)


def report(records, missing, expected: int, baseline: str, out, env=None) -> int:
    """Write the records, the per-conversation report of what was not scored, and the table of what was.
    Exit 0 with a table (some conversations may be unscored, each named); 3 when nothing was scored:
    no table then, and no traceback, only the reasons."""
    from parley.evaluation.benchmark import flags, flags_markdown, summarize, to_markdown, write_table
    from parley.evaluation.evallog import write_parquet
    from parley.evaluation.runner import write_unscored

    out = Path(out)
    path = write_parquet(records, out / "records.parquet") if records else None
    unscored_path = write_unscored(missing, out)
    scored = [r for r in records if r.metrics]
    if missing:
        _err(f"parley eval: {expected - len(scored)} of {expected} conversations not scored ({unscored_path}):")
        for m in missing:
            _err(f"  {m.describe()}")
        if path is not None and len(scored) < len(records):
            _err(f"  the played ones can be scored later with `parley replay {path} --judge`")
    if not scored:
        _err(
            f"parley eval: no conversation was scored, so there is no table; the reasons are above and in {unscored_path}"
        )
        return 3
    try:
        table = summarize(scored, baseline, env=env)
    except ValueError as e:  # e.g. the baseline condition has no scored conversation
        _err(f"parley eval: no table: {e}")
        return 3
    paths = write_table(table, out)
    paths["flags"] = out / "flags.json"
    paths["flags"].write_text(json.dumps(flags(table), indent=2, allow_nan=True) + "\n")
    _out(to_markdown(table))
    if text := flags_markdown(table):
        _out(text)
    _out(f"wrote {path}, {unscored_path}, " + ", ".join(str(p) for p in paths.values()))
    return 0


async def fleet(nc, js, cfg, conds, held, settings, out, policy_version, stop, on_record, on_missing, env=None) -> list:
    """--services fleet: one condition after another, each through its own actor and scorer."""
    import logging

    import msgspec

    from parley.evaluation.fleet import FleetSettings, play_condition_fleet
    from parley.evaluation.runner import NotScored, make_tasks
    from parley.runtime.toml import to_toml

    log = logging.getLogger(__name__)

    fleet_dir = Path(out) / "fleet"
    fleet_dir.mkdir(parents=True, exist_ok=True)
    config_path = fleet_dir / "config.toml"
    # The actors sample as the in-process modes do: the eval's engine (eval_engine), temperature, top_p,
    # thinking and concurrency.
    engine = msgspec.structs.replace(
        eval_engine(cfg.actor.engine),
        template_kwargs={**cfg.actor.engine.template_kwargs, "enable_thinking": settings.enable_thinking},
    )
    actor = msgspec.structs.replace(
        cfg.actor, sampling=settings.sampling, concurrency=settings.concurrency, engine=engine
    )
    config_path.write_text(to_toml(msgspec.structs.replace(cfg, actor=actor)))
    sim_model = cfg.sim.engine.model if cfg.sim.backend == "vllm" else cfg.sim.model_name
    fs = FleetSettings(
        config_path=config_path,
        logs_dir=fleet_dir,
        sim_model=sim_model,
        policy_version=policy_version,
        env={"PARLEY_NATS_URL": cfg.nats.url},
    )  # the URL this eval resolved, over any inherited one
    tasks = make_tasks(held, settings, env)
    records = []
    for cond in conds:
        t0 = time.perf_counter()
        recs, lost = await play_condition_fleet(nc, js, cfg, cond, tasks, fs, stop, on_record)
        log.info(
            "condition %s: %d conversations in %.1fs through the fleet (%d unscored, %d lost)",
            cond.name,
            len(recs),
            time.perf_counter() - t0,
            sum(not r.metrics for r in recs),
            len(lost),
        )
        by_task = {t.task_id: t for t in tasks}
        for task_id in lost:
            task = by_task[task_id]
            on_missing(
                NotScored(
                    eval_id=f"{cond.name}/{task.item_id}/{task.seed}",
                    condition=cond.name,
                    item_id=task.item_id,
                    stage="conversation",
                    reason="the fleet's actor dead-lettered the task (see the fleet logs)",
                )
            )
        for rec in recs:
            if not rec.metrics:
                on_missing(
                    NotScored(
                        eval_id=rec.eval_id,
                        condition=cond.name,
                        item_id=rec.item_id,
                        stage="judge",
                        reason="the fleet's scorer dead-lettered the trajectory (see the fleet logs)",
                    )
                )
        records += recs
        if stop.is_set():
            break
    return records


# `parley eval --follow` answers each job on its standard output with this prefix and a JSON object.
DONE_MARK = "parley-eval-done "


class OpenInterrupted(BaseException):
    """A SIGTERM / SIGINT while FollowingPolicy.open_first blocks in vLLM's start. A BaseException, as
    KeyboardInterrupt is: no `except Exception` on the way swallows it, and vLLM's start, interrupted,
    shuts down the engine-core process it had started."""


def _raise_interrupted(signum, frame):
    raise OpenInterrupted(signum)


class FollowingPolicy:
    """One policy engine for a sequence of versions: opened before the first job (`open_first`, the run's
    policy model) or else by the first job's model, then each version's weights are loaded in place
    (engines.engine.PolicyEngine.reload_weights, the actors' shared_dir path), so an eval costs its
    conversations, not an engine start."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.engine = self.tokenizer = None
        self.model = ""  # what the engine holds now
        self.starts = self.loads = 0

    def _start(self, model: str) -> None:
        from parley.engines import backend

        engine_cfg = eval_engine(self.cfg.actor.engine, model)
        self.engine, self.tokenizer, _ = backend.open_engine(engine_cfg)  # blocks while vLLM loads
        self.model = model
        self.starts += 1

    def open_first(self, model: str) -> float:
        """Open the engine on `model` before any job (`follow`: the run's policy model, which version 0
        is, so its job loads nothing and a later version loads in place); the seconds it took. Blocks
        while vLLM loads: a SIGTERM or SIGINT meanwhile raises OpenInterrupted out of vLLM's start (it
        cleans up), so a learner that ends its child is not kept waiting for the load. An engine that
        does not open is reported once on standard error; the first job then opens it, as without this,
        and fails with the reason if it fails again."""
        import signal
        import threading

        t0 = time.perf_counter()
        before = {}
        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not None:  # None: set outside Python, it could not be put back
                    before[sig] = signal.signal(sig, _raise_interrupted)
        try:
            self._start(model)
        except Exception as e:  # vLLM's own errors are of every kind; the first job tries again
            _err(
                f"parley eval --follow: the policy engine on {model} did not open before the first version "
                f"({type(e).__name__}: {e}); each version opens it again and fails with the reason if it fails"
            )
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
        return time.perf_counter() - t0

    async def open(self, model: str, version: int):
        import asyncio

        from parley.engines.models import ensure_model
        from parley.evaluation.runner import Policy

        if self.engine is None:
            self._start(model)
        elif model != self.model:
            path = await asyncio.to_thread(ensure_model, model)
            await self.engine.reload_weights(path, version=version, abort_inflight=True)
            self.loads += 1
            self.model = model

        async def keep():  # the engine outlives the job
            return None

        return Policy(engine=self.engine, tokenizer=self.tokenizer, version=version, close=keep)

    async def close(self) -> None:
        import asyncio

        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
            self.engine = None


async def _stdin_line() -> str:
    """The next line of standard input ("" at its end), read by a daemon thread: a stopped `follow` returns
    while the read still waits, and the process exits without joining it (a to_thread read would hold the
    interpreter's exit until the learner wrote a line or closed the pipe)."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    got = loop.create_future()

    def read() -> None:
        line = sys.stdin.readline()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for it
            loop.call_soon_threadsafe(lambda: got.done() or got.set_result(line))

    threading.Thread(target=read, name="eval-follow-stdin", daemon=True).start()
    return await got


async def follow(stop, cfg, held, settings, env=None, read_line=None) -> int:
    """`parley eval --follow`: play one version per line of standard input, a JSON object
    {"version": N, "model": MODEL_OR_CHECKPOINT, "out": DIR}, through the NATS services with one
    long-lived policy engine (FollowingPolicy), and answer each on standard output with DONE_MARK and
    {"version": N, "code": EXIT_CODE} (the codes of `parley eval`). Ends at end of input (0) or on stop.
    The learner's periodic eval (evaluation.periodic) runs it as its child, started before the learner
    builds its model: the engine is opened on the run's policy model ([policy] model, version 0's
    job) before the first line is read, so the first result does not wait for an engine start. End of
    input while it opens ends the child once the engine is up (the line is read after it); a SIGTERM
    or SIGINT ends it at once (130), while the engine opens or while it waits for a job."""
    import asyncio
    import json

    from parley.evaluation.runner import Condition
    from parley.runtime.process import Stopped, unless_stopped

    env = env or cfg.env.load()
    policy = FollowingPolicy(cfg)
    read_line = read_line or _stdin_line
    # `halt`: the stop, or the engine found dead or stalled (watch_engines): a hung engine would hold
    # a version's conversations until the learner's drain gives up; the child exits 4 instead, and the
    # learner's next version starts a fresh one
    halt, failed = asyncio.Event(), []
    watch = asyncio.ensure_future(watch_engines(lambda: [policy.engine], stop, halt, failed))
    try:
        try:
            seconds = policy.open_first(cfg.policy.model)
        except OpenInterrupted:
            _err("parley eval --follow: stopped while its policy engine opened")
            return 130
        if policy.engine is not None:
            _err(
                f"parley eval --follow: policy engine on {cfg.policy.model} open in {seconds:.1f}s, before any version"
            )
        while not halt.is_set():
            try:
                line = await unless_stopped(read_line(), halt)
            except Stopped:  # a SIGTERM or SIGINT while it waited for a job (or the engine failed)
                return _engine_failed(failed) or 130
            if not line:
                return 0
            if not line.strip():
                continue
            try:
                job = json.loads(line)
                version, model, out = int(job["version"]), str(job["model"]), Path(job["out"])
            except (ValueError, KeyError, TypeError) as e:
                _err(
                    f"parley eval --follow: not a job ({type(e).__name__}: {e}): {line.strip()[:200]!r}; "
                    'expected {"version": N, "model": "...", "out": "..."}'
                )
                _out(DONE_MARK + json.dumps({"version": None, "code": 2}))
                continue
            name = f"v{version}"
            t0 = time.perf_counter()

            async def open_policy(m, version=version):
                return await policy.open(m, version)

            code = await run_eval(
                halt,
                cfg,
                [Condition(name=name, model=model)],
                held,
                settings,
                "nats",
                name,
                out,
                version,
                env,
                open_policy=open_policy,
            )
            code = _engine_failed(failed) or code
            _err(
                f"parley eval --follow: version {version} done in {time.perf_counter() - t0:.1f}s (exit {code}; "
                f"engine starts {policy.starts}, in-place loads {policy.loads})"
            )
            _out(DONE_MARK + json.dumps({"version": version, "code": code}))
            if code == 130 or failed:
                return code
        return _engine_failed(failed) or 130
    finally:
        halt.set()
        await asyncio.gather(watch, return_exceptions=True)
        await policy.close()


async def watch_engines(engines, stop, halt, failed: list) -> None:
    """Watch the local engines `engines()` names (engines.engine.PolicyEngine.watch; None for one not
    open yet, or remote), each as it opens, until `halt`: the first EngineFailed is kept in `failed` and
    sets `halt`; so does `stop`. What `parley eval` and `parley eval --follow` play on a local engine
    then ends with exit 4 instead of waiting on an engine that died or hangs."""
    import asyncio

    from parley.engines.engine import EngineFailed

    async def relay() -> None:
        await stop.wait()
        halt.set()

    async def one(k: int) -> None:
        while not halt.is_set():
            watch = getattr(engines()[k], "watch", None)
            try:
                if watch is not None:
                    await watch(halt)
            except EngineFailed as e:
                failed.append(e)
                halt.set()
                return
            # not open yet, or closed under the watch (another model's engine opens next): look again
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(halt.wait(), timeout=1.0)

    jobs = [asyncio.ensure_future(relay()), *(asyncio.ensure_future(one(k)) for k in range(len(engines())))]
    try:
        await halt.wait()
    finally:
        for j in jobs:
            j.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)


def _engine_failed(failed: list, command: str = "parley eval --follow", then: str = "") -> int | None:
    """The exit code of an engine watch_engines found dead or stalled, or that died under a conversation
    (EngineFailed's, 4), said on standard error; None while none failed."""
    from parley.engines.engine import EngineFailed

    if not failed:
        return None
    then = then or "the learner starts a fresh child for its next version"
    e = failed[0]
    _err(f"{command}: {e if isinstance(e, EngineFailed) else f'{type(e).__name__}: {e}'}; exiting ({then})")
    return EngineFailed.exit_code
