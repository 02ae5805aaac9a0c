"""A real small run under fire: roles and nats-server SIGKILLed and restarted at seeded random
moments, an actor stalled (SIGSTOP) until its task goes to the other actor, the user simulator
down for 5 minutes while the actors hold their conversations, the judge down for 45 s, and poison
tasks published straight to TASKS; the bus at its default max_deliver, the learner checkpointing
every 3 steps, training with no last step through the schedule, then given one (its checkpointed
step + 8, by a kill and a --resume) and stopping there. Then the books are settled: every (task, sample) the
feeder published is trained exactly once, dropped with a recorded reason, or still waiting in a
stream or the learner's ledger; every poison task is in DEAD with its reason. 0 lost, 0 trained
twice. The figures of a run and how to read them: docs/reliability.md.

Every role runs as its own NATS user with `parley up`'s permissions (up_credentials, up_env), the
test as the admin; a refusal in any role's log fails the run (a learner restarted with --resume
that lacks a grant crashes on it over and over, which would read as NATS outages at start).

Run: make faults   (= .venv/bin/pytest -m faults tests/faults -s)
Environment: PARLEY_FAULTS_SEED (default 8), PARLEY_FAULTS_REPORT (write the summary JSON there).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import msgspec
import pytest

from parley.config.run import load_config
from parley.protocol import codec, dead, examples, topology
from parley.protocol.connect import barrier, connect
from parley.protocol.messages import TASK_MAX_N, TASK_MAX_NEW_TURNS
from tests.faults.chaos import (
    NATS_START_S,
    Chaos,
    Cluster,
    Schedule,
    build_deepspeed_ops,
    load_final_state,
    nats_outage_at_start,
    owed_ids,
    publish_poison,
    read_channel,
    retrying,
    settle,
    tasks_played_twice,
    trained_lines,
    up_credentials,
    up_env,
)

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(2400)]

RUN = "chaos"
SEED = int(os.environ.get("PARLEY_FAULTS_SEED", "8"))
ACK_WAIT_S = 8.0
SCHEDULE = Schedule(ack_wait_s=ACK_WAIT_S)
# learner.steps = 0: the learner trains with no last step through the whole schedule, so every phase
# has work in flight however fast the machine is (a fixed count was not: on an idle machine 8 steps
# were over 50 s into it, 2026-12-02, and 40 within 35 s, 2026-12-07, long before the judge outage
# and the kill phase). When the schedule is over the chaos gives it its last step (Chaos.end_learner:
# its checkpointed step + SCHEDULE.steps_after, restarted with --resume), where it stops with exit 0.
STEPS = 0
ACTOR_MAX_MODEL_LEN = 1024
# A conversation waits this long for an unreachable simulator before its task is given up: the
# 300 s outage plus up to ~4 minutes for the restarted simulator's engine to load on this loaded
# machine fit in it, so the outage is waited out, not dead-lettered (the suite checks that).
SIM_WAIT_S = 900.0
assert SIM_WAIT_S > SCHEDULE.sim_outage_s + 240


def poison_tasks() -> dict[str, bytes]:
    """Messages published straight to TASKS that no actor may play: well-formed Tasks with values no
    honest feeder sends, one of another run, and one that does not decode. Each must end in DEAD."""

    def task(task_id: str, **values) -> bytes:
        return codec.encode(msgspec.structs.replace(examples.task(RUN, task_id), **{"n": 3, **values}))

    return {
        "n": task("poison-n", n=TASK_MAX_N + 1),
        "max_tokens": task("poison-max-tokens", max_tokens=100 * ACTOR_MAX_MODEL_LEN),
        "max_new_turns": task("poison-max-new-turns", max_new_turns=1000 * TASK_MAX_NEW_TURNS),
        "other run": codec.encode(examples.task("someone-else", "poison-other-run")),
        "undecodable": b"\xc1 this is not a Task",
    }


def cluster_for(root, model: str) -> tuple[Cluster, dict[str, tuple[str, str]]]:
    def engine(section: str, length: int) -> list[str]:
        return [
            f'{section}.model="{model}"',
            f"{section}.max_model_len={length}",
            f"{section}.kv_cache_bytes={128 * 2**20}",
        ]

    # actor.concurrency 24 = 9 tasks per actor (n=3): more than the feeder admits at once, so
    # actor-1 always has room for the stalled actor's tasks.
    sets = [
        # bus.max_deliver stays at its default (5): outages must not spend deliveries
        f'run.dir="{root / "run"}"',
        f"bus.ack_wait_s={ACK_WAIT_S}",
        f"bus.max_bytes={64 * 2**20}",
        "rollout.n=3",
        "rollout.max_new_turns=3",
        "rollout.max_tokens=24",
        *engine("actor.engine", ACTOR_MAX_MODEL_LEN),
        "actor.concurrency=24",
        "actor.sim_timeout_s=20",
        f"actor.sim_wait_s={SIM_WAIT_S}",
        "actor.weights_poll_s=2",
        *engine("sim.engine", 2048),
        "sim.max_tokens=40",
        "sim.max_retries=1",
        # judge temperature 1: the toy judge's verdicts vary, so groups carry a GRPO signal
        *engine("judge.engine", 1536),
        "judge.max_tokens=256",
        "judge.temperature=1.0",
        "scorer.judge_timeout_s=20",
        "scorer.retry_delay_s=1",
        "scorer.retry_max_delay_s=4",
        f'policy.model="{model}"',
        f"learner.steps={STEPS}",
        "learner.checkpoint_every=3",
        "learner.groups_per_step=2",
        "learner.max_staleness=2",
        'learner.stale_policy="correct"',
        # longer than the simulator outage and its restart: the groups it interrupts are waited for, not timed out
        "learner.group_timeout_s=900",
        "learner.micro_batch_tokens=512",
        "learner.lr=1e-4",
        "learner.ledger_flush_s=1",
        "learner.keep_versions=3",
        "learner.eval_every=0",  # the periodic eval (a policy engine per eval) is outside this suite's scope
    ]
    creds, conf = up_credentials(root, RUN, load_config(None, sets))
    c = Cluster(root, model, run=RUN, sets=sets, server_conf=conf)
    c.add("sim", "sim", ["sim", "--run", RUN, "--id", "sim"], env=up_env("sim", creds))
    c.add("judge", "judge", ["judge", "--run", RUN, "--id", "judge"], env=up_env("judge", creds))
    c.add("actor-0", "actor", ["actor", "--run", RUN, "--id", "actor-0"], env=up_env("actor", creds))
    c.add("actor-1", "actor", ["actor", "--run", RUN, "--id", "actor-1"], env=up_env("actor", creds))
    c.add("scorer", "scorer", ["scorer", "--run", RUN, "--id", "scorer"], env=up_env("scorer", creds))
    c.add("learner", "learner", ["learner", "--run", RUN], env=up_env("learner", creds))
    return c, creds


async def wait_until(pred, what: str, timeout: float, cluster: Cluster, t0: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for text in cluster.reap():
            cluster.note(t0, text)
        if cluster.refused:
            pytest.fail(f"waiting for {what}: the server refused roles (deploy/permissions.py): {cluster.refused}")
        if time.monotonic() > deadline:
            not_up = [n for n in cluster.roles if not cluster.is_up(n)]
            pytest.fail(
                f"timed out after {timeout:.0f}s waiting for {what} (not ready: {not_up})\n"
                + "\n".join(cluster.events[-20:])
            )
        await asyncio.sleep(0.5)


async def test_kills_outages_and_poison_lose_nothing_and_train_nothing_twice(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("chaos")
    cluster, creds = cluster_for(root, str(tiny_model))
    rng = random.Random(SEED)
    stats: dict = {"seed": SEED, "learner_steps": STEPS, "load_average_at_start": os.getloadavg()}
    stats["deepspeed_op_build_s"] = round(build_deepspeed_ops(), 1)  # before the clock: no role waits on it
    t_begin = time.time()
    cluster.url = cluster.server.start(timeout=NATS_START_S)
    nc = await connect(cluster.url, name="chaos-observer", user=creds["admin"][0], password=creds["admin"][1])
    js = nc.jetstream()
    learner = cluster.roles["learner"]
    poison = poison_tasks()
    try:
        bus = topology.BusSettings(ack_wait_s=ACK_WAIT_S, max_bytes=64 * 2**20)  # max_deliver: the default
        await topology.ensure_topology(js, RUN, bus)

        async def on_beat(msg):
            cluster.on_beat(codec.decode("status", msg.data))

        await nc.subscribe(topology.status_subject(RUN), cb=on_beat)
        await barrier(nc)
        for name in cluster.roles:
            cluster.start(name)
        await wait_until(
            lambda: all(cluster.is_up(n) for n in cluster.roles), "every role to be ready", 600, cluster, t_begin
        )
        stats["startup_s"] = round(time.time() - t_begin, 1)
        cluster.note(t_begin, f"all roles ready after {stats['startup_s']}s")

        # ---- chaos -------------------------------------------------------------------------
        await publish_poison(js, RUN, poison)
        cluster.note(t_begin, f"published {len(poison)} poison messages straight to TASKS: {sorted(poison)}")
        chaos = Chaos(cluster, js, rng, SCHEDULE)
        await chaos.run()
        last_step = chaos.end_learner()  # killed and resumed with learner.steps = its checkpointed step + 8
        stats.update(chaos.summary())
        t0 = chaos.t0
        stall, outage, sim_outage = chaos.stall, chaos.outage, chaos.sim
        phases = stats["phases_s"]

        # ---- wind down: every role back, the learner to its last step, then the rest drain ------
        await wait_until(
            lambda: all(cluster.is_up(n) for n in cluster.roles if not cluster.roles[n].finished),
            "every role to be ready after the chaos",
            600,
            cluster,
            t0,
        )
        phases["all ready"] = round(time.time() - t0, 1)
        cluster.note(t0, "chaos over; all roles ready")
        await wait_until(
            lambda: learner.finished, f"the learner to stop at its last step ({last_step})", 1200, cluster, t0
        )
        phases["learner at its last step"] = round(time.time() - t0, 1)
        cluster.note(t0, "the learner exited 0 after its last step; draining the actors and the scorer")

        async def drained() -> bool:
            for key in ("tasks", "traj"):
                info = await js.consumer_info(topology.stream_name(RUN, key), topology.CHANNELS[key].durable)
                if info.num_pending or info.num_ack_pending:
                    return False
            return True

        deadline = time.monotonic() + 180
        while not await retrying(drained, "drain check") and time.monotonic() < deadline:
            for text in cluster.reap():
                cluster.note(t0, text)
            await asyncio.sleep(1.0)
        stats["drained"] = await retrying(drained, "drain check")
        for name in ("actor-0", "actor-1", "scorer", "sim", "judge"):
            stats.setdefault("exit_codes", {})[name] = cluster.terminate(name)
            cluster.roles[name].held_down = True
        phases["stopped"] = round(time.time() - t0, 1)
        cluster.note(t0, f"every role stopped; drained={stats['drained']}")

        # ---- the books -------------------------------------------------------------------------
        owed = await owed_ids(js, RUN, settle_s=3 * ACK_WAIT_S)
        tasks = await read_channel(js, RUN, "tasks")
        letters, _ = await retrying(lambda: dead.read_since(js, RUN, 1), "reading DEAD")
        run_dir = root / "run"
        state, buffered = load_final_state(run_dir)
        lines = trained_lines(run_dir)
        deadline_s = cluster.cfg.learner.task_deadline_s
        ledger = settle(tasks, letters, lines, state, buffered, owed, poison=poison, task_deadline_s=deadline_s)
        twice = tasks_played_twice(cluster)
        cluster.scan_refusals()
        phases["books"] = round(time.time() - t0, 1)

        # the streams' use against bus.max_bytes (LIMITS, discard OLD: a message discarded for room
        # would read as a sample lost or trained with no task): the run trains as long as the schedule lasts
        streams = {}
        for key in topology.CHANNELS:
            info = await retrying(lambda k=key: js.stream_info(topology.stream_name(RUN, k)), "stream info")
            streams[key] = {
                "messages": info.state.messages,
                "bytes": info.state.bytes,
                "first_seq": info.state.first_seq,
            }
        sim_dead = [dl.reason for _, dl in letters if dl is not None and "simulator unreachable" in dl.reason]
        stats.update(
            ledger=ledger.summary(),
            drop_reasons=dict(list(ledger.reasons.items())[:12]),
            ledger_step=state.step if state else None,
            streams=streams,
            learner_exit=learner.proc.returncode,
            sim_unreachable_dead_letters=len(sim_dead),
            crashes={n: r.crashes for n, r in cluster.roles.items() if r.crashes},
            refused=cluster.refused,
            replies_refused_after_a_restart={n: len(x) for n, x in cluster.orphan_replies.items()},
            tasks_played_to_completion_twice=twice,
            load_average_at_end=os.getloadavg(),
            total_s=round(time.time() - t_begin, 1),
            events=cluster.events,
        )
        report = json.dumps(stats, indent=2)
        print("\n" + report, flush=True)
        (root / "faults-report.json").write_text(report)
        if os.environ.get("PARLEY_FAULTS_REPORT"):
            with open(os.environ["PARLEY_FAULTS_REPORT"], "w") as f:
                f.write(report)

        # ---- what must hold --------------------------------------------------------------------
        assert cluster.refused == {}, f"the server refused roles (deploy/permissions.py): {cluster.refused}"
        assert ledger.lost == [], f"lost samples: {ledger.lost[:20]}"
        assert ledger.trained_twice == [], f"trained twice: {ledger.trained_twice[:20]}"
        assert ledger.inconsistent == [], f"inconsistent ledger: {ledger.inconsistent[:20]}"
        assert ledger.past_deadline == [], f"slots held past task_deadline_s: {ledger.past_deadline[:20]}"
        # every issued task trained, dropped with its reason (learner ledger or dead letter), or waiting
        assert sum(ledger.fates.values()) == ledger.tasks and set(ledger.fates) <= {
            "trained",
            "dropped",
            "dead",
            "waiting",
        }
        assert all(ledger.reasons.get(t) for t, kind in state.done.items() if kind != "trained"), ledger.reasons
        # every poison message refused on arrival and kept in DEAD with its reason
        assert ledger.poison_missing == [] and len(ledger.poison) == len(poison), ledger.poison
        # training reached its last step: the learner stopped there by itself, with the ledger and trained.jsonl at it
        assert learner.finished and learner.proc.returncode == 0, learner.crashes
        # the last step: the one it was given when the schedule ended (its checkpointed step + steps_after)
        assert last_step == stats["learner_end"]["checkpointed_step"] + SCHEDULE.steps_after, stats["learner_end"]
        assert state.step == last_step and ledger.steps == last_step and ledger.trained > 0, (state.step, ledger.steps)
        # the chaos's kills (not end_learner's)
        assert stats["kills_total"] >= SCHEDULE.min_kills, stats["kills"]
        assert all(v >= 1 for v in stats["kills"].values()), f"a role was never killed: {stats['kills']}"
        steps_at_kills = stats["learner_steps_at_kills"]
        assert any(s is not None and s < last_step for s in steps_at_kills), (
            f"the learner was never killed with steps left to train: {steps_at_kills}"
        )
        assert stall["state"] == "done" and stall["max_redelivered"] >= 1, f"the stalled actor's tasks stayed: {stall}"
        # trajectories that arrived while the judge was down were held by the scorer (and are in the ledger)
        assert outage["state"] == "done", outage
        assert outage["unscored_at_restart"] >= 1 and outage["scorer_judge_waits"] >= 1, outage
        # the simulator outage was waited out: conversations were held, the actors asked again, no task
        # was given up for it
        assert sim_outage["state"] == "done" and sim_outage["down_s"] >= SCHEDULE.sim_outage_s, sim_outage
        assert sum(sim_outage["conversations_held"].values()) >= 1, sim_outage
        assert sum(sim_outage["sim_waits"].values()) >= 1, sim_outage
        assert sim_dead == [], sim_dead[:5]
        # A role may die when it meets no NATS server while starting (a supervisor restarts it, as here);
        # any other exit we did not cause is a bug.
        crashes = {n: [c for c in cs if not nats_outage_at_start(c)] for n, cs in stats["crashes"].items()}
        assert not any(crashes.values()), f"roles exited on their own: {crashes}"
    finally:
        cluster.stop_all()
        await nc.close()
