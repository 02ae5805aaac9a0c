"""Every issued task meets a fate the learner hears of: the real Learner (feeder, SCORED consumer,
DEAD reader, ledger) on a real nats-server, with a test-double trainer and a test-double actor
that takes Tasks from the real TASKS consumer and either answers them with Scored samples,
dead-letters them (the real PullWorker path, as an actor does after a simulator outage or a
check_task refusal) or loses them silently. Also: admission moves with the announced version."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import msgspec
import pytest

from parley.config.learner import LearnerConfig, RolloutConfig
from parley.config.run import RunConfig
from parley.learner.checkpoint import read_state
from parley.protocol import codec, topology
from parley.protocol.bus import Poison, PullWorker, publish
from parley.protocol.messages import ABANDONED_STALE, Scored, Task
from tests import factories
from tests.driver_double import DriverDouble

pytestmark = [pytest.mark.integration]

N = 2
BUS = topology.BusSettings(max_bytes=16 * 1024**2, ack_wait_s=4.0)


def scored_for(task: Task, sample: int, *, flat: bool = False, pad: int = 0) -> Scored:
    """A minimal trainable sample of `task` (the trainer double never reads the tokens); rewards
    differ within the group unless `flat` (then it is skipped as zero advantage); `pad` characters
    of conversation make it bigger on the wire."""
    traj = factories.trajectory(
        task.run,
        task.task_id,
        sample,
        item_id=task.item_id,
        messages=[("user", "x" * pad), ("assistant", "ok")],
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        reference=task.reference,
        turns=[factories.turn(2, [-0.5, -0.5], task.admitted_version)],
        assistant_tokens=2,
    )
    reward = 0.5 if flat else 0.25 + 0.5 * sample
    return factories.scored(
        traj,
        {"bleu": reward, "interactivity": reward, "token_amount": 0.002},
        weights={"bleu": 1.0},
        document="the document",
    )


class SnapshotDouble:
    """Stands in for weights.snapshot.WeightSnapshot: writes a few bytes as model.safetensors.
    Writing the weights directory of version `hold` blocks until `release` is set."""

    def __init__(self, data: bytes, trainer: TrainerDouble):
        self.data, self.trainer, self.written = data, trainer, None

    def write(self, out):
        if self.written is None:
            t = self.trainer
            if t.hold is not None and out.name == f"v{t.hold:06d}":
                t.entered.set()
                t.release.wait(60)
            out.mkdir(parents=True, exist_ok=True)
            (out / "model.safetensors").write_bytes(factories.safetensors_bytes(self.data))
            (out / "config.json").write_text("{}")
            self.written = out
        return self.written


class TrainerDouble(DriverDouble):
    """Stands in for learner.ranks.Driver: the calls the Learner makes, with files where it expects them.
    `hold` blocks writing the weights of that version until `release` is set; `step_s` is each step's duration."""

    def __init__(self, hold: int | None = None, step_s: float = 0.0):
        self.hold, self.step_s, self.calls = hold, step_s, []
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, op, *args):
        self.calls.append(op)
        if op == "weights_snapshot":
            return SnapshotDouble(b"weights %d" % len(self.calls), self)
        if op == "save_checkpoint":
            (args[0] / args[1]).mkdir(parents=True, exist_ok=True)
            return None
        if op == "train_step":
            time.sleep(self.step_s)  # lets planted evals finish between steps (early-stop test)
            return {"loss": 0.0, "tokens": float(sum(len(s.token_ids) for s in args[0])), "train_s": self.step_s}
        return None


def abandoned_for(task: Task, sample: int) -> Scored:
    """What a real actor and scorer publish for a sample stopped before its first turn because its
    group could no longer be trained: no turn, no reward, terminated ABANDONED_STALE."""
    traj = factories.trajectory(
        task.run,
        task.task_id,
        sample,
        item_id=task.item_id,
        messages=[("user", "x")],
        token_ids=[1, 2],
        loss_mask=[0, 0],
        reference=task.reference,
        turns=[],
        terminated=ABANDONED_STALE,
    )
    return factories.scored(traj, {}, weights={}, total=0.0)


class ActorDouble:
    """Takes Tasks from the shared "actor" consumer: `fate(index)` says "answer", "flat" (answer with
    equal rewards), "abandon" (every sample stopped before its first turn), "poison" or "lose"."""

    def __init__(self, js, run: str, fate, *, bus=BUS, pad: int = 0):
        self.js, self.run, self.fate, self.bus, self.pad = js, run, fate, bus, pad
        self.seen: list[Task] = []

    async def handle(self, task: Task, msg) -> None:
        self.seen.append(task)
        fate = self.fate(int(task.task_id.rsplit("-g", 1)[1]))
        if fate == "poison":
            raise Poison(f"test double: task {task.task_id} refused")
        if fate in ("answer", "flat"):
            for i in range(task.n):
                await publish(self.js, self.run, "scored", scored_for(task, i, flat=fate == "flat", pad=self.pad))
        if fate == "abandon":
            for i in range(task.n):
                await publish(self.js, self.run, "scored", abandoned_for(task, i))
        await msg.ack()  # "lose": acked, never answered, never dead-lettered

    def start(self, stop: asyncio.Event) -> asyncio.Task:
        worker = PullWorker(
            self.js, self.run, "tasks", self.handle, bus=self.bus, name="actor-double", concurrency=8, fetch_timeout=0.5
        )
        return asyncio.create_task(worker.run_until(stop))


def make_cfg(run: str, run_dir, bus=BUS, **learner) -> RunConfig:
    cfg = RunConfig(bus=bus, rollout=RolloutConfig(n=N), learner=LearnerConfig(ledger_flush_s=0.5, **learner))
    cfg.run.name, cfg.run.dir = run, str(run_dir)
    return cfg


def base_model(tmp_path):
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    # The learner reads vocab_size to refuse token ids outside the vocabulary (scored_for uses ids 1..4).
    (base / "config.json").write_text('{"vocab_size": 16}')
    return base


async def drive(js, nc, cfg, fate, *, resume=False, trainer=None, timeout=120.0, pad=0):
    """Run the Learner with the actor double until its step budget; returns (learner, actor)."""
    from parley.learner.service import Learner

    learner = Learner(
        cfg,
        js,
        nc,
        trainer or TrainerDouble(),
        model_dir=base_model(cfg.run_dir.parent),
        resume=resume,
        steps=cfg.learner.steps,
    )
    halt = asyncio.Event()
    actor = ActorDouble(js, cfg.run.name, fate, bus=cfg.bus, pad=pad)
    job = actor.start(halt)
    try:
        code = await asyncio.wait_for(learner.run(asyncio.Event()), timeout=timeout)
    finally:
        halt.set()
        await asyncio.gather(job, return_exceptions=True)
    assert code == 0
    return learner, actor


def not_trained(run_dir) -> dict[str, str]:
    out = {}
    for line in (run_dir / "trained.jsonl").read_text().splitlines():
        out |= json.loads(line)["not_trained"]
    return out


async def seventeen_then_answers(js, nc, run_dir, run: str, fate: str):
    """Two steps of 16 groups at max_staleness 1 (32 slots) whose first 17 tasks meet `fate`: unless
    their slots are freed, 15 groups can never fill a step and the run stops. The learner, its ledger
    and the 17 task ids."""
    cfg = make_cfg(run, run_dir, steps=2, groups_per_step=16, max_staleness=1)
    await topology.ensure_topology(js, run, BUS)
    learner, _ = await drive(js, nc, cfg, lambda i: fate if i < 17 else "answer")
    assert learner.state.step == 2
    return learner, read_state(run_dir), {f"{run}-g{i:06d}" for i in range(17)}


async def test_dead_lettered_tasks_free_their_slots(js, nc, tmp_path):
    # before the learner read DEAD, 17 dead tasks held 17 of the 32 slots for good
    run, run_dir = "fates", tmp_path / "run"
    learner, state, dead_ids = await seventeen_then_answers(js, nc, run_dir, run, "poison")
    assert {t: state.done[t] for t in dead_ids} == {t: "dead" for t in dead_ids}
    assert not dead_ids & set(state.in_flight)
    for t in dead_ids:
        assert state.reasons[t].startswith("dead: its Task was dead-lettered by actor-double (tasks): test double")
        assert not_trained(run_dir)[t] == state.reasons[t]
    assert learner.state.counters["groups.dead"] == 17
    assert state.dead_seq == 18  # every letter read, and the ledger says so


async def test_abandoned_samples_drop_their_groups_as_stale_and_free_their_slots(js, nc, tmp_path):
    # Samples their actor stopped carry no turn and no reward: the learner must neither dead-letter
    # them as bad trajectories nor hold their slots.
    run, run_dir = "abandon", tmp_path / "run"
    learner, state, gone = await seventeen_then_answers(js, nc, run_dir, run, "abandon")
    assert {t: state.done[t] for t in gone} == {t: "stale" for t in gone}
    assert all("was stopped by actor" in state.reasons[t] and "after 0 turn(s)" in state.reasons[t] for t in gone)
    assert learner.state.counters["groups.stale"] == 17 and learner.state.counters["groups.dead"] == 0
    assert (await js.stream_info(topology.stream_name(run, "dead"))).state.messages == 0


async def test_lost_tasks_are_given_up_at_their_deadline(js, nc, tmp_path):
    run, run_dir = "deadline", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=1, groups_per_step=4, max_staleness=0, group_timeout_s=1.0, task_deadline_s=2.0)
    await topology.ensure_topology(js, run, BUS)
    await drive(js, nc, cfg, lambda i: "lose" if i < 4 else "answer")

    state = read_state(run_dir)
    lost = [f"{run}-g{i:06d}" for i in range(4)]
    assert [state.done[t] for t in lost] == ["deadline"] * 4
    assert all(
        state.reasons[t].startswith("deadline: 0/2 samples ") and "task_deadline_s=2" in state.reasons[t] for t in lost
    )


async def test_resume_does_not_restore_a_stall(js, nc, tmp_path):
    """Tasks in flight when the learner stopped and dead-lettered while it was down are freed by the
    resumed learner (it reads DEAD from the ledger's position); the default deadline is far away."""
    from parley.learner.service import Learner

    run, run_dir = "stalled", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=1, groups_per_step=4, max_staleness=0)
    await topology.ensure_topology(js, run, BUS)
    first = Learner(cfg, js, nc, TrainerDouble(), model_dir=base_model(tmp_path), resume=False, steps=1)
    stop = asyncio.Event()
    job = asyncio.create_task(first.run(stop))
    while len(first.feeder.state.in_flight) < 4:  # no actor yet: the four issued tasks wait in TASKS
        await asyncio.sleep(0.1)
    stop.set()
    assert await asyncio.wait_for(job, 60) == 0
    assert len(read_state(run_dir).in_flight) == 4

    halt = asyncio.Event()
    refusing = ActorDouble(js, run, lambda i: "poison").start(halt)
    while (await js.stream_info(topology.stream_name(run, "dead"))).state.messages < 4:
        await asyncio.sleep(0.1)
    halt.set()
    await refusing

    learner, _ = await drive(js, nc, cfg, lambda i: "answer", resume=True)
    state = read_state(run_dir)
    assert learner.state.step == 1
    assert [state.done[f"{run}-g{i:06d}"] for i in range(4)] == ["dead"] * 4


async def test_admission_waits_for_the_announced_version(js, nc, tmp_path):
    # Before: Feeder.set_version(step) ran before the new weights were published, so tasks were
    # admitted "at v" while every actor still served v-1 (and, at the edge of the bound, dropped stale).
    run, run_dir = "announced", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=2, groups_per_step=2, max_staleness=0)
    await topology.ensure_topology(js, run, BUS)
    trainer = TrainerDouble(hold=1)

    async def check_while_held():
        await asyncio.to_thread(trainer.entered.wait, 60)
        try:
            return learner_box[0].feeder.version, learner_box[0].feeder.is_open()
        finally:
            trainer.release.set()

    from parley.learner.service import Learner

    learner_box = [Learner(cfg, js, nc, trainer, model_dir=base_model(tmp_path), resume=False, steps=2)]
    halt = asyncio.Event()
    actor = ActorDouble(js, run, lambda i: "answer")
    worker = actor.start(halt)
    try:
        held, code = await asyncio.wait_for(
            asyncio.gather(check_while_held(), learner_box[0].run(asyncio.Event())), timeout=120
        )
    finally:
        trainer.release.set()
        halt.set()
        await asyncio.gather(worker, return_exceptions=True)
    assert code == 0
    assert held == (0, False)  # step 1 trained, version 1 not yet announced: nothing admitted on it

    # Every task says the version it was admitted at, and the gate held for that version.
    tasks = []
    info = await js.stream_info(topology.stream_name(run, "tasks"))
    for seq in range(1, info.state.last_seq + 1):
        tasks.append(codec.decode("tasks", (await js.get_msg(topology.stream_name(run, "tasks"), seq)).data))
    for t in tasks:
        index = int(t.task_id.rsplit("-g", 1)[1])
        assert index < (t.admitted_version + 0 + 1) * 2
    assert {0, 1} <= {t.admitted_version for t in tasks} <= {0, 1, 2}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["admission_lag_hist"] for r in rows] == [{"0": 2}, {"0": 2}]


def test_a_resumed_deadline_does_not_count_the_time_the_learner_was_down(tmp_path):
    from parley.learner import checkpoint as ckpt
    from parley.learner.service import Learner

    run_dir = tmp_path / "run"
    cfg = make_cfg("down", run_dir, steps=1, groups_per_step=2, max_staleness=0)
    ckpt.write_state(
        run_dir,
        ckpt.LearnerState(
            in_flight=["down-g000000", "down-g000001"],
            next_index=2,
            issued=[ckpt.IssuedTask(task_id="down-g000000", at=0.0, version=0)],
        ),
    )
    state = ckpt.read_state(run_dir)
    state.saved -= 3 * 3600.0  # written at issue time + 1 s, then three hours down
    state.issued[0].at = state.saved - 1.0
    (ckpt.learner_dir(run_dir) / ckpt.STATE_FILE).write_bytes(msgspec.msgpack.encode(state))
    learner = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=True, steps=1)
    ages = dict(learner.feeder.overdue(-1e9))
    assert 0.5 < ages["down-g000000"] < 60  # 1 s of uptime (+ this test), not three hours
    assert ages["down-g000001"] < 60  # no issue record (an older ledger): counted from the resume
    assert learner.feeder.overdue(cfg.learner.task_deadline_s) == []


def test_only_a_real_sample_of_an_issued_task_gives_it_up(tmp_path):
    from parley.learner.feeder import Issued
    from parley.learner.service import Learner
    from parley.protocol.messages import DeadLetter

    cfg = make_cfg("one", tmp_path / "run", steps=1, groups_per_step=2, max_staleness=0)
    learner = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=False, steps=1)
    learner.feeder.state.in_flight["one-g000000"] = Issued(at=0.0, version=0)
    task = Task(task_id="one-g000000", run="one", item_id="i", n=N)

    def letter(sample: int) -> DeadLetter:
        s = scored_for(task, 0)
        s.sample = s.trajectory.sample = sample
        return DeadLetter(
            subject=topology.subject("one", "scored"), reason="refused", consumer="learner-x", payload=codec.encode(s)
        )

    learner.fates.on_dead(letter(7))  # outside 0..n-1: a bogus sample, not a lost one
    assert "one-g000000" in learner.feeder.state.in_flight
    learner.fates.on_dead(letter(1))
    assert "one-g000000" not in learner.feeder.state.in_flight
    assert learner.grouper.done["one-g000000"] == "dead"
    assert learner.state.reasons["one-g000000"] == "dead: sample 1 was dead-lettered by learner-x (scored): refused"


def test_a_resumed_group_timeout_does_not_count_the_time_the_learner_was_down(tmp_path):
    """A partial group buffered when the learner stopped, and the learner away longer than
    group_timeout_s: the group's age counts learner uptime, so it is not timed out on resume (its
    missing samples are waiting in SCORED). Before, first_seen came back as wall-clock time and the
    first loop pass dropped the group and acked its samples as late."""
    from parley.learner import checkpoint as ckpt
    from parley.learner.service import Learner

    run_dir = tmp_path / "run"
    cfg = make_cfg("away", run_dir, steps=1, groups_per_step=1, max_staleness=0, group_timeout_s=600.0)
    task = Task(task_id="away-g000000", run="away", item_id="item-0", n=N)
    saved = time.time() - 3 * 3600.0  # three hours down, far past the 600 s timeout
    ckpt.Ledger(run_dir).write(
        ckpt.LearnerState(
            in_flight=[task.task_id],
            next_index=1,
            groups=[ckpt.GroupState(task_id=task.task_id, first_seen=saved - 10.0, samples=[scored_for(task, 0)])],
        )
    )
    state = ckpt.read_state(run_dir)
    state.saved = saved
    (ckpt.learner_dir(run_dir) / ckpt.STATE_FILE).write_bytes(
        msgspec.msgpack.encode(
            msgspec.structs.replace(state, groups=[msgspec.structs.replace(g, samples=[]) for g in state.groups])
        )
    )
    learner = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=True, steps=1)
    assert task.task_id in learner.grouper.buffer
    assert learner.grouper.expire() == []  # 10 s of uptime, not three hours
    later = learner.grouper.expire(now=time.monotonic() + 600.0)
    assert [o.task_id for o in later] == [task.task_id]  # the timeout itself still works


async def test_a_resumed_learner_reads_its_backlog_before_it_times_groups_out(js, nc, tmp_path):
    """The rest of a buffered group is waiting in SCORED when the learner resumes, and the group is
    past its timeout by uptime: the learner reads the backlog before any timeout, so the group is
    trained, not dropped (the first loop pass used to expire it before the first fetch)."""
    from parley.learner import checkpoint as ckpt
    from parley.learner.service import Learner

    run_dir = tmp_path / "run"
    cfg = make_cfg("backlog", run_dir, steps=1, groups_per_step=1, max_staleness=0, group_timeout_s=1.0)
    await topology.ensure_topology(js, cfg.run.name, cfg.bus)
    task = Task(task_id="backlog-g000000", run="backlog", item_id="item-0", n=N)
    ckpt.Ledger(run_dir).write(
        ckpt.LearnerState(
            in_flight=[task.task_id],
            next_index=1,
            groups=[
                ckpt.GroupState(task_id=task.task_id, first_seen=time.time() - 30.0, samples=[scored_for(task, 0)])
            ],
        )
    )
    for i in range(1, N):  # the samples actors finished while the learner was away
        await publish(js, cfg.run.name, "scored", scored_for(task, i))
    learner = Learner(cfg, js, nc, TrainerDouble(), model_dir=base_model(tmp_path), resume=True, steps=1)
    code = await asyncio.wait_for(learner.run(asyncio.Event()), timeout=60)
    assert code == 0 and learner.state.step == 1
    # finished (under the ledger's watermark now: its kind is forgotten, a reason would be in the log)
    assert task.task_id in learner.grouper.done and learner.grouper.counters["trained"] == 1
    assert read_state(run_dir).reasons == {}, read_state(run_dir).reasons


def test_a_letter_read_before_its_task_is_in_flight_frees_the_task_once_it_is(tmp_path):
    """The feeder records a Task as in flight after publishing it, and a resumed feeder issues again
    what its ledger had not recorded: a letter about that Task can be read first. It is kept and
    applied when the task is issued (the slot is freed, not held for task_deadline_s), and the
    ledger's dead_seq stays at it until then, so a resume reads it again."""
    from parley.learner.feeder import Issued
    from parley.learner.service import Learner
    from parley.protocol.messages import DeadLetter

    cfg = make_cfg("early", tmp_path / "run", steps=1, groups_per_step=2, max_staleness=0)
    learner = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=False, steps=1)
    task = Task(task_id="early-g000000", run="early", item_id="i", n=N)
    dl = DeadLetter(
        subject=topology.subject("early", "tasks"),
        reason="poison: no such item",
        consumer="actor-x",
        payload=codec.encode(task),
    )
    learner.fates.take([(5, dl)], nxt=6)  # read while the task is not in flight yet
    assert learner.state.dead_seq == 5 and learner.fates.next_seq == 6
    learner.feeder.state.in_flight[task.task_id] = Issued(at=time.monotonic(), version=0)  # the feeder records it
    assert learner.fates.overdue() == []  # the loop's pass applies the kept letter
    assert task.task_id not in learner.feeder.state.in_flight
    assert learner.grouper.done[task.task_id] == "dead"
    assert (
        learner.state.reasons[task.task_id]
        == "dead: its Task was dead-lettered by actor-x (tasks): poison: no such item"
    )
    assert learner.state.dead_seq == 6 and learner.fates.early == {}
