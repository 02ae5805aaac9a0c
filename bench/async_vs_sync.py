"""Async vs sync: learner steps per hour and learner idle fraction at max_staleness 0 (synchronous),
1 and 2, on the same long-tailed workload with the same actor slots and the same learner.

Real parts: nats-server, the feeder and its staleness gate (learner.feeder.Feeder), the TASKS and
SCORED streams with their shared consumers (protocol.bus.PullWorker), grouping and the staleness
check (learner.groups.Grouper). Time-scaled test doubles: `TimedRollouts` (the actor + scorer: each
sample holds one of `slots` conversation slots for a lognormal duration, then its Scored is
published) and `SleepingLearner` (a GRPO step is a fixed sleep). Weights reach the actors the
moment a step ends (the weight path is measured in bench/weight_path.py). Run by hand (issue 9);
tests/integration/test_bench_smoke.py runs it tiny.

    .venv/bin/python bench/async_vs_sync.py            # 3 configurations x 50 s
    .venv/bin/python bench/async_vs_sync.py --quick    # 3 x 15 s
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Workload:
    """Rollout durations: lognormal around `median_s` (sigma `sigma`), capped at `cap` x median;
    drawn from the task's seed and the sample index, so every configuration plays the same tasks
    with the same durations."""

    def __init__(self, median_s: float, sigma: float, cap: float = 20.0):
        self.median_s, self.sigma, self.cap = median_s, sigma, cap

    def duration(self, task_seed: int, sample: int) -> float:
        rng = random.Random(task_seed * 1009 + sample)
        return min(self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)), self.cap * self.median_s)

    def moments(self, batch: int, draws: int = 20000) -> tuple[float, float]:
        """(mean duration, mean of the longest of `batch` durations), by sampling."""
        rng = random.Random(12345)
        d = lambda: min(self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)), self.cap * self.median_s)  # noqa: E731
        mean = statistics.fmean(d() for _ in range(draws))
        longest = statistics.fmean(max(d() for _ in range(batch)) for _ in range(draws // 10))
        return mean, longest


class TimedRollouts:
    """Test double for actor + scorer: takes Tasks from the shared "actor" consumer like the real
    actor (tasks in flight = slots // n + 1, samples bounded by `slots`), holds a slot for the
    sample's duration, publishes a Scored stamped with the policy version current when the
    sample started, and acks the task when all n are stored."""

    def __init__(self, js, run: str, bus, workload: Workload, slots: int, n: int, version_fn, task_slots: int = 0):
        self.js, self.run, self.bus, self.workload, self.n = js, run, bus, workload, n
        self.slots = asyncio.Semaphore(slots)
        self.slot_count = slots
        self.task_slots = task_slots or slots // n + 1  # actors.actor.Actor's rule
        self.version_fn = version_fn
        self.busy_s = 0.0  # slot-seconds spent in rollouts

    async def handle(self, task, msg) -> None:
        await asyncio.gather(*(self._sample(task, i) for i in range(task.n)))
        await msg.ack()

    async def _sample(self, task, i: int) -> None:
        from parley.protocol import arrays
        from parley.protocol.bus import publish
        from parley.protocol.messages import AssistantTurn, Scored, Trajectory

        async with self.slots:
            version = self.version_fn()
            d = self.workload.duration(task.seed, i)
            await asyncio.sleep(d)
            self.busy_s += d
        traj = Trajectory(
            traj_id=f"{task.task_id}/{i}",
            task_id=task.task_id,
            sample=i,
            run=self.run,
            item_id=task.item_id,
            messages=[],
            token_ids_i32=arrays.pack_ids([1, 2, 3, 4]),
            loss_mask_u8=arrays.pack_mask([0, 0, 1, 1]),
            turns=[
                AssistantTurn(
                    start=2, logprobs_f32=arrays.pack_logprobs([-0.5, -0.7]), version=version, finish_reason="stop"
                )
            ],
            reference=task.reference,
        )
        reward = random.Random(task.seed * 31 + i).random()  # distinct within a group: every group has signal
        await publish(
            self.js,
            self.run,
            "scored",
            Scored(
                traj_id=traj.traj_id,
                task_id=task.task_id,
                sample=i,
                run=self.run,
                metrics={"bleu": reward},
                weights={"bleu": 1.0},
                total=reward,
                trajectory=traj,
                created=time.time(),
            ),
        )

    async def run_until(self, stop: asyncio.Event) -> None:
        from parley.protocol.bus import PullWorker

        worker = PullWorker(
            self.js,
            self.run,
            "tasks",
            self.handle,
            bus=self.bus,
            name="timed-actor",
            concurrency=self.task_slots,
            fetch_timeout=0.5,
        )
        await worker.run_until(stop)


class SleepingLearner:
    """Test double for the learner's step (a sleep of `step_s`) around the real intake, grouping
    and feeder bookkeeping, in the order learner.service does them: take groups_per_step complete
    groups (stale ones are dropped), step, mark them consumed, move the version (which reopens
    the feeder's gate)."""

    def __init__(
        self, js, run: str, bus, feeder, grouper, *, groups_per_step: int, step_s: float, old_gate: bool = False
    ):
        self.js, self.run, self.bus, self.feeder, self.grouper = js, run, bus, feeder, grouper
        self.old_gate = old_gate
        self.groups_per_step, self.step_s = groups_per_step, step_s
        self.version = 0
        self.step_ends: list[float] = []
        self.busy_s = 0.0
        self.dropped = 0
        self._data = asyncio.Event()

    async def on_scored(self, scored, msg) -> None:
        if self.grouper.add(scored) == "complete":
            self._data.set()
        await msg.ack()

    async def run_until(self, stop: asyncio.Event) -> None:
        from parley.protocol.bus import PullWorker

        intake = PullWorker(
            self.js,
            self.run,
            "scored",
            self.on_scored,
            bus=self.bus,
            name="sleeping-learner",
            concurrency=32,
            fetch_timeout=0.5,
        )
        job = asyncio.create_task(intake.run_until(stop))
        try:
            while not stop.is_set():
                taken, outcomes = self.grouper.take(self.groups_per_step, self.version)
                for o in outcomes:
                    # as Learner.consume: a group that was not trained gives its place in the window
                    # back; --old-gate counts it as consumed, the rule before that fix
                    self.feeder.mark_consumed(o.task_id, trained=self.old_gate)
                    self.dropped += o.kind == "stale"
                if not taken:
                    self._data.clear()
                    try:
                        await asyncio.wait_for(self._data.wait(), timeout=0.2)
                    except TimeoutError:
                        pass
                    if job.done():
                        job.result()
                    continue
                t0 = time.perf_counter()
                await asyncio.sleep(self.step_s)
                self.busy_s += time.perf_counter() - t0
                self.version += 1
                for t in taken:
                    self.feeder.mark_consumed(t.group.task_id)
                self.feeder.set_version(self.version)
                self.step_ends.append(time.perf_counter())
        finally:
            stop.set()
            await asyncio.gather(job, return_exceptions=True)


def simulate(staleness: int, args, workload: Workload, steps: int = 400) -> dict:
    """The same gate, grouping and workload with a zero-latency bus, as a discrete-event simulation:
    what the design allows, against which the measured run is read. Same rules as the measured
    run: admission_limit, tasks held by the actor, conversation slots, oldest complete group first,
    groups lagging more than max_staleness dropped, taken groups consumed when their step ends.
    `lags` lists, per step, each trained group's lag (bench/staleness_learning.py replays them)."""
    import heapq

    from parley.learner.feeder import admission_limit

    B, n = args.groups_per_step, args.n
    task_slots = args.task_slots or args.slots // n + 1
    t, version, consumed, issued = 0.0, 0, 0, 0
    in_flight: set[int] = set()
    task_queue: list[int] = []  # issued, not yet held by the actor
    sample_queue: list[tuple[int, int]] = []  # (task, sample) of held tasks waiting for a slot
    held, running, busy_until = 0, 0, None
    left: dict[int, int] = {}  # samples still running per task
    versions: dict[int, int] = {}  # oldest behaviour version per task
    complete: list[tuple[float, int]] = []  # (completed at, task)
    events: list[tuple[float, int, int]] = []  # (time, kind 0 = sample end / 1 = step end, task)
    ends, dropped, taken = [], 0, []
    lags: list[list[int]] = []  # per step: each trained group's lag (versions behind the learner)
    while len(ends) < steps:
        while len(in_flight) + consumed + 1 <= admission_limit(version, staleness, B):
            in_flight.add(issued)
            task_queue.append(issued)
            issued += 1
        while held < task_slots and task_queue:
            task = task_queue.pop(0)
            held += 1
            left[task] = n
            sample_queue += [(task, i) for i in range(n)]
        while running < args.slots and sample_queue:
            task, i = sample_queue.pop(0)
            running += 1
            versions[task] = min(versions.get(task, version), version)
            heapq.heappush(events, (t + workload.duration(task, i), 0, task))
        if busy_until is None:
            chosen = []
            for done_at, task in sorted(complete):
                if len(chosen) == B:
                    break
                if version - versions[task] > staleness and args.stale_policy == "drop":
                    complete.remove((done_at, task))
                    in_flight.discard(task)
                    consumed += args.old_gate
                    dropped += 1
                    continue
                chosen.append((done_at, task))
            if len(chosen) == B:
                for c in chosen:
                    complete.remove(c)
                taken = [task for _, task in chosen]
                lags.append([version - versions[task] for task in taken])
                busy_until = t + args.step_s
                heapq.heappush(events, (busy_until, 1, -1))
        t, kind, task = heapq.heappop(events)
        if kind == 0:
            running -= 1
            left[task] -= 1
            if left[task] == 0:
                held -= 1
                complete.append((t, task))
        else:
            version += 1
            for task in taken:
                in_flight.discard(task)
                consumed += 1
            busy_until = None
            ends.append(t)
    window = ends[-1] - ends[0]
    return {
        "steps_per_hour": (len(ends) - 1) / window * 3600.0,
        "learner_idle": 1.0 - (len(ends) - 1) * args.step_s / window,
        "stale_dropped": dropped,
        "steps": len(ends),
        "lags": lags,
    }


async def one_config(url: str, staleness: int, args, workload: Workload, items) -> dict:
    from parley.config.learner import RolloutConfig
    from parley.learner.feeder import Feeder
    from parley.learner.groups import Grouper
    from parley.protocol import topology
    from parley.protocol.connect import connect

    run = f"avs-k{staleness}"
    bus = topology.BusSettings(max_bytes=256 << 20, ack_wait_s=120.0, max_ack_pending=4096)
    conns = [await connect(url, name=f"avs-{r}", first_timeout=10.0) for r in ("feeder", "actor", "learner")]
    await topology.ensure_topology(conns[0].jetstream(), run, bus)
    feeder = Feeder(
        conns[0].jetstream(),
        run,
        items,
        RolloutConfig(n=args.n),
        max_staleness=staleness,
        groups_per_step=args.groups_per_step,
        seed=0,
    )
    grouper = Grouper(args.n, max_staleness=staleness, stale_policy=args.stale_policy, timeout_s=3600.0)
    learner = SleepingLearner(
        conns[2].jetstream(),
        run,
        bus,
        feeder,
        grouper,
        groups_per_step=args.groups_per_step,
        step_s=args.step_s,
        old_gate=args.old_gate,
    )
    actors = TimedRollouts(
        conns[1].jetstream(),
        run,
        bus,
        workload,
        args.slots,
        args.n,
        lambda: learner.version,
        task_slots=args.task_slots,
    )
    stop = asyncio.Event()
    jobs = [
        asyncio.create_task(feeder.run(stop)),
        asyncio.create_task(actors.run_until(stop)),
        asyncio.create_task(learner.run_until(stop)),
    ]
    t0 = time.perf_counter()
    done, _ = await asyncio.wait(jobs, timeout=args.seconds, return_when=asyncio.FIRST_EXCEPTION)
    stop.set()
    feeder.wake()
    await asyncio.gather(*jobs, return_exceptions=True)
    for j in done:
        if j.exception() is not None:
            raise j.exception()
    wall = time.perf_counter() - t0
    for nc in conns:
        await nc.close()
    ends = learner.step_ends
    if len(ends) < 3:
        raise RuntimeError(f"max_staleness={staleness}: only {len(ends)} steps in {args.seconds}s; raise --seconds")
    # From the end of the first step to the end of the last: the start-up fill is not counted.
    window = ends[-1] - ends[0]
    steps = len(ends) - 1
    return {
        "max_staleness": staleness,
        "steps": len(ends),
        "window_s": window,
        "steps_per_hour": steps / window * 3600.0,
        "learner_idle": 1.0 - steps * args.step_s / window,
        "actor_busy": actors.busy_s / (args.slots * wall),
        "stale_dropped": learner.dropped,
        "wall_s": wall,
    }


async def bench(args) -> dict:
    from parley.deploy.natsserver import NatsServer
    from parley.tasks.data import load_items

    items = load_items()
    workload = Workload(args.median_s, args.sigma)
    rows = []
    with tempfile.TemporaryDirectory(prefix="parley-avs-") as tmp:
        server = NatsServer(Path(tmp) / "nats", port=0)
        server.start()
        try:
            for k in args.staleness:
                row = await one_config(server.url, k, args, workload, items)
                row["ideal"] = simulate(k, args, workload, steps=row["steps"])  # the same stretch as measured
                row["long_run"] = simulate(k, args, workload, steps=args.long_run_steps)
                rows.append(row)
        finally:
            server.stop()
    per_step = args.groups_per_step * args.n
    mean_d, longest = workload.moments(per_step)
    _, group_s = workload.moments(args.n)  # a group is done when its slowest sample is
    task_slots = args.task_slots or args.slots // args.n + 1
    sync_period = longest + args.step_s  # a step's samples all end, then the step runs
    # Async, by Little's law: the learner's step, the conversation slots, or the tasks an actor
    # holds at once (a task keeps its place until its slowest sample ends), whichever is slowest.
    async_period = max(args.step_s, per_step * mean_d / args.slots, args.groups_per_step * group_s / task_slots)
    free_period = max(args.step_s, per_step * mean_d / args.slots)
    return {
        "rows": rows,
        "mean_rollout_s": mean_d,
        "longest_of_step_s": longest,
        "group_s": group_s,
        "task_slots": task_slots,
        "ideal_sync_period_s": sync_period,
        "ideal_async_period_s": async_period,
        "ideal_speedup": sync_period / async_period,
        "ideal_speedup_unbounded_tasks": sync_period / free_period,
    }


def table(res: dict, args) -> str:
    rows = res["rows"]
    base = next((r for r in rows if r["max_staleness"] == 0), rows[0])
    lines = [
        "| max_staleness | steps | steps/hour | vs sync | learner idle | actor slots busy | stale groups dropped "
        "| simulated steps/hour | measured / simulated | long run: simulated vs sync | long run: learner idle "
        "| long run: stale dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sim, lr, lr_base = r["ideal"], r["long_run"], base["long_run"]
        lines.append(
            f"| {r['max_staleness']} | {r['steps']} | {r['steps_per_hour']:.0f} | "
            f"{r['steps_per_hour'] / base['steps_per_hour']:.2f}x | {r['learner_idle']:.0%} | {r['actor_busy']:.0%} | "
            f"{r['stale_dropped']} | {sim['steps_per_hour']:.0f} | {r['steps_per_hour'] / sim['steps_per_hour']:.2f} "
            f"| {lr['steps_per_hour'] / lr_base['steps_per_hour']:.2f}x | {lr['learner_idle']:.0%} | {lr['stale_dropped']} |"
        )
    lines.append("")
    lines.append(
        f"simulated: the same rules with a zero-latency bus (simulate()), over the measured number of steps; "
        f"long run: {args.long_run_steps} simulated steps."
    )
    lines.append(
        f"workload: {args.groups_per_step} groups x n={args.n} per step, {args.slots} slots, step {args.step_s}s, "
        f"rollout lognormal median {args.median_s}s sigma {args.sigma} (mean {res['mean_rollout_s']:.3f}s, slowest of "
        f"a group {res['group_s']:.3f}s, slowest of a step {res['longest_of_step_s']:.3f}s), {res['task_slots']} tasks "
        f"held by the actor at once.\nideal periods: sync {res['ideal_sync_period_s']:.3f}s, async "
        f"{res['ideal_async_period_s']:.3f}s: speedup bound {res['ideal_speedup']:.2f}x "
        f"({res['ideal_speedup_unbounded_tasks']:.2f}x if tasks held were not the limit)"
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="max_staleness values (0 = sync)")
    p.add_argument("--seconds", type=float, default=50.0, help="run time per configuration")
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="samples per group")
    p.add_argument("--slots", type=int, default=16, help="actor conversation slots (the same in every configuration)")
    p.add_argument(
        "--task-slots",
        type=int,
        default=0,
        help="tasks the actor holds at once; 0 = the real actor's rule, slots // n + 1",
    )
    p.add_argument("--step-s", type=float, default=0.4, help="learner step time (the same in every configuration)")
    p.add_argument("--median-s", type=float, default=0.25, help="median rollout duration")
    p.add_argument(
        "--sigma", type=float, default=1.0, help="lognormal sigma: 1.0 makes ~1%% of rollouts 10x the median"
    )
    p.add_argument(
        "--old-gate",
        action="store_true",
        help="the feeder's rule before its fix: dropped/skipped groups count as consumed, which "
        "shrinks the admission window for good (learner.feeder no longer does)",
    )
    p.add_argument(
        "--stale-policy",
        choices=("drop", "correct"),
        default="drop",
        help="[learner] stale_policy: drop groups lagging beyond max_staleness, or train them corrected",
    )
    p.add_argument("--long-run-steps", type=int, default=400, help="steps of the long simulated run")
    p.add_argument("--quick", action="store_true", help="15 s per configuration")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 15.0)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    from bench.common import report, run

    res, seconds = run(bench, args)
    report("async vs sync", f"{args.seconds:g} s per configuration", seconds, table(res, args), res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
