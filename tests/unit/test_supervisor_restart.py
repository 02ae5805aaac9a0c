"""runtime.supervisor.RestartPolicy with real child processes: `parley up` starts a failed actor,
scorer or services child again (bounded, with a backoff), kills what the dead child left in its
process group first, starts a learner that failed after it came ready again with --resume once the run
directory holds its ledger, and stops the run for a learner with nothing to resume from, a config error
(exit 2) or one restart too many. Before it, any child's failure stopped the whole run; before the
learner's restart, the learner's failure always did."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import msgspec
import pytest

from parley.runtime.supervisor import Child, RestartPolicy, Supervisor

FAST = dict(backoff_s=0.05, window_s=60.0)


def fails_once(marker: Path, code: int = 4) -> list[str]:
    """A child that exits `code` at its first start (no marker yet) and runs for a minute after."""
    script = (
        "import pathlib, sys, time\n"
        f"m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists():\n"
        "    m.write_text('x'); print('first start: failing', flush=True); sys.exit(" + str(code) + ")\n"
        "print('second start: running', flush=True); time.sleep(60)\n"
    )
    return [sys.executable, "-c", script]


def always_fails(code: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({code})"]


def settle(sup: Supervisor, lines: list[str], seconds: float = 5.0, until=lambda: False, ready=True):
    """check() every 20 ms until it returns a child, `until()` holds, or `seconds` pass; with `ready`
    every child's heartbeat says ready now (each came ready once started), else none ever did."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        said = {c.name: time.time() for c in sup.children} if ready else {}
        if (failed := sup.check(lines.append, said)) is not None:
            return failed
        if until():
            return None
        time.sleep(0.02)
    return None


def test_a_failed_actor_is_started_again_with_its_log_continued(tmp_path):
    sup = Supervisor(tmp_path, RestartPolicy(limit=3, **FAST))
    child = sup.start("actor-0", fails_once(tmp_path / "marker"))
    first = child.proc.pid
    lines: list[str] = []
    try:
        assert settle(sup, lines, until=lambda: child.proc.pid != first and child.alive) is None
        assert child.alive and child.proc.pid != first, lines
        assert len(child.restarts) == 1
        assert lines[0].startswith("actor-0 exited with code 4; starting it again in 0.1 s (1 of at most 3"), lines
        assert "first start: failing" in lines[0]  # the dead child's last log lines are shown
        assert lines[-1] == f"started actor-0 again: pid {child.proc.pid}"
        deadline = time.monotonic() + 5
        while "second start" not in child.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        log = child.log_path.read_text()
        assert log.index("first start") < log.index("started again ---") < log.index("second start: running"), log
        assert sup.check(lines.append, {"actor-0": time.time()}) is None  # running: nothing more to do
    finally:
        sup.stop_all(timeout=5)


@pytest.mark.parametrize("name", ["scorer-0", "services"])
def test_scorers_and_services_are_started_again_too(tmp_path, name):
    sup = Supervisor(tmp_path, RestartPolicy(limit=1, **FAST))
    child = sup.start(name, fails_once(tmp_path / "marker", code=1))
    try:
        assert settle(sup, [], until=lambda: bool(child.restarts) and child.alive) is None
        assert len(child.restarts) == 1 and child.alive
    finally:
        sup.stop_all(timeout=5)


def test_one_restart_too_many_in_the_window_stops_the_run(tmp_path):
    sup = Supervisor(tmp_path, RestartPolicy(limit=2, **FAST))
    child = sup.start("actor-1", always_fails(3))
    lines: list[str] = []
    failed = settle(sup, lines)
    assert failed is child and len(child.restarts) == 2, lines
    assert child.why_not == "started again 2 times in the last 60 s ([up] restarts = 2)"


def test_the_backoff_doubles_with_each_restart_in_the_window_up_to_30_s(tmp_path):
    policy = RestartPolicy(limit=10, window_s=60.0, backoff_s=1.0)
    child = Child("actor-0", [], tmp_path / "actor-0.log", came_ready=True)
    now = time.monotonic()
    waits = []
    for _ in range(7):
        waits.append(policy.backoff(child, now))
        child.restarts.append(now)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert policy.backoff(child, now + 61.0) == 1.0  # the window has forgotten them


def test_restarts_older_than_the_window_are_forgotten(tmp_path):
    policy = RestartPolicy(limit=1, window_s=0.3, backoff_s=0.01)
    child = Child("actor-0", [], tmp_path / "actor-0.log", came_ready=True)
    child.restarts = [time.monotonic() - 1.0]  # one restart, long before the window
    assert policy.why_not(child, time.monotonic()) is None
    child.restarts.append(time.monotonic())
    assert policy.why_not(child, time.monotonic()) is not None


@pytest.mark.parametrize(
    ("name", "code", "why"),
    [
        ("learner", 1, "learner is not restarted"),
        ("actor-0", 2, "exit code 2 is a config error, which a restart meets again"),
    ],
)
def test_the_learner_and_a_config_error_stop_the_run_at_once(tmp_path, name, code, why):
    sup = Supervisor(tmp_path, RestartPolicy(limit=3, **FAST))
    child = sup.start(name, always_fails(code))
    lines: list[str] = []
    assert settle(sup, lines) is child
    assert child.why_not == why and not child.restarts and not lines


@pytest.mark.parametrize(("code", "again"), [(1, False), (4, False), (3, True)])
def test_a_child_that_fails_before_it_came_ready_is_started_again_only_when_its_exit_says_transient(
    tmp_path, code, again
):
    """A start-up failure (a model, a memory plan, a GPU) meets the next start the same way, and each
    engine start costs a minute: the run stops at once. Exit 3 (Unavailable: NATS or a service not up
    yet) may pass at the next start."""
    sup = Supervisor(tmp_path, RestartPolicy(limit=3, **FAST))
    child = sup.start("actor-0", fails_once(tmp_path / "marker", code=code))
    try:
        failed = settle(sup, [], ready=False, until=lambda: bool(child.restarts) and child.alive)
        if again:
            assert failed is None and len(child.restarts) == 1
        else:
            assert failed is child and not child.restarts
            assert child.why_not.startswith("it failed before it came ready"), child.why_not
    finally:
        sup.stop_all(timeout=5)


def test_a_heartbeat_from_before_the_latest_start_does_not_count_as_ready(tmp_path):
    """The live view keeps the dead process's last heartbeat: it must not make the new one's
    start-up failure look like a failure after ready."""
    sup = Supervisor(tmp_path, RestartPolicy(limit=3, **FAST))
    child = sup.start("actor-0", always_fails(4))
    stale = time.time() - 1.0  # sent before this start
    deadline = time.monotonic() + 5
    while (failed := sup.check([].append, {"actor-0": stale})) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert failed is child and not child.restarts and not child.came_ready


@pytest.mark.parametrize("came_ready", [True, False])
def test_without_a_policy_nothing_starts_again(tmp_path, came_ready):
    """The reason names the setting, whatever else would also hold the child back."""
    sup = Supervisor(tmp_path)  # what `parley eval`'s fleet and the tests' supervisors use
    child = sup.start("actor-0", always_fails(4))
    assert settle(sup, [], ready=came_ready) is child
    assert child.why_not == "[up] restarts = 0" and not child.restarts


def test_what_the_dead_child_left_in_its_process_group_is_killed_before_it_starts_again(tmp_path):
    """An actor that dies leaves its vLLM engine core (a grandchild in its process group, holding the
    GPU's memory): the new actor's engine must not start beside it."""
    pidfile = tmp_path / "grandchild.pid"
    marker = tmp_path / "marker"
    script = (
        "import pathlib, subprocess, sys, time\n"
        f"m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists():\n"
        "    m.write_text('x')\n"
        "    p = subprocess.Popen(['sleep', '300'])\n"
        f"    pathlib.Path({str(pidfile)!r}).write_text(str(p.pid))\n"
        "    sys.exit(4)\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path, RestartPolicy(limit=1, **FAST))
    child = sup.start("actor-0", [sys.executable, "-c", script])
    try:
        assert settle(sup, [], until=lambda: bool(child.restarts)) is None
        grandchild = int(pidfile.read_text())
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(grandchild)
    finally:
        sup.stop_all(timeout=5)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie (killed, not yet reaped by init) is gone
    except FileNotFoundError:
        return False


async def test_parley_ups_main_loop_runs_on_through_an_actors_failure(tmp_path, capsys):
    """deploy.up._until_done with real children: actor-0 fails once, the learner ends its run (exit 0)
    later. Before the restart policy the loop returned 1 at the actor's exit."""
    from parley.deploy import up
    from parley.deploy.live import Snapshot
    from parley.protocol.messages import Heartbeat

    class WatcherDouble:
        """Test double: the live view, in which actor-0's heartbeat says ready, sent now."""

        @property
        def snap(self):
            beat = Heartbeat(role="actor", id="actor-0", state="ready", created=time.time())
            return Snapshot(roles={"actor/actor-0": beat})

        async def poll(self):
            return self.snap

    sup = Supervisor(tmp_path, RestartPolicy(limit=3, **FAST))
    actor = sup.start("actor-0", fails_once(tmp_path / "marker"))
    sup.start("learner", [sys.executable, "-c", "import time; time.sleep(2.5)"])
    try:
        code = await asyncio.wait_for(up._until_done(sup, asyncio.Event(), WatcherDouble(), quiet=True), 20)
    finally:
        sup.stop_all(timeout=5)
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(actor.restarts) == 1
    assert "actor-0 exited with code 4; starting it again" in out and "started actor-0 again" in out, out


def test_up_takes_the_policy_from_its_config_section():
    from parley.config.run import RunConfig, UpSection

    up = RunConfig().up
    assert (up.restarts, up.restart_window_s) == (3, 600.0)
    with pytest.raises(msgspec.ValidationError, match="restarts"):
        msgspec.convert({"restarts": -1}, UpSection)


def test_a_role_holding_a_share_of_a_call_budget_is_not_started_again():
    """Each actor holds a share of [rollout] sim_call_budget from its start, each scorer of
    judge_call_budget: one started again would spend a fresh share, past the run's budget."""
    from parley.config.run import RunConfig
    from parley.deploy.up import restart_policy

    cfg = RunConfig()
    assert restart_policy(cfg).roles == {"actor", "scorer", "services", "learner"}
    cfg.rollout.sim_call_budget = 500
    policy = restart_policy(cfg)
    assert policy.roles == {"scorer", "services", "learner"} and policy.limit == 3
    why = policy.why_not(Child("actor-0", [], Path("actor-0.log")), time.monotonic())
    assert why == "[rollout] sim_call_budget = 500 is set, and each actor started again would spend a fresh share of it"
    cfg.rollout.judge_call_budget = 80
    assert restart_policy(cfg).roles == {"services", "learner"}


def learner_double(argv_log: Path, marker: Path) -> list[str]:
    """Test double for `parley learner`: appends its arguments to `argv_log` at each start; its first
    start exits 4 (a crash after it came ready), a start with --resume runs 1 s and exits 0 (its last
    step done), a start again without --resume exits 5."""
    script = (
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(argv_log)!r}).open('a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists():\n"
        "    m.write_text('x'); print('learner double: failing', flush=True); sys.exit(4)\n"
        "if '--resume' not in sys.argv:\n"
        "    sys.exit(5)\n"
        "print('learner double: resumed', flush=True); time.sleep(1.0)\n"
    )
    return [sys.executable, "-c", script, "--config", "config.toml"]


class LearnerWatcherDouble:
    """Test double: the live view, in which the learner's heartbeat says ready, sent now (under the id
    of whichever learner process runs: host-pid, as the learner names itself)."""

    def __init__(self, sup):
        self.sup = sup

    @property
    def snap(self):
        from parley.deploy.live import Snapshot
        from parley.protocol.messages import Heartbeat

        ident = f"host-{self.sup.get('learner').proc.pid}"
        return Snapshot(
            roles={f"learner/{ident}": Heartbeat(role="learner", id=ident, state="ready", created=time.time())}
        )

    async def poll(self):
        return self.snap


@pytest.mark.parametrize("ledger", [True, False])
async def test_parley_up_starts_a_learner_that_failed_after_it_came_ready_again_with_resume(tmp_path, capsys, ledger):
    """deploy.up with a real learner child (a test double): it fails once after its heartbeat said ready.
    With the learner's ledger in the run directory up starts it again with --resume (its log and
    roles/learner.cmd say so) and the run ends when it exits 0; without one the run stops, saying
    there is nothing to resume from. Before, the learner's failure always stopped the run."""
    import dataclasses

    from parley.config.run import RunConfig
    from parley.deploy import up
    from parley.learner.checkpoint import LearnerState, write_state

    if ledger:
        write_state(tmp_path, LearnerState(step=2))
    policy = dataclasses.replace(up.restart_policy(RunConfig()), backoff_s=0.05)
    sup = Supervisor(tmp_path, policy)
    argv = learner_double(tmp_path / "argv.log", tmp_path / "marker")
    learner = sup.start("learner", argv, **up.learner_restart(tmp_path, argv))
    try:
        code = await asyncio.wait_for(up._until_done(sup, asyncio.Event(), LearnerWatcherDouble(sup), quiet=True), 20)
    finally:
        sup.stop_all(timeout=5)
    out = capsys.readouterr().out
    starts = (tmp_path / "argv.log").read_text().splitlines()
    if ledger:
        assert code == 0, out
        assert starts == ["--config config.toml", "--config config.toml --resume"], starts
        assert len(learner.restarts) == 1 and learner.returncode == 0
        assert "learner exited with code 4; starting it again" in out, out
        assert f"started learner again: pid {learner.proc.pid} as: " in out and out.rstrip().endswith("--resume"), out
        log = learner.log_path.read_text()
        assert log.index("failing") < log.index("started again ---") < log.index("learner double: resumed"), log
        cmd = (tmp_path / "roles" / "learner.cmd").read_text()
        assert "\n# started again as: " in cmd and cmd.rstrip().endswith("--config config.toml --resume"), cmd
    else:
        assert code == 1 and starts == ["--config config.toml"] and not learner.restarts, out
        assert (
            learner.why_not
            == f"no learner state in {tmp_path / 'learner'} yet to resume from (it is written once samples arrive)"
        )
        assert f"learner exited with code 4 (not started again: {learner.why_not})" in out, out


@pytest.mark.parametrize(("code", "why"), [(2, "exit code 2 is a config error"), (4, "it failed before it came ready")])
def test_a_learner_is_not_started_again_after_a_config_error_or_before_it_came_ready(tmp_path, code, why):
    """Its ledger there or not: exit 2 (a config error, a lease another learner holds) and a start-up
    failure meet the next start the same way."""
    from parley.config.run import RunConfig
    from parley.deploy import up
    from parley.learner.checkpoint import LearnerState, write_state

    write_state(tmp_path, LearnerState(step=2))
    sup = Supervisor(tmp_path, up.restart_policy(RunConfig()))
    argv = always_fails(code)
    learner = sup.start("learner", argv, **up.learner_restart(tmp_path, argv))
    assert settle(sup, [], ready=code == 2) is learner
    assert learner.why_not.startswith(why) and not learner.restarts
