"""Bus capacity: trajectories/s through actor -> scorer -> learner with engines that cost nothing,
against raw JetStream publish + fetch + ack of the same bytes, measured in the same run.

parley's path is the real role code: actors.actor.Actor (PullWorker on TASKS, the rollout loop with
ChatTokens on the tiny model's tokenizer, publish to TRAJ) with a `ZeroCostPolicy` engine and a
`ZeroCostSim` client; scorer.scorer.Scorer with a `ZeroCostJudge`; and the learner's intake (PullWorker
on SCORED, check_trajectory, learner.groups.Grouper, ack), without training. All three doubles are
named as such and live only here. One real nats-server (deploy/natsserver.py), one process, one
connection per role. Run by hand (issues 9, 17); tests/integration/test_bench_smoke.py runs it tiny.

`--old DIR` also runs the parley path of another checkout (e.g. the commit before a change, from
`git archive`) in each repeat, against the same server, in a child process that imports only DIR's
code: before and after in the same run. The ratio old/new is taken within each repeat.

    .venv/bin/python bench/bus_capacity.py            # 16 KB, 256 KB and 2 MB trajectories, 2 repeats, ~2 minutes
    .venv/bin/python bench/bus_capacity.py --quick    # a quarter of the trajectories
    .venv/bin/python bench/bus_capacity.py --old /tmp/parley-old   # and the previous code beside it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parley.engines.engine import GenOut  # noqa: E402  (light: vLLM is imported only by PolicyEngine)
from parley.protocol.messages import JudgeReply, SimReply, Task  # noqa: E402
from parley.rewards.metrics import INTERACTIVITY_KEYS  # noqa: E402

KB = 1024


# -- test doubles where the engines are --------------------------------------------------------


class ZeroCostPolicy:
    """Test double for engines.engine.PolicyEngine: every turn is `tokens` fixed ids (the last one
    the stop token) with fixed log-probs, returned at once. Enough of the engine for Actor and
    WeightFollower: settings.model, version, generate, reload_weights."""

    def __init__(self, model_dir: Path, tokens: int, vocab_lo: int = 300, vocab_hi: int = 3000):
        self.settings = SimpleNamespace(model=str(model_dir))
        self.version = 0
        self.tokens = tokens
        # ids above 255 so msgpack spends the bytes a real vocabulary would (3 per id)
        self._ids = [vocab_lo + (i * 7919) % (vocab_hi - vocab_lo) for i in range(tokens)]
        self._lps = [-0.25 - (i % 13) * 0.1 for i in range(tokens)]

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop_token_ids=None):
        k = max(1, min(self.tokens, max_tokens))
        ids = self._ids[: k - 1] + [stop_token_ids[0]] if stop_token_ids else self._ids[:k]
        return GenOut(ids, self._lps[:k], "stop", "")

    async def reload_weights(self, weights_dir, version=None, abort_inflight=False):
        if version is not None:
            self.version = version


class ZeroCostSim:
    """Test double for services.sim.client.SimClient: the user's opening message, at once."""

    waits = 0  # requests that found the simulator unreachable: never here

    async def ask(self, req) -> SimReply:
        return SimReply(message="Write me a short note about the meeting, keep it friendly.", model="zero-cost-sim")


class ZeroCostJudge:
    """Test double for the judge (services.judge.client.Judge): a fixed document and rubric levels that
    vary with the seed (so groups have reward spread), at once."""

    async def ask(self, op, messages, *, seed=0):  # services.judge.client.Judge: one entry, by op
        return await getattr(self, op)(messages, seed=seed)

    async def extract(self, messages, *, seed: int = 0) -> JudgeReply:
        return JudgeReply(
            ok=True, document="Dear team, the meeting moves to Friday at ten.", raw="{}", model="zero-cost-judge"
        )

    async def interactivity(self, messages, *, seed: int = 0) -> JudgeReply:
        levels = {k: (seed >> (2 * i)) % 4 for i, k in enumerate(INTERACTIVITY_KEYS)}
        return JudgeReply(ok=True, levels=levels, raw="{}", model="zero-cost-judge")


# -- setup helpers -------------------------------------------------------------------------------


async def _until_done(
    done: asyncio.Event, jobs: list, stop: asyncio.Event, conns: list, clock: CpuClock, t0: float
) -> tuple[float, dict]:
    """Wait until `done` (or a job fails), take wall and CPU time, then stop the jobs and close the
    connections; a job's failure is raised. Returns (wall seconds, CPU figures)."""
    waiter = asyncio.create_task(done.wait())
    finished, _ = await asyncio.wait([waiter, *jobs], return_when=asyncio.FIRST_COMPLETED)
    wall = time.perf_counter() - t0
    cpu = clock.stop()
    stop.set()
    await asyncio.gather(*jobs, return_exceptions=True)
    for j in jobs:
        if j in finished and j.exception() is not None:
            raise j.exception()
    for nc in conns:
        await nc.close()
    return wall, cpu


class CpuClock:
    """CPU seconds used by this process (all roles or the raw client) and by nats-server between
    start() and stop(): on a shared machine these move much less than wall time."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid

    def _server(self) -> float:
        fields = Path(f"/proc/{self.server_pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def _self(self) -> float:
        t = os.times()
        return t.user + t.system

    def start(self) -> None:
        self._t0 = (self._self(), self._server())

    def stop(self) -> dict:
        return {"client_cpu_s": self._self() - self._t0[0], "server_cpu_s": self._server() - self._t0[1]}


def make_task(run: str, i: int, n: int, tokens: int) -> Task:
    return Task(
        task_id=f"{run}-t{i:06d}",
        run=run,
        item_id=f"bench/{i}",
        n=n,
        max_new_turns=2,
        max_tokens=tokens,
        reference="Dear team, the weekly meeting moves to Friday at ten. Please bring the figures.",
        title="meeting note",
        summary="a short note",
        seed=i,
        created=time.time(),
    )


async def connect(url: str, name: str):
    from parley.protocol.connect import connect as _connect

    return await _connect(url, name=name, first_timeout=10.0)


def bus_settings(max_bytes: int):
    from parley.protocol.topology import BusSettings

    # ack_wait well above the run: nothing is redelivered because the machine is slow
    return BusSettings(max_bytes=max_bytes, ack_wait_s=300.0, max_ack_pending=4096)


def run_config(run: str, model_dir: Path, bus, actor_slots: int, scorer_slots: int):
    from parley.config.actor import ActorConfig
    from parley.config.run import RunConfig, RunSection
    from parley.config.scorer import ScorerConfig
    from parley.engines.config import EngineConfig

    return RunConfig(
        run=RunSection(name=run),
        bus=bus,
        actor=ActorConfig(
            engine=EngineConfig(model=str(model_dir), max_model_len=1 << 22),
            concurrency=actor_slots,
            weights_poll_s=5.0,
        ),
        scorer=ScorerConfig(concurrency=scorer_slots),
    )


async def calibrate(tokenizer, model_dir: Path, target_bytes: int) -> tuple[int, int, int, int]:
    """Tokens per assistant turn so the encoded Trajectory is ~target_bytes; returns
    (tokens, trajectory bytes, scored bytes, task bytes), encoded exactly as the roles do."""
    from parley.config.scorer import ScorerConfig
    from parley.protocol import codec
    from parley.rollout.conversation import PolicySettings, run_conversation
    from parley.rollout.score import score_trajectory

    policy = PolicySettings(max_model_len=1 << 22)

    async def sizes(tokens: int):
        task = make_task("calib", 0, 1, tokens)
        traj = await run_conversation(
            ZeroCostPolicy(model_dir, tokens), ZeroCostSim(), task, 0, lambda: 0, tokenizer=tokenizer, policy=policy
        )
        scored = await score_trajectory(traj, ZeroCostJudge(), ScorerConfig())
        return len(codec.encode(traj)), len(codec.encode(scored)), len(codec.encode(task))

    base = (await sizes(16))[0]
    probe = 1024
    per_token = ((await sizes(probe))[0] - base) / (probe - 16)
    tokens = max(16, int(16 + (target_bytes - base) / per_token))
    return (tokens, *await sizes(tokens))


# -- parley's path ---------------------------------------------------------------------------------


async def parley_pipeline(
    url: str,
    run: str,
    model_dir: Path,
    tokenizer,
    *,
    tasks: int,
    n: int,
    tokens: int,
    bus,
    actor_slots: int,
    scorer_slots: int,
    learner_slots: int,
    weights_dir: Path,
    clock: CpuClock,
) -> dict:
    from parley.actors.actor import Actor
    from parley.learner.groups import BadTrajectory, Grouper, check_trajectory
    from parley.protocol import bus as pbus
    from parley.protocol import topology
    from parley.scorer.scorer import Scorer

    conns = [await connect(url, f"bench-{r}") for r in ("feeder", "actor", "scorer", "learner")]
    feed_nc, actor_nc, scorer_nc, learner_nc = conns
    await topology.ensure_topology(feed_nc.jetstream(), run, bus)
    cfg = run_config(run, model_dir, bus, actor_slots, scorer_slots)
    stop = asyncio.Event()
    total = tasks * n
    done = asyncio.Event()
    grouper = Grouper(n, max_staleness=1 << 30, stale_policy="drop", timeout_s=3600.0)
    seen = {"scored": 0}

    async def on_scored(scored, msg) -> None:
        # the learner service's intake, minus the ledger: check, group, ack
        try:
            check_trajectory(scored.trajectory)
            result = grouper.add(scored)
        except BadTrajectory as e:
            raise pbus.Poison(str(e)) from None
        await msg.ack()
        if result in ("added", "complete"):
            seen["scored"] += 1
        while grouper.ready():
            grouper.take(1, 0)
        if seen["scored"] >= total:
            done.set()

    actor = Actor(
        actor_nc,
        actor_nc.jetstream(),
        cfg,
        ZeroCostPolicy(model_dir, tokens),
        tokenizer,
        ident="bench-actor",
        weights_dir=weights_dir,
    )
    actor.sim = ZeroCostSim()
    scorer = Scorer(scorer_nc, run, ZeroCostJudge(), cfg.scorer, bus, "bench-scorer")
    learner = pbus.PullWorker(
        learner_nc.jetstream(),
        run,
        "scored",
        on_scored,
        bus=bus,
        name="bench-learner",
        concurrency=learner_slots,
        fetch_timeout=1.0,
    )
    jobs = [
        asyncio.create_task(actor.run_until(stop)),
        asyncio.create_task(scorer.run_until(stop, fetch_timeout=1.0)),
        asyncio.create_task(learner.run_until(stop)),
    ]
    await asyncio.sleep(0.5)  # consumers bound and waiting
    fjs = feed_nc.jetstream()
    clock.start()
    t0 = time.perf_counter()
    # tasks go out pipelined, 64 publishes in flight: the feeder is not what is measured
    for lo in range(0, tasks, 64):
        await asyncio.gather(
            *(pbus.publish(fjs, run, "tasks", make_task(run, i, n, tokens)) for i in range(lo, min(tasks, lo + 64)))
        )
    wall, cpu = await _until_done(done, jobs, stop, conns, clock, t0)
    return {
        "wall_s": wall,
        "trajectories": seen["scored"],
        "traj_per_s": seen["scored"] / wall,
        **cpu,
        "dead": dict(pbus.COUNTERS),
        "retried": actor.counters.get("retried", 0) + learner.stats["retried"],
    }


# -- the previous code's parley path ----------------------------------------------------------------

# Run with `python -c` in DIR by a clean interpreter, so every module comes from DIR: the bench file
# of that checkout provides calibrate / parley_pipeline / CpuClock / bus_settings as they were.
_OLD_CHILD = """
import asyncio, json, sys
from pathlib import Path
sys.path.insert(0, ".")
import bench.bus_capacity as b
from bench.common import run
from parley.engines.models import ensure_model
from transformers import AutoTokenizer

async def main(a):
    model_dir = ensure_model("tiny")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tokens, traj_b, scored_b, task_b = await b.calibrate(tok, model_dir, a["target_bytes"])
    out = await b.parley_pipeline(
        a["url"], a["run"], model_dir, tok, tasks=a["tasks"], n=a["n"], tokens=tokens, bus=b.bus_settings(a["max_bytes"]),
        actor_slots=a["slots"], scorer_slots=a["slots"], learner_slots=a["slots"], weights_dir=Path(a["weights_dir"]),
        clock=b.CpuClock(a["server_pid"]))
    out.update(tokens_per_traj=tokens, traj_bytes=traj_b, scored_bytes=scored_b)
    return out

print("RESULT " + json.dumps(run(main, json.loads(sys.argv[1]))[0]))
"""


def old_pipeline(old_dir: Path, **a) -> dict:
    """parley_pipeline of the checkout in old_dir, in a child process; its figures as it reports them."""
    env = {**os.environ, "PYTHONPATH": str(old_dir)}
    proc = subprocess.run(
        [sys.executable, "-c", _OLD_CHILD, json.dumps(a, default=str)],
        cwd=old_dir,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"the old checkout's parley path in {old_dir} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


# -- raw JetStream reference ---------------------------------------------------------------------------


async def raw_pipeline(
    url: str,
    run: str,
    bus,
    *,
    tasks: int,
    n: int,
    task_bytes: int,
    traj_bytes: int,
    scored_bytes: int,
    window: int,
    hops: int,
    clock: CpuClock,
) -> dict:
    """Plain client code on the same streams and durable consumers: publish, then per hop fetch up
    to `window` messages, publish what the next hop gets (awaiting the publish acks together), and
    ack. hops=3: task -> n trajectories -> scored -> consumed, the bytes parley moves on each hop;
    hops=1: tasks x n trajectory-sized payloads published and fetched+acked once."""
    from nats.errors import TimeoutError as NatsTimeout

    from parley.protocol import topology

    conns = [await connect(url, f"raw-{i}") for i in range(4)]
    await topology.ensure_topology(conns[0].jetstream(), run, bus)
    payload = {"tasks": os.urandom(task_bytes), "traj": os.urandom(traj_bytes), "scored": os.urandom(scored_bytes)}
    total = tasks * n
    if hops == 1:
        plan, first_key, first_count = [("traj", None, 0)], "traj", total
    else:
        plan = [("tasks", "traj", n), ("traj", "scored", 1), ("scored", None, 0)]
        first_key, first_count = "tasks", tasks
    stop = asyncio.Event()
    done = asyncio.Event()
    consumed = {"n": 0}

    async def hop(nc, src: str, dst: str | None, fanout: int) -> None:
        js = nc.jetstream()
        sub = await js.pull_subscribe_bind(topology.CHANNELS[src].durable, stream=topology.stream_name(run, src))
        while not stop.is_set():
            try:
                msgs = await sub.fetch(window, timeout=0.5)
            except (TimeoutError, NatsTimeout):
                continue
            if dst:
                subj = topology.subject(run, dst)
                await asyncio.gather(*(js.publish(subj, payload[dst]) for _ in msgs for _ in range(fanout)))
            for m in msgs:
                await m.ack()
            if dst is None:
                consumed["n"] += len(msgs)
                if consumed["n"] >= total:
                    done.set()

    jobs = [asyncio.create_task(hop(conns[i + 1], *p)) for i, p in enumerate(plan)]
    await asyncio.sleep(0.5)
    pjs = conns[0].jetstream()
    subj = topology.subject(run, first_key)
    clock.start()
    t0 = time.perf_counter()
    for lo in range(0, first_count, 64):
        await asyncio.gather(*(pjs.publish(subj, payload[first_key]) for _ in range(lo, min(first_count, lo + 64))))
    wall, cpu = await _until_done(done, jobs, stop, conns, clock, t0)
    return {"wall_s": wall, "trajectories": consumed["n"], "traj_per_s": consumed["n"] / wall, **cpu}


# -- driver -----------------------------------------------------------------------------------------


async def bench(args) -> list[dict]:
    from transformers import AutoTokenizer

    from parley.deploy.natsserver import NatsServer
    from parley.engines.models import ensure_model

    model_dir = ensure_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="parley-bus-bench-") as tmp:
        server = NatsServer(Path(tmp) / "nats", port=0)
        server.start()
        clock = CpuClock(server.proc.pid)
        try:
            for size_kb, count in zip(args.sizes_kb, args.trajectories):
                tokens, traj_b, scored_b, task_b = await calibrate(tokenizer, model_dir, size_kb * KB)
                tasks = max(1, count // args.n)
                max_bytes = max(64 << 20, int(tasks * args.n * (traj_b + scored_b) * 1.5) + (16 << 20))
                bus = bus_settings(max_bytes)
                # nats-server drops a client as a slow consumer once its pending data pass max_pending
                # (64 MB, deploy/natsserver.py): 32 fetched 2 MB messages do. Fewer slots for large sizes.
                slots = min(args.slots, max(1, (args.inflight_mb << 20) // scored_b))
                results = {"raw3": [], "raw1": [], "parley": [], **({"old": []} if args.old else {})}
                for rep in range(args.repeats):
                    tag = f"{size_kb}k{rep}"
                    common = dict(
                        tasks=tasks,
                        n=args.n,
                        task_bytes=task_b,
                        traj_bytes=traj_b,
                        scored_bytes=scored_b,
                        window=slots,
                        clock=clock,
                    )
                    results["raw3"].append(await raw_pipeline(server.url, f"raw3-{tag}", bus, hops=3, **common))
                    results["raw1"].append(await raw_pipeline(server.url, f"raw1-{tag}", bus, hops=1, **common))
                    results["parley"].append(
                        await parley_pipeline(
                            server.url,
                            f"parley-{tag}",
                            model_dir,
                            tokenizer,
                            tasks=tasks,
                            n=args.n,
                            tokens=tokens,
                            bus=bus,
                            actor_slots=slots,
                            scorer_slots=slots,
                            learner_slots=slots,
                            weights_dir=Path(tmp) / f"weights-{tag}",
                            clock=clock,
                        )
                    )
                    if args.old:
                        results["old"].append(
                            old_pipeline(
                                args.old,
                                url=server.url,
                                run=f"old-{tag}",
                                target_bytes=size_kb * KB,
                                tasks=tasks,
                                n=args.n,
                                max_bytes=max_bytes,
                                slots=slots,
                                weights_dir=Path(tmp) / f"weights-old-{tag}",
                                server_pid=server.proc.pid,
                            )
                        )
                med = {k: statistics.median(r["traj_per_s"] for r in v) for k, v in results.items()}
                # CPU milliseconds per trajectory: client (roles or raw code) and nats-server
                cpu = {
                    k: {
                        c: 1000 * statistics.median(r[f"{c}_cpu_s"] / r["trajectories"] for r in v)
                        for c in ("client", "server")
                    }
                    for k, v in results.items()
                }
                # the ratio of each repeat is taken within the repeat (same minute of the machine's load)
                ratio3 = statistics.median(
                    p["traj_per_s"] / r["traj_per_s"] for p, r in zip(results["parley"], results["raw3"])
                )
                ratio1 = statistics.median(
                    p["traj_per_s"] / r["traj_per_s"] for p, r in zip(results["parley"], results["raw1"])
                )
                row = {
                    "size_kb": size_kb,
                    "traj_bytes": traj_b,
                    "scored_bytes": scored_b,
                    "task_bytes": task_b,
                    "tokens_per_traj": tokens,
                    "trajectories": tasks * args.n,
                    "n": args.n,
                    "slots": slots,
                    "parley_traj_s": med["parley"],
                    "raw3_traj_s": med["raw3"],
                    "raw1_traj_s": med["raw1"],
                    "ratio_raw3": ratio3,
                    "ratio_raw1": ratio1,
                    "cpu_ms_per_traj": cpu,
                    "runs": results,
                }
                if args.old:
                    old = results["old"][0]
                    row.update(
                        old_traj_s=med["old"],
                        old_tokens_per_traj=old["tokens_per_traj"],
                        old_traj_bytes=old["traj_bytes"],
                        old_ratio_raw3=statistics.median(
                            o["traj_per_s"] / r["traj_per_s"] for o, r in zip(results["old"], results["raw3"])
                        ),
                    )
                rows.append(row)
        finally:
            server.stop()
    return rows


def _ratio(a: float, b: float) -> str:
    # CPU times come in clock ticks (10 ms): a tiny run can measure 0 for the raw path
    return f"{a / b:.2f}x" if b > 0 else "- (raw CPU below the clock tick)"


def table(rows: list[dict]) -> str:
    lines = [
        "| trajectory | tokens | bytes / token | Scored | trajectories (in flight) | parley traj/s | raw 3-hop traj/s "
        "| raw 1-hop traj/s | parley / raw 3-hop | parley / raw 1-hop |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['traj_bytes'] / KB:.1f} KB | {r['tokens_per_traj']} | {r['traj_bytes'] / r['tokens_per_traj']:.1f} "
            f"| {r['scored_bytes'] / KB:.1f} KB | {r['trajectories']} ({r['slots']}) "
            f"| {r['parley_traj_s']:.0f} | {r['raw3_traj_s']:.0f} | {r['raw1_traj_s']:.0f} "
            f"| {r['ratio_raw3']:.2f} | {r['ratio_raw1']:.2f} |"
        )
    has_old = all("old_traj_s" in r for r in rows) and rows
    if has_old:
        lines += [
            "",
            "The previous code (--old) in the same repeats, at the same trajectory bytes:",
            "",
            "| trajectory | old tokens | old bytes / token | old traj/s | old / raw 3-hop | new / raw 3-hop "
            "| old client CPU ms | new client CPU ms | new tokens/s / old tokens/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            c = r["cpu_ms_per_traj"]
            tok_gain = (r["parley_traj_s"] * r["tokens_per_traj"]) / (r["old_traj_s"] * r["old_tokens_per_traj"])
            lines.append(
                f"| {r['traj_bytes'] / KB:.1f} KB | {r['old_tokens_per_traj']} "
                f"| {r['old_traj_bytes'] / r['old_tokens_per_traj']:.1f} | {r['old_traj_s']:.0f} "
                f"| {r['old_ratio_raw3']:.2f} | {r['ratio_raw3']:.2f} | {c['old']['client']:.2f} | {c['parley']['client']:.2f} "
                f"| {tok_gain:.2f}x |"
            )
    lines += [
        "",
        "CPU ms per trajectory (client = this process: the three roles, or the raw client code; server = nats-server):",
        "",
        "| trajectory | parley client | raw 3-hop client | raw 1-hop client | parley server | raw 3-hop server "
        "| raw 1-hop server | parley / raw 3-hop (client + server) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["cpu_ms_per_traj"]
        both = {k: v["client"] + v["server"] for k, v in c.items()}
        lines.append(
            f"| {r['traj_bytes'] / KB:.1f} KB | {c['parley']['client']:.2f} | {c['raw3']['client']:.2f} "
            f"| {c['raw1']['client']:.2f} | {c['parley']['server']:.2f} | {c['raw3']['server']:.2f} "
            f"| {c['raw1']['server']:.2f} | {_ratio(both['parley'], both['raw3'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[16, 256, 2048], help="encoded Trajectory sizes")
    p.add_argument("--trajectories", type=int, nargs="+", default=[2000, 400, 48], help="trajectories per size")
    p.add_argument("--n", type=int, default=4, help="samples per task (group size)")
    p.add_argument(
        "--slots",
        type=int,
        default=32,
        help="in flight per hop: actor conversations, scorer and learner handlers, raw fetch window",
    )
    p.add_argument(
        "--inflight-mb",
        type=int,
        default=16,
        help="fewer slots where slots x Scored size would pass this many MB per hop",
    )
    p.add_argument("--repeats", type=int, default=2, help="raw/parley pairs per size; medians reported")
    p.add_argument("--quick", action="store_true", help="a quarter of the trajectories (~30 s)")
    p.add_argument("--json", type=Path, help="also write all runs here")
    p.add_argument(
        "--old",
        type=Path,
        help="a checkout of the previous code (git archive COMMIT | tar -x -C DIR): its parley path runs "
        "in each repeat too",
    )
    args = p.parse_args()
    if args.old and not (args.old / "bench" / "bus_capacity.py").is_file():
        p.error(
            f"--old {args.old}: no bench/bus_capacity.py there; extract a checkout with "
            f"`git archive COMMIT | tar -x -C {args.old}`"
        )
    if len(args.trajectories) == 1:
        args.trajectories *= len(args.sizes_kb)
    if len(args.trajectories) != len(args.sizes_kb):
        p.error("--trajectories needs one count, or one per --sizes-kb")
    if args.quick:
        args.trajectories = [max(args.n, t // 4) for t in args.trajectories]
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    from bench.common import report, run

    rows, seconds = run(bench, args)  # every role runs on uvloop; so does the reference
    report(
        "bus capacity",
        f"n={args.n}, up to {args.slots} in flight per hop (at most {args.inflight_mb} MB)",
        seconds,
        table(rows),
        rows,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
