"""The learner trains only samples of tasks it issued: a Scored of a task that is not in flight
(never issued by this learner, or of another run) is refused at the intake and dead-lettered with
the reason, counted as scored.foreign, and never trained; [learner] accept_foreign_scored lets them
in. The real Learner (feeder, SCORED consumer, DEAD reader, ledger) on a real nats-server, with the
test-double trainer and actor of test_learner_fates; the forger publishes into SCORED directly."""

from __future__ import annotations

import pytest

from parley.learner.checkpoint import read_state
from parley.learner.intake import FOREIGN
from parley.protocol import dead, topology
from parley.protocol.bus import publish
from parley.protocol.messages import Task
from parley.runtime.metrics import family_of
from tests.integration.test_learner_fates import BUS, N, drive, make_cfg, not_trained, scored_for

pytestmark = [pytest.mark.integration]


async def forge(js, run: str, task_id: str) -> None:
    """What a role that can write into SCORED could publish: a valid, trainable group (under trajectory
    ids of its own: the honest ones' would take their Nats-Msg-Ids, and the store would drop the
    honest samples as duplicates, a denial the privilege tables stop, not this check)."""
    task = Task(task_id=task_id, run=run, item_id="item-0", n=N)
    for i in range(N):
        s = scored_for(task, i)
        s.traj_id = s.trajectory.traj_id = f"{task_id}/forged-{i}"
        await publish(js, run, "scored", s)


async def test_scored_of_tasks_not_in_flight_are_dead_lettered_not_trained(js, nc, tmp_path):
    """Forged groups wait in SCORED before the learner starts: one of a task id the feeder issues only
    after the first step (forge-g000001), one of a task it never issues. Before, both were buffered
    and trained (the step of one group took a forged one); now both are refused and dead-lettered,
    and the real forge-g000001, issued later, is trained, not given up because of the forged letter."""
    run, run_dir = "forge", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=2, groups_per_step=1, max_staleness=0)
    await topology.ensure_topology(js, run, BUS)
    await forge(js, run, "forge-g000001")
    await forge(js, run, "forge-x")
    learner, _ = await drive(js, nc, cfg, lambda i: "answer")

    assert learner.state.step == 2
    assert learner.heartbeat().counters["scored.foreign"] == 2 * N
    family, labels = family_of("learner", "scored.foreign")  # as /metrics shows it
    assert (family.name, labels) == ("parley_learner_scored_total", {"result": "foreign"})
    assert "forge-x" not in learner.grouper.done and "forge-x" not in learner.grouper.buffer
    assert not_trained(run_dir) == {}  # forge-g000001 (issued after step 1) was trained, not dropped as dead
    assert learner.state.counters["groups.dead"] == 0
    letters, nxt = await dead.read_since(js, run, 1)
    reasons = sorted(dl.reason for _, dl in letters)
    assert len(reasons) == 2 * N and all(r.startswith(FOREIGN) for r in reasons)
    assert "'forge-x' was not issued by this learner" in reasons[-1]
    assert "accept_foreign_scored" in reasons[-1]
    # Read (again) by the learner's DEAD watcher: ignored, none kept to give up a task issued later
    learner.fates.take(letters, nxt)
    assert learner.fates.early == {} and learner.state.dead_seq == nxt == 2 * N + 1
    assert read_state(run_dir).step == 2


async def test_accept_foreign_scored_lets_them_in(js, nc, tmp_path):
    run, run_dir = "open", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=1, groups_per_step=2, max_staleness=0, accept_foreign_scored=True)
    await topology.ensure_topology(js, run, BUS)
    await forge(js, run, "open-x")
    learner, _ = await drive(js, nc, cfg, lambda i: "answer")

    assert learner.state.step == 1
    assert learner.state.counters["scored.foreign_accepted"] == N
    assert learner.grouper.done["open-x"] == "trained"
    assert (await dead.read_since(js, run, 1))[0] == []
