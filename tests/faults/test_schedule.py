"""When the chaos kills the learner: by its progress, in whatever phase, so a learner that trains all
its steps before the kill phase is still killed once with steps left (on an idle machine the chaos
run's learner trained its 40 steps within the first 35 s, during the stall, and the kill phase began
at 491 s: 'a role was never killed: learner 0', 2026-12-07). How a learner with no last step
(learner.steps = 0, so it issues work through every phase) is given one when the schedule ends
(Chaos.end_learner), and that the stall and the simulator outage begin on fresh state (holds_work,
Cluster.beat). Pure unit tests (no server, no model), so they run in the default CI command."""

from __future__ import annotations

import random
import time

from parley.config.run import load_config
from parley.protocol.messages import Heartbeat
from tests.faults.chaos import Chaos, Cluster, Role, Schedule, holds_work, learner_kill_due

STEPS, CHECKPOINT_EVERY = 40, 3


def test_the_learner_is_due_once_past_its_first_checkpoint_with_steps_left():
    due = [s for s in range(STEPS + 2) if learner_kill_due(s, 0, past_step=CHECKPOINT_EVERY, last_step=STEPS)]
    assert due == list(range(CHECKPOINT_EVERY + 1, STEPS))
    assert not learner_kill_due(None, 0, past_step=CHECKPOINT_EVERY, last_step=STEPS)  # no heartbeat yet
    assert not learner_kill_due(10, 1, past_step=CHECKPOINT_EVERY, last_step=STEPS)  # killed already


def test_a_learner_with_no_last_step_is_due_once_past_its_first_checkpoint():
    due = [s for s in range(1000) if learner_kill_due(s, 0, past_step=CHECKPOINT_EVERY, last_step=0)]
    assert due == list(range(CHECKPOINT_EVERY + 1, 1000))
    assert not learner_kill_due(500, 1, past_step=CHECKPOINT_EVERY, last_step=0)


def test_work_is_held_only_by_fresh_heartbeats_and_the_servers_unacked_tasks():
    assert holds_work({"actor-0": 9.0, "actor-1": 0.0}, tasks_ack_pending=4)
    # what the idle run of 2026-12-07 began the simulator outage on: the stalled actor's last heartbeat
    assert not holds_work({"actor-0": 18.0, "actor-1": 0.0}, tasks_ack_pending=0)
    assert not holds_work({"actor-0": None, "actor-1": 3.0}, tasks_ack_pending=4)  # actor-0: no beat since its SIGCONT
    assert not holds_work({"actor-0": 0.0, "actor-1": 0.0}, tasks_ack_pending=4)


def test_a_stopped_actors_last_heartbeat_is_not_its_state_after_it_is_resumed(tmp_path, monkeypatch):
    import tests.faults.chaos as chaos

    monkeypatch.setattr(chaos, "_signal_group", lambda proc, sig: None)  # no process: the bookkeeping only
    c = Cluster(tmp_path, "model", run="r", sets=[])
    c.add("actor-0", "actor", [])
    now = time.time()
    c.roles["actor-0"].started = now - 10
    busy = Heartbeat(role="actor", id="actor-0", state="busy", counters={"in_flight": 18.0}, created=now - 1)
    c.on_beat(busy)
    assert c.beat("actor-0") is busy
    c.stall("actor-0")
    c.resume("actor-0")
    assert c.beat("actor-0") is None  # its last heartbeat (18 in flight) is from before the stop
    fresh = Heartbeat(role="actor", id="actor-0", state="ready", counters={"in_flight": 0.0}, created=time.time())
    c.on_beat(fresh)
    assert c.beat("actor-0") is fresh


class FastLearner:
    """A cluster whose learner trains a step every `step_s` seconds of a simulated clock (`now`) and
    beats every 2 s; a kill takes it back to its last checkpoint, its new process beating again
    after `restart_s`."""

    def __init__(self, step_s: float = 35 / STEPS, restart_s: float = 20.0, steps: int = STEPS):
        self.sets = [f"learner.steps={steps}", f"learner.checkpoint_every={CHECKPOINT_EVERY}"]
        self.cfg = load_config(None, self.sets)
        self.roles = {"learner": Role("learner", "learner", [], log=None)}
        self.steps = steps  # its last step; 0: none
        self.step_s, self.restart_s = step_s, restart_s
        self.now = self.training_since = 0.0
        self.resumed_at = 0  # the step its current process resumed from
        self.events: list[str] = []

    def step_at(self, t: float) -> int:
        trained = self.resumed_at + int(max(0.0, t - self.training_since) / self.step_s)
        return min(self.steps, trained) if self.steps else trained

    def step(self) -> int:
        return self.step_at(self.now)

    def beat(self, name: str) -> Heartbeat | None:
        if self.now < self.training_since:
            return None  # the restarted process has not beaten yet
        last = self.now - (self.now - self.training_since) % 2.0
        return Heartbeat(role="learner", id="host-1", state="busy", version=self.step_at(last))

    def is_up(self, name: str) -> bool:
        return self.beat(name) is not None and not (self.steps and self.step() >= self.steps)

    def kill(self, name: str, *, count: bool = True) -> None:
        self.resumed_at = self.checkpointed_step()
        self.training_since = self.now + self.restart_s
        self.roles[name].kills += count

    def checkpointed_step(self) -> int:
        return self.step() // CHECKPOINT_EVERY * CHECKPOINT_EVERY

    def restart(self, name: str) -> None:
        self.roles[name].starts += 1
        for s in self.roles[name].sets:  # what the restarted process is started with after the run's sets
            if s.startswith("learner.steps="):
                self.steps = int(s.split("=", 1)[1])

    def note(self, t0: float, text: str) -> None:
        self.events.append(f"{self.now - t0:.1f}s {text}")


async def test_a_learner_that_trains_all_its_steps_during_the_stall_is_killed_with_steps_left():
    cluster = FastLearner()
    chaos = Chaos(cluster, js=None, rng=random.Random(8), schedule=Schedule(ack_wait_s=8.0))
    chaos.stall["state"] = "stalled"  # the stall phase: the kills of the schedule wait for its end (101 s then)
    assert chaos.phase == "stall"
    while cluster.step() < STEPS and cluster.now < 200:
        await chaos._learner_progress()
        cluster.now += 0.5
    assert cluster.roles["learner"].kills == 1, cluster.events
    assert CHECKPOINT_EVERY < chaos.learner_steps_at_kills[0] < STEPS, chaos.learner_steps_at_kills
    assert chaos.by_phase == {"stall": 1} and cluster.step() == STEPS, cluster.events


async def test_a_learner_with_no_last_step_trains_through_the_schedule_and_is_given_one_after_it():
    # the idle machine's pace (40 steps in 35 s), with no last step: still training when the schedule ends
    cluster = FastLearner(steps=0)
    schedule = Schedule(ack_wait_s=8.0)
    chaos = Chaos(cluster, js=None, rng=random.Random(8), schedule=schedule)
    chaos.stall["state"] = "stalled"
    while cluster.now < 600:  # the schedule's 10 minutes
        await chaos._learner_progress()
        cluster.now += 0.5
    learner = cluster.roles["learner"]
    assert learner.kills == 1 and chaos.learner_steps_at_kills[0] > CHECKPOINT_EVERY, cluster.events
    assert cluster.is_up("learner") and cluster.step() > STEPS, cluster.step()  # issuing work at the end still
    at_kill, starts = cluster.step(), learner.starts
    last = chaos.end_learner()
    checkpointed = at_kill // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert last == checkpointed + schedule.steps_after and cluster.steps == last
    assert learner.kills == 1 and learner.starts == starts + 1  # not one of the chaos's kills; restarted
    assert learner.sets == [f"learner.steps={last}"]  # its every later start too
    assert chaos.learner_end == {"step_at_kill": at_kill, "checkpointed_step": checkpointed, "last_step": last}
    cluster.now += 100
    assert cluster.step() == last and not cluster.is_up("learner")  # it stops there by itself


async def test_a_learner_with_a_last_step_keeps_it():
    cluster = FastLearner()
    chaos = Chaos(cluster, js=None, rng=random.Random(8), schedule=Schedule(ack_wait_s=8.0))
    assert chaos.end_learner() == STEPS and cluster.roles["learner"].starts == 0 and chaos.learner_end == {}
