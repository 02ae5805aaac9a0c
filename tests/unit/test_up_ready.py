"""deploy.up._wait_ready: `parley up` says when each child came ready (its start-up, the most of a run's
start on one GPU) and how long the wait took, and returns False at once when a child fails."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

from parley.deploy import up


class SupervisorDouble:
    """Test double: the children `parley up` started, none of them failing unless told."""

    def __init__(self, names, failed=None):
        self.children = [SimpleNamespace(name=n) for n in names]
        self._failed = failed or []

    def check(self, say=print, ready=None):
        return self._failed


def beat(name: str, state: str = "ready"):
    role = name.split("-")[0]
    return SimpleNamespace(id=name, role=role, state=state, created=0.0)


async def test_each_child_is_reported_as_it_comes_ready_then_the_whole_wait(capsys):
    sup = SupervisorDouble(["actor-0", "learner", "scorer-0"])
    watcher = SimpleNamespace(snap=SimpleNamespace(roles={}))

    async def heartbeats():
        await asyncio.sleep(0.05)
        watcher.snap.roles["scorer-0"] = beat("scorer-0")
        watcher.snap.roles["actor-0"] = beat("actor-0", "starting")
        await asyncio.sleep(0.1)
        watcher.snap.roles["learner"] = beat("learner", "busy")
        watcher.snap.roles["actor-0"] = beat("actor-0")

    task = asyncio.create_task(heartbeats())
    assert await up._wait_ready(sup, watcher, asyncio.Event(), timeout=5.0, poll_s=0.01)
    await task
    lines = capsys.readouterr().out.splitlines()
    ready = [line for line in lines if line.startswith("ready after ")]
    # each ends with the seconds since the command started (deploy.common.stamped)
    assert all(re.search(r" \[\+[0-9]+\.[0-9] s\]$", line) for line in ready), lines
    assert [line.split(": ", 1)[1].rsplit(" [+", 1)[0] for line in ready] == ["scorer-0", "actor-0, learner"], lines
    first, second = (float(line.split()[2]) for line in ready)
    assert 0.04 <= first < second and second >= 0.14, lines
    assert lines[-1].startswith("all roles ready in ") and float(lines[-1].split()[4]) >= second, lines
    assert lines[0] == "waiting for: actor-0, learner, scorer-0", lines


async def test_a_failed_child_ends_the_wait_at_once(capsys):
    sup = SupervisorDouble(["actor-0", "learner"], failed=["actor-0"])
    watcher = SimpleNamespace(snap=SimpleNamespace(roles={}))
    assert not await asyncio.wait_for(up._wait_ready(sup, watcher, asyncio.Event(), timeout=60.0), 1.0)
    assert "all roles ready" not in capsys.readouterr().out


def test_the_progress_line_counts_the_actors_preempted_requests():
    from parley.deploy.live import Snapshot
    from parley.protocol.messages import Heartbeat

    def snap(*preempted):
        roles = {
            f"actor/actor-{i}": Heartbeat(
                role="actor", id=f"actor-{i}", state="busy", counters={"engine.preemptions": float(n)}
            )
            for i, n in enumerate(preempted)
        }
        roles["learner/learner"] = Heartbeat(role="learner", id="learner", state="busy", counters={"step": 3.0})
        return Snapshot(roles=roles)

    assert "preempted" not in up.progress_line(snap(0, 0))  # KV sized to the demand: nothing said
    assert "| preempted 7" in up.progress_line(snap(3, 4))  # summed over the actors


def test_after_the_learner_was_started_again_its_new_heartbeats_count_not_the_last_of_the_one_before():
    """The learner's id is host-pid, so the live view keeps the dead learner's last heartbeat under
    another key beside the new one's: the progress line (step, version, eval bookkeeping) and the ready
    map take the latest. Before, the progress line showed the dead learner's step for the rest of the run."""
    from parley.deploy.live import Snapshot
    from parley.protocol.messages import Heartbeat

    before = Heartbeat(
        role="learner", id="h-100", state="ready", version=7, counters={"step": 7.0, "eval.queued": 2.0}, created=10.0
    )
    again = Heartbeat(
        role="learner", id="h-200", state="busy", version=5, counters={"step": 5.0, "eval.queued": 0.0}, created=20.0
    )
    snap = Snapshot(roles={"learner/h-100": before, "learner/h-200": again})
    line = up.progress_line(snap)
    assert line.startswith("step 5 | version 5 |") and "eval idle, 0 queued" in line, line
    assert up.ready_since(snap.roles.values())["learner"] == 20.0
    snap.roles["learner/h-200"] = Heartbeat(role="learner", id="h-200", state="starting", created=21.0)
    assert up.ready_since(snap.roles.values())["learner"] == 10.0  # from before its start: check() ignores it


def test_the_live_view_lists_only_the_latest_learner():
    """After the learner was started again the view's roles table shows the new learner alone. Before,
    the dead one's last heartbeat stayed beside it as a "lost" row for the rest of the run."""
    import time

    from rich.console import Console

    from parley.deploy.live import Snapshot, render
    from parley.protocol.messages import Heartbeat

    now = time.time()
    snap = Snapshot(
        roles={
            "actor/actor-0": Heartbeat(role="actor", id="actor-0", state="busy", created=now),
            "learner/h-100": Heartbeat(role="learner", id="h-100", state="busy", created=now - 60),
            "learner/h-200": Heartbeat(role="learner", id="h-200", state="busy", created=now),
        }
    )
    console = Console(width=200, record=True)
    console.print(render(snap, "unit").renderables[0])
    table = console.export_text()
    assert "h-200" in table and "actor-0" in table
    assert "h-100" not in table and "lost" not in table, table
