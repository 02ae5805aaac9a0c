"""When the chaos kills the learner: by its progress, in whatever phase, so a learner that trains all
its steps before the kill phase is still killed once with steps left (on an idle machine the chaos
run's learner trained its 40 steps within the first 35 s, during the stall, and the kill phase began
at 491 s: 'a role was never killed: learner 0', 2026-12-07). Pure unit tests (no server, no model),
so they run in the default CI command."""

from __future__ import annotations

import random

from parley.protocol.messages import Heartbeat
from tests.faults.chaos import Chaos, Role, Schedule, learner_kill_due

STEPS, CHECKPOINT_EVERY = 40, 3


def test_the_learner_is_due_once_past_its_first_checkpoint_with_steps_left():
    due = [s for s in range(STEPS + 2) if learner_kill_due(s, 0, past_step=CHECKPOINT_EVERY, last_step=STEPS)]
    assert due == list(range(CHECKPOINT_EVERY + 1, STEPS))
    assert not learner_kill_due(None, 0, past_step=CHECKPOINT_EVERY, last_step=STEPS)  # no heartbeat yet
    assert not learner_kill_due(10, 1, past_step=CHECKPOINT_EVERY, last_step=STEPS)  # killed already


class FastLearner:
    """A cluster whose learner trains a step every `step_s` seconds of a simulated clock (`now`) and
    beats every 2 s; a kill takes it back to its last checkpoint, its new process beating again
    after `restart_s`."""

    def __init__(self, step_s: float = 35 / STEPS, restart_s: float = 20.0):
        self.sets = [f"learner.steps={STEPS}", f"learner.checkpoint_every={CHECKPOINT_EVERY}"]
        self.roles = {"learner": Role("learner", "learner", [], log=None)}
        self.step_s, self.restart_s = step_s, restart_s
        self.now = self.training_since = 0.0
        self.resumed_at = 0  # the step its current process resumed from
        self.events: list[str] = []

    def step_at(self, t: float) -> int:
        return min(STEPS, self.resumed_at + int(max(0.0, t - self.training_since) / self.step_s))

    def step(self) -> int:
        return self.step_at(self.now)

    def beat(self, name: str) -> Heartbeat | None:
        if self.now < self.training_since:
            return None  # the restarted process has not beaten yet
        last = self.now - (self.now - self.training_since) % 2.0
        return Heartbeat(role="learner", id="host-1", state="busy", version=self.step_at(last))

    def is_up(self, name: str) -> bool:
        return self.beat(name) is not None and self.step() < STEPS

    def kill(self, name: str) -> None:
        self.resumed_at = self.step() // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        self.training_since = self.now + self.restart_s
        self.roles[name].kills += 1

    def restart(self, name: str) -> None:
        self.roles[name].starts += 1

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
