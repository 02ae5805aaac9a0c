"""evaluation.fleet.play_condition_fleet with real child processes and a real nats-server: a role of the
condition's fleet that fails after it came ready (its heartbeat said so) is started again under the run
config's [up] restarts, as `parley up` starts its actors and scorers again, and the condition goes on; a
failure the policy does not start again (exit 2, a role holding a call budget) ends the condition with
FleetError naming the reason. Before, any failure of a fleet role ended the condition. The roles are
test doubles (fleet_role_double.py) that only send heartbeats; the test publishes the work they would
have done."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from parley.config.run import RunConfig
from parley.evaluation.fleet import FleetError, FleetSettings, condition_run, play_condition_fleet
from parley.evaluation.runner import Condition
from parley.protocol import codec, topology
from parley.protocol.bus import publish
from parley.protocol.messages import DeadLetter, Task
from parley.runtime.supervisor import Supervisor
from tests import factories

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DOUBLE = Path(__file__).with_name("fleet_role_double.py")
COND = Condition(name="base", model="model-of-base")


def fleet_of_doubles(monkeypatch, url: str, run: str, **fails: list[str]) -> None:
    """The fleet starts fleet_role_double.py in place of `parley actor` / `parley scorer`, with the same
    role and id; `fails[role]` = [marker, exit code] makes that role fail once after it came ready."""

    def argv(self, role: str, *args: str) -> list[str]:
        ident = args[args.index("--id") + 1]
        return [sys.executable, str(DOUBLE), url, run, role, ident, *fails.get(role, [])]

    monkeypatch.setattr(Supervisor, "parley_argv", argv)


def setup(tmp_path: Path, url: str) -> tuple[RunConfig, list[Task], FleetSettings]:
    cfg = RunConfig()
    cfg.run.name = "fleetrs"
    cfg.nats.url = url
    tasks = [Task(task_id=f"t{i}", run=cfg.run.name, item_id=f"item{i}", n=1, seed=i) for i in range(3)]
    fs = FleetSettings(config_path=tmp_path / "config.toml", logs_dir=tmp_path / "fleet", progress_s=60.0)
    return cfg, tasks, fs


async def until(what, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


async def test_a_role_that_fails_after_it_came_ready_is_started_again_and_the_condition_ends(
    tmp_path, nats_server, nc, js, monkeypatch
):
    cfg, tasks, fs = setup(tmp_path, nats_server.url)
    run = condition_run(cfg.run.name, COND.name)
    fleet_of_doubles(monkeypatch, nats_server.url, run, actor=[str(tmp_path / "marker"), "4"])
    play = asyncio.create_task(play_condition_fleet(nc, js, cfg, COND, tasks, fs, asyncio.Event()))
    log = fs.logs_dir / "logs" / "actor-base.log"
    again = "--- parley up: actor-base exited with code 4; started again ---"
    await until(lambda: play.done() or "running" in text(log).partition(again)[2])
    assert not play.done(), play.exception()  # before: FleetError at the actor's exit

    # The roles' work: each task's Scored, task 0's twice (its task redelivered and played again by the
    # actor started again: another trajectory), and task 1 also dead-lettered by the actor that failed
    # (after its trajectory went out). Each task counts once, and only once all three are scored does the
    # condition end.
    def scored(task: Task, traj_id: str = ""):
        traj = factories.trajectory(run, task.task_id, traj_id=traj_id or f"{task.task_id}-0")
        return factories.scored(traj, {"bleu": 0.5})

    letter = DeadLetter(
        subject=topology.subject(run, "tasks"),
        reason="delivered 6 times (max_deliver=5)",
        consumer="actor",
        payload=codec.encode(tasks[1]),
    )
    await publish(js, run, "dead", letter)
    for msg in (scored(tasks[0]), scored(tasks[0], "t0-again"), scored(tasks[1])):
        await publish(js, run, "scored", msg)
    await asyncio.sleep(2.5)  # a pass of the condition's loop, which reads the dead letters
    assert not play.done(), play.result()  # task 2 not scored yet
    await publish(js, run, "scored", scored(tasks[2]))
    records, lost = await asyncio.wait_for(play, 30)
    assert [r.item_id for r in records] == ["item0", "item1", "item2"] and lost == []
    assert text(log).count(again) == 1, text(log)


@pytest.mark.parametrize(
    ("code", "budget", "why"),
    [
        ("2", 0, "exit code 2 is a config error, which a restart meets again"),
        ("4", 40, "[rollout] sim_call_budget = 40 is set, and each actor started again would spend a fresh share"),
    ],
)
async def test_a_failure_the_policy_does_not_start_again_ends_the_condition_naming_why(
    tmp_path, nats_server, nc, js, monkeypatch, code, budget, why
):
    cfg, tasks, fs = setup(tmp_path, nats_server.url)
    cfg.rollout.sim_call_budget = budget
    run = condition_run(cfg.run.name, COND.name)
    fleet_of_doubles(monkeypatch, nats_server.url, run, actor=[str(tmp_path / "marker"), code])
    with pytest.raises(FleetError) as e:
        await asyncio.wait_for(play_condition_fleet(nc, js, cfg, COND, tasks, fs, asyncio.Event()), 30)
    message = str(e.value)
    assert message.startswith(f"actor-base of condition base exited {code} (not started again: {why}"), message
    assert f"exiting with code {code}" in message  # its last log lines
    assert "started again ---" not in text(fs.logs_dir / "logs" / "actor-base.log")


async def test_a_role_that_cannot_start_leaves_no_process_and_no_subscription_behind(
    tmp_path, nats_server, nc, js, monkeypatch
):
    """The scorer's start raises after the actor's has begun: the actor is stopped and the heartbeat
    subscription closed (before, both were made outside the condition's try and outlived it)."""
    cfg, tasks, fs = setup(tmp_path, nats_server.url)
    run = condition_run(cfg.run.name, COND.name)
    fleet_of_doubles(monkeypatch, nats_server.url, run)
    started: list[Supervisor] = []
    real_start = Supervisor.start

    def start(self, name, argv, env=None, config_text=None, **kw):
        if name.startswith("scorer"):
            raise OSError(f"cannot start {name} (test double)")
        started.append(self)
        return real_start(self, name, argv, env, config_text, **kw)

    monkeypatch.setattr(Supervisor, "start", start)
    with pytest.raises(OSError, match="cannot start scorer-base"):
        await asyncio.wait_for(play_condition_fleet(nc, js, cfg, COND, tasks, fs, asyncio.Event()), 30)
    (sup,) = started
    assert [c.alive for c in sup.children] == [False]  # the actor double did not outlive the condition
    beat_subject = topology.status_subject(run, "*", "*")
    assert beat_subject not in [sub.subject for sub in nc._subs.values()]  # the heartbeat subscription is closed
