"""`parley up`: the whole system on one machine, as child processes, with a live view.

Starts nats-server, the sim + judge services (each only if the run's environment needs it: an LLM
simulated user, judge metrics; and the reference service when [policy] reference = "service"), N
actors, M scorers and the learner; waits for each to report ready; shows the live view; starts a
failed role again where [up] restarts allows (the learner with --resume), else stops everything
(showing its last log lines), as on Ctrl-C; after the learner's last step (and its periodic evals)
prints the reward summary, the eval table of the evaluated versions and the version `parley select`
names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from parley.config.run import RunConfig, dump_config
from parley.deploy.common import stamped
from parley.engines.engine import CPU_ENGINES_ENV
from parley.protocol import status
from parley.protocol.backlog import WARN_SHARE
from parley.protocol.status import READY_STATES
from parley.runtime.supervisor import RestartPolicy, Supervisor
from parley.services.combined import service_children

log = logging.getLogger(__name__)


def run_dir_for(cfg: RunConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    return Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


RUN_CONFIG = "config.toml"  # the resolved config `parley up` writes into the run directory


def resume_config_path(run_dir: Path) -> Path:
    """The config of the run `parley up` left in `run_dir`, to start it again where it stopped (the
    NATS store under run_dir/nats keeps the streams, the learner's ledger and checkpoint its state);
    a ValueError naming the directory when it holds none."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise ValueError(
            f"--resume {run_dir}: no {RUN_CONFIG} there, so it is no run directory of `parley up`; "
            "give the directory `parley up` printed as its run directory"
        )
    return path


def plan_children(
    cfg: RunConfig, sup: Supervisor, config_path: Path, resume: bool = False
) -> list[tuple[str, list[str]]]:
    """(name, argv) of every role child, in start order; `resume`: the learner continues from its ledger."""
    c = ["--config", str(config_path)]
    children = [(name, sup.parley_argv(name, *c, "--id", name)) for name in service_children(cfg)]
    for i in range(cfg.up.first_actors()):
        children.append((f"actor-{i}", sup.parley_argv("actor", *c, "--id", f"actor-{i}")))
    for i in range(cfg.up.scorers):
        children.append((f"scorer-{i}", sup.parley_argv("scorer", *c, "--id", f"scorer-{i}")))
    children.append(("learner", sup.parley_argv("learner", *c, *(["--resume"] if resume else []))))
    return children


def cpu_engines(cfg: RunConfig, children: list[tuple[str, list[str]]]) -> int:
    """How many vLLM engines this `parley up` runs at once: one per actor, the services' (one shared
    by sim and judge, or one each), and the learner's periodic eval child while it runs. On CPU they
    split the cores between them (engines.engine.share_cpu_cores)."""
    names = [name.split("-")[0] for name, _ in children]
    n = cfg.up.most_actors() + names.count("services")  # --actors auto: as many as may run at once
    n += names.count("sim") * (cfg.sim.backend == "vllm") + names.count("judge") * (cfg.judge.backend == "vllm")
    return n + (1 if cfg.learner.eval_every > 0 else 0)


def prepare_models(cfg: RunConfig) -> None:
    """Build the embedded models once, before children race for them (the simulator's and the
    judge's only if the environment starts those services)."""
    from parley.engines.models import ensure_model

    env = cfg.env.load()
    names = {cfg.actor.engine.model, cfg.policy.model}
    names |= {cfg.sim.engine.model} if env.needs_simulator else set()
    names |= {cfg.judge.engine.model} if env.needs_judge else set()
    for name in sorted(names):
        t0 = time.time()
        path = ensure_model(name)
        print(stamped(f"model {name}: {path} ({time.time() - t0:.0f}s)"), flush=True)


async def up_main(stop: asyncio.Event, cfg: RunConfig, live: bool, resume: bool = False, share_key: str = "") -> int:
    """`share_key`: the workload's fingerprint (deploy/gpu_share.fingerprint): a run on a GPU that ends
    well keeps its trained tokens/s under it, with the sharing it had, for gpu_share = "auto"."""
    from parley.deploy.common import topology_bus
    from parley.deploy.credentials import generate_credentials, server_auth_conf
    from parley.deploy.live import RunWatcher, render, watch
    from parley.deploy.natsserver import NatsServer
    from parley.deploy.permissions import response_window_s
    from parley.protocol import topology
    from parley.runtime.role import connect_nats

    run_dir = run_dir_for(cfg).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run.dir = str(run_dir)
    print(stamped(f"run directory: {run_dir}"), flush=True)

    window = response_window_s(cfg)  # services may answer for as long as this config's requesters wait
    creds = generate_credentials(cfg.run.name, run_dir / "auth", response_window=window)
    server = NatsServer(run_dir / "nats", port=0, extra_conf=server_auth_conf(creds, response_window=window))
    cfg.nats.url = server.start()
    print(stamped(f"nats-server: {cfg.nats.url} (store {server.store_dir})"), flush=True)
    if cfg.nats.creds or cfg.nats.ca_file:
        # They are for another server: this one has a user and password per role (auth/) and no TLS.
        print(
            f"parley up: [nats] creds / ca_file ({cfg.nats.creds or '-'} / {cfg.nats.ca_file or '-'}) are not used "
            "with up's own nats-server",
            flush=True,
        )
        cfg.nats.creds = cfg.nats.ca_file = ""

    config_path = run_dir / RUN_CONFIG
    config_path.write_text(dump_config(cfg))
    (run_dir / "env").write_text(
        f"export PARLEY_NATS_URL={cfg.nats.url}\nexport PARLEY_RUN={cfg.run.name}\n"
        f"# a role started by hand also needs its credentials: source {run_dir / 'auth'}/<role>.env\n"
    )
    sup = Supervisor(run_dir, restart_policy(cfg))
    from parley.deploy.gpu_samples import GpuSampler
    from parley.deploy.memory import uses_gpu
    from parley.deploy.mps import MpsError, start_for

    mps = None  # the run's MPS daemon, started in the try below (gpu_share "mps", or "auto" where it can serve)

    sampler = GpuSampler.start_if_gpu(
        uses_gpu(cfg), run_dir, lambda: {c.proc.pid: c.name for c in sup.children if c.proc is not None}
    )
    admin = creds["admin"]
    nc = await connect_nats(cfg.nats, name="parley-up", user=admin[0], password=admin[1])
    js = nc.jetstream()
    code = 1
    try:
        # before any role: under "mps" an image where MPS cannot serve is refused here, under "auto" the
        # GPU time-slices instead
        try:
            mps, line = await asyncio.to_thread(
                start_for, cfg.up.gpu_share, run_dir, uses_gpu(cfg), None, cfg.actor.sleep_level_served(cfg.weights)
            )
        except MpsError as e:
            print(f"parley up: {e}", file=sys.stderr, flush=True)
            return 2
        if line:
            print(stamped(line), flush=True)
        await topology.ensure_topology(
            js, cfg.run.name, topology_bus(cfg)
        )  # first: it may refuse (no room), models take minutes
        await asyncio.to_thread(prepare_models, cfg)
        children = plan_children(cfg, sup, config_path, resume=resume)
        engines = cpu_engines(cfg, children)
        targets: dict[str, str] = {}  # child -> host:port of its metrics

        def start(name: str, argv: list[str]) -> None:
            env = child_env(name, creds, engines, mps.env() if mps is not None else None)
            where = ""
            if cfg.up.metrics:
                targets[name] = f"127.0.0.1:{free_port()}"
                argv = [*argv, "--metrics-port", targets[name].split(":")[1], "--metrics-host", "127.0.0.1"]
                where = f", metrics http://{targets[name]}/metrics"
                write_scrape_targets(run_dir, cfg.run.name, targets)
            again = learner_restart(run_dir, argv) if name == "learner" else {}
            sup.start(name, argv, env=env, config_text=dump_config(cfg), **again)
            print(
                stamped(f"started {name}: pid {sup.get(name).proc.pid}, log {sup.get(name).log_path}{where}"),
                flush=True,
            )

        for name, argv in children:
            start(name, argv)
        pool = None
        if cfg.up.autoscale:
            from parley.deploy.autoscale import ActorPool, ScalePolicy

            async def retire(name: str) -> None:
                rc = await asyncio.to_thread(sup.retire, name)
                if targets.pop(name, None):
                    write_scrape_targets(run_dir, cfg.run.name, targets)
                print(f"stopped {name} (exit code {rc})", flush=True)

            actor_argv = lambda name: sup.parley_argv("actor", "--config", str(config_path), "--id", name)  # noqa: E731
            pool = ActorPool(
                ScalePolicy.of(cfg),
                lambda name: start(name, actor_argv(name)),
                retire,
                [n for n, _ in children if n.startswith("actor-")],
            )
            p = pool.policy
            print(stamped(f"actors: auto, {p.low}..{p.high}, one per {p.per_actor} waiting tasks"), flush=True)
        if targets:
            print(stamped(f"scrape targets (Prometheus file_sd_configs): {run_dir / SCRAPE_TARGETS}"), flush=True)

        watcher = RunWatcher(nc, cfg.run.name)
        await watcher.start()
        if not await _wait_ready(sup, watcher, stop, timeout=1800.0):
            return (
                _report_failure(failed) if (failed := sup.check(say, ready_since(watcher.snap.roles.values()))) else 130
            )

        view_stop = asyncio.Event()
        viewer = asyncio.create_task(watch(nc, cfg.run.name, view_stop)) if live else None
        code = await _until_done(sup, stop, watcher, quiet=live, pool=pool)
        view_stop.set()
        if viewer:
            await viewer
        else:
            from rich.console import Console

            Console(width=110).print(render(await watcher.poll(), cfg.run.name, "(at the last step)"))
        await watcher.stop()
        if sampler is not None:
            sampler.stop()  # before the closing report draws its samples
        if code == 0:
            code = _closing(cfg, run_dir)
        from parley.deploy.gpu_share import measured_end, record_run

        if share_key and uses_gpu(cfg) and measured_end(code):
            used = "phased" if cfg.up.gpu_share == "phased" else "mps" if mps is not None else "plain"
            if line := await asyncio.to_thread(record_run, share_key, used, run_dir):
                print(line, flush=True)
        return code
    finally:
        if sampler is not None:
            sampler.stop()
        sup.stop_all()
        if mps is not None:
            mps.stop()  # after the children: the daemon's server goes once its last client has
        with contextlib.suppress(Exception):
            await nc.drain()
        server.stop()
        print(f"stopped; logs in {run_dir / 'logs'}", flush=True)


SCRAPE_TARGETS = "prometheus-targets.json"


def restart_policy(cfg: RunConfig) -> RestartPolicy:
    """Which failed children `parley up` starts again ([up] restarts): actors, scorers and services,
    except the roles holding a share of a call budget (config.restarts.restart_policy says which), and
    the learner, with --resume, while it has a state to resume from (`learner_restart`)."""
    from parley.config.restarts import restart_policy as policy_of

    return policy_of(cfg, RestartPolicy.roles | {"learner"})


def learner_restart(run_dir: Path, argv: list[str]) -> dict:
    """How `parley up` starts a failed learner again (Supervisor.start's `restart_argv`, `restart_check`):
    its command with --resume, so that it continues from its ledger and checkpoint, and only once the
    run directory holds that ledger. Before its first write (it writes once it has received samples or
    stepped) a start again would begin afresh and issue the same task ids again; the run stops instead.
    The learner's eval child and its engine's processes share its process group, which the supervisor
    kills before the start again; the learner started again starts its own eval child."""

    def resumable() -> str | None:
        from parley.learner.checkpoint import has_state, learner_dir

        if has_state(run_dir):
            return None
        return f"no learner state in {learner_dir(run_dir)} yet to resume from (it is written once samples arrive)"

    return {"restart_argv": argv if "--resume" in argv else [*argv, "--resume"], "restart_check": resumable}


def child_env(
    name: str, creds: dict[str, tuple[str, str]], engines: int, mps_env: dict[str, str] | None = None
) -> dict[str, str]:
    """What `parley up` adds to child `name`'s environment: its role's NATS user, the count of CPU
    engines on this host, the run's MPS daemon (`[up] gpu_share`, deploy/mps.py: every child's CUDA calls go
    through it, and so do its own children's: the learner's eval engine, vLLM's engine cores), and for
    the learner the eval role's user (its periodic eval child plays the eval role)."""
    role = name.split("-")[0]
    user, password = creds["services" if role == "services" else role]
    env = {"PARLEY_NATS_USER": user, "PARLEY_NATS_PASSWORD": password, CPU_ENGINES_ENV: str(engines)}
    env |= mps_env or {}
    if role == "learner":
        from parley.evaluation.periodic import EVAL_PASSWORD_ENV, EVAL_USER_ENV

        env |= {EVAL_USER_ENV: creds["eval"][0], EVAL_PASSWORD_ENV: creds["eval"][1]}
    return env


def free_port() -> int:
    """A port free on 127.0.0.1 now (the child binds it a moment later)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_scrape_targets(run_dir: Path, run: str, targets: dict[str, str]) -> None:
    """RUN_DIR/prometheus-targets.json: one file_sd_configs entry per child, rewritten as children come and go."""
    entries = [
        {"targets": [where], "labels": {"job": "parley", "parley_run": run, "child": name}}
        for name, where in sorted(targets.items())
    ]
    tmp = run_dir / (SCRAPE_TARGETS + ".tmp")
    tmp.write_text(json.dumps(entries, indent=1) + "\n")
    tmp.replace(run_dir / SCRAPE_TARGETS)


def ready_children(heartbeats) -> set[str]:
    """Names of children (as up names them) whose heartbeat says ready or busy."""
    return set(ready_since(heartbeats))


def ready_since(heartbeats) -> dict[str, float]:
    """Child name (as up names them) -> when its latest heartbeat that says ready or busy was sent
    (protocol.status.ready_since, with the learner under its role and the combined services child)."""
    heartbeats = list(heartbeats)
    up = status.ready_since(heartbeats)
    # the learner's id is host-pid: one started again beats under another id than the one before
    learner = [hb.created for hb in heartbeats if hb.role == "learner" and hb.state in READY_STATES]
    if learner:
        up["learner"] = max(learner)
    if {"services-sim", "services-judge"} <= up.keys():
        up["services"] = min(up["services-sim"], up["services-judge"])
    return up


async def _wait_ready(sup: Supervisor, watcher, stop: asyncio.Event, timeout: float, poll_s: float = 1.0) -> bool:
    """Until every child's heartbeat says ready (True), one fails, `stop` is set or `timeout` passes
    (False). Prints who it waits for, and each child's start-up as it comes ready: the seconds from
    this wait's start (the children were just started) to the first heartbeat that said so, to within
    `poll_s` (on one GPU the engines' start is most of a run's start-up: docs/gpu.md)."""
    expected = {c.name for c in sup.children}
    t0 = time.monotonic()
    deadline = t0 + timeout
    last = ""
    came: set[str] = set()
    while time.monotonic() < deadline and not stop.is_set():
        if sup.check(say, ready_since(watcher.snap.roles.values())):
            return False
        ready = ready_children(watcher.snap.roles.values()) & expected
        new = sorted(ready - came)
        if new:
            print(stamped(f"ready after {time.monotonic() - t0:.1f} s: {', '.join(new)}"), flush=True)
        came |= ready
        missing = sorted(expected - ready)
        if not missing:
            print(f"all roles ready in {time.monotonic() - t0:.1f} s", flush=True)
            return True
        msg = f"waiting for: {', '.join(missing)}"
        if msg != last:
            print(msg, flush=True)
            last = msg
        await asyncio.sleep(poll_s)
    return False


async def _until_done(sup: Supervisor, stop: asyncio.Event, watcher, quiet: bool, pool=None) -> int:
    learner = sup.get("learner")
    last_line, last_t = "", 0.0
    while not stop.is_set():
        failed = sup.check(say, ready_since(watcher.snap.roles.values()))
        if failed:
            return _report_failure(failed)
        if learner.returncode == 0:
            return 0
        snap = await watcher.poll()
        if pool is not None and (did := await scale_step(pool, snap)):
            print(time.strftime("%H:%M:%S ") + did, flush=True)
        if not quiet:  # without the live view, a progress line when something moves (or every 30 s)
            line = progress_line(snap)
            if line != last_line or time.monotonic() - last_t > 30:
                print(time.strftime("%H:%M:%S ") + line, flush=True)
                last_line, last_t = line, time.monotonic()
        await asyncio.sleep(1.0)
    print("interrupted: stopping every role", flush=True)
    return 130


async def scale_step(pool, snap) -> str:
    """--actors auto: one decision of the actor pool (deploy/autoscale.py) on the live view's snapshot:
    the TASKS consumer's waiting messages (KEDA's signal) and the children that report ready."""
    waiting = snap.streams["tasks"].pending if "tasks" in snap.streams else 0
    return await pool.step(waiting, ready_children(snap.roles.values()), time.monotonic())


_EVAL_BOOKKEEPING = ("eval.queued", "eval.running", "eval.version", "eval.failed")


def progress_line(snap) -> str:
    from parley.deploy.live import learner_beat

    learner = learner_beat(snap)  # the learner started again's, not the last of the one before
    s = snap.streams
    parts = [
        f"step {int(learner.counters.get('step', 0)) if learner else '-'}",
        f"version {learner.version if learner else '-'}",
        f"tasks {s['tasks'].messages if 'tasks' in s else 0}",
        f"trajectories {s['traj'].messages if 'traj' in s else 0}",
        f"scored {s['scored'].messages if 'scored' in s else 0}",
        f"dead {s['dead'].messages if 'dead' in s else 0}",
    ]
    c = learner.counters if learner else {}
    if "eval.queued" in c:
        running = int(c.get("eval.running", -1))
        parts.append(f"eval {f'v{running} running' if running >= 0 else 'idle'}, {int(c['eval.queued'])} queued")
        if "eval.version" in c:  # the eval's columns: the environment's (Environment.eval)
            shown = [k for k in c if k.startswith("eval.") and k not in _EVAL_BOOKKEEPING]
            parts.append(
                f"last eval v{int(c['eval.version'])}: "
                + ", ".join(f"{k[5:]} {c[k]:.3f}" for k in (["eval.mr"] if "eval.mr" in c else shown[:2]))
            )
    # requests the actors' engines preempted (KV cache short of the conversations in flight: each
    # recomputes its prefix), so a run whose KV is sized under its demand says so while it runs
    preempted = sum(hb.counters.get("engine.preemptions", 0.0) for hb in snap.roles.values() if hb.role == "actor")
    if preempted:
        parts.append(f"preempted {int(preempted)}")
    # the share of the actors' prompt tokens vLLM took from its prefix cache (no prefill), and of it the
    # share older weights computed ([actor.engine] prefix_cache_across_versions)
    actors = [hb.counters for hb in snap.roles.values() if hb.role == "actor"]
    prompt = sum(c.get("engine.prompt_tokens", 0.0) for c in actors)
    if prompt:
        cached = sum(c.get("engine.cached_tokens", 0.0) for c in actors)
        stale = sum(c.get("engine.stale_cached_tokens", 0.0) for c in actors)
        parts.append(f"prefix cache {cached / prompt:.0%}" + (f" ({stale / cached:.0%} stale)" if stale else ""))
    # [up] gpu_share = "phased": how often the actor's engine slept while the learner stepped, and how long
    sleepers = [hb.counters for hb in snap.roles.values() if hb.role == "actor" and "phase.sleeps" in hb.counters]
    if sleepers:
        sleeps, asleep = sum(c["phase.sleeps"] for c in sleepers), sum(c.get("phase.asleep_s", 0.0) for c in sleepers)
        parts.append(f"engine slept {int(sleeps)}x, {asleep:.0f} s")
    # A stream about to drop work its consumer has not had (protocol.backlog).
    parts += [f"BACKLOG {key} {row.backlog:.0%} of max_bytes" for key, row in s.items() if row.backlog >= WARN_SHARE]
    return " | ".join(parts)


def say(line: str) -> None:
    """A line of the supervisor's (a child failed, started again) on up's output, its first line stamped."""
    first, _, rest = line.partition("\n")
    print(stamped(first) + (f"\n{rest}" if rest else ""), flush=True)


def _report_failure(child) -> int:
    why = f" (not started again: {child.why_not})" if child.why_not else ""
    print(f"\n{child.name} exited with code {child.returncode}{why}; its last log lines:\n", flush=True)
    print(child.tail(30), flush=True)
    return 1


def _closing(cfg: RunConfig, run_dir: Path) -> int:
    """Summary of reward terms per step, the periodic eval's table and selection, the report PNGs."""
    print(summary_text(run_dir), flush=True)
    print(eval_text(cfg, run_dir), flush=True)
    from parley.deploy.report import write_report

    pngs = write_report(run_dir, run_dir / "report")
    for png in pngs:
        print(f"chart: {png}", flush=True)
    if cfg.log.wandb:
        track_report(cfg, run_dir, pngs)
    ckpts = sorted(p for p in (run_dir / "learner" / "ckpt").glob("step*") if p.is_dir())
    print(f"checkpoint: {ckpts[-1] if ckpts else '(none)'}", flush=True)
    return 0


def track_report(cfg: RunConfig, run_dir: Path, pngs: list[Path]) -> None:
    """`[log] wandb`: the report's charts and the eval table (eval/table.csv, written by eval_text) as
    the "report" run of the run's W&B group, beside the learner's run."""
    import csv

    from parley.evaluation.periodic import eval_root
    from parley.runtime.tracking import open_tracker, wandb_mode

    tracker = open_tracker(cfg.log, run_dir=run_dir, run_name=cfg.run.name, job_type="report")
    tracker.images({f"report/{p.stem}": p for p in pngs})
    table = eval_root(run_dir) / "table.csv"
    if table.is_file():
        with table.open(newline="") as f:
            header, *rows = list(csv.reader(f))
        tracker.table("eval/table", header, rows)
        if (chart := table.with_name("chart.png")).is_file():
            tracker.images({"eval/chart": chart})
    tracker.finish()
    where = run_dir / "wandb"
    print(
        f"W&B ({wandb_mode()}): the learner's and the report's runs under {where}"
        + (f"; upload with `wandb sync {where}/offline-run-*`" if wandb_mode() == "offline" else ""),
        flush=True,
    )


def eval_text(cfg: RunConfig, run_dir: Path) -> str:
    """The evaluated versions side by side (paired against the first), which one `parley select` names
    by [learner] eval_metric, and why training stopped early if it did; written to RUN_DIR/eval/table.*."""
    from parley.evaluation.benchmark import summarize, to_markdown, write_table
    from parley.evaluation.evallog import read_records
    from parley.evaluation.periodic import eval_root
    from parley.evaluation.selection import SelectionError, select_best

    lc = cfg.learner
    if lc.eval_every <= 0:
        return (
            "\nperiodic eval is off ([learner] eval_every = 0): no version was evaluated on held-out items; "
            f"run `parley eval` on exported versions (`parley export {run_dir} OUT --version V`)"
        )
    root = eval_root(run_dir)
    versions = sorted(int(p.parent.name[1:]) for p in root.glob("v*/records.parquet") if p.parent.name[1:].isdigit())
    records = [r for v in versions for r in read_records(root / f"v{v}" / "records.parquet") if r.metrics]
    failed = sorted(p.name for p in root.glob("v*.failed"))
    lines = [f"\nheld-out eval every {lc.eval_every} versions on {lc.eval_items or 'all'} items ({root})"]
    if failed:
        lines.append(f"failed evals (see their eval.log): {', '.join(failed)}")
    if not records:
        lines.append("no version has a scored eval")
        return "\n".join(lines)
    table = summarize(records, baseline=records[0].condition, env=cfg.env.load())
    write_table(table, root)
    lines.append(to_markdown(table))
    try:
        best = select_best(run_dir, lc.eval_metric)
        lines.append(best.describe())
        kept = root / "models" / f"v{best.version}"
        if kept.is_dir():
            lines.append(f"model of v{best.version}: {kept}")
    except SelectionError as e:
        lines.append(f"no selection: {e}")
    stop_file = root / "early_stop.json"
    if stop_file.exists():
        lines.append("stopped early: " + json.loads(stop_file.read_text())["reason"])
    return "\n".join(lines)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary_text(run_dir: Path) -> str:
    rows = read_metrics(run_dir)
    if not rows:
        return f"no metrics written ({run_dir / 'metrics.jsonl'} missing)"
    terms = sorted({t for r in rows for t in (r.get("reward_terms") or {})})
    head = ["step", "version", *[f"{t} (mean/std)" for t in terms], "reward", "kl", "loss", "no signal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rt = r.get("reward_terms") or {}
        cells = [str(r.get("step")), str(r.get("version"))]
        for t in terms:
            stats = rt.get(t) or {}
            cells.append(f"{_cell(stats.get('mean'))} / {_cell(stats.get('within_group_std'))}")
        cells += [
            _cell(r.get("reward_mean")),
            _cell(r.get("kl_mean")),
            _cell(r.get("loss")),
            ", ".join(r.get("no_signal_terms") or []) or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\nreward terms per step (weighted; mean / mean within-group std)\n" + "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)
