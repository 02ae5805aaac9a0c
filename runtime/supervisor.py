"""Child-process management for `parley up`: start roles, record how, watch them, stop them all.

Each role is a `parley <role>` child in its own process group, with its exact command, resolved
config and log written into the run directory. A role that exits non-zero stops the whole run, and
the supervisor shows that role's last log lines, unless a `RestartPolicy` lets it start that child
again: the stateless workers (actors, scorers, services), whose unsettled messages the bus gives to
another worker, a bounded number of times, and the roles its caller adds (`parley up` adds the learner,
which it starts again with another command, `Child.restart_argv`, once it has a state to resume from,
`Child.restart_check`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str  # "actor-0", "learner", ...
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each start again
    restart_due: float | None = None  # failed, to start again at this time.monotonic()
    why_not: str = ""  # failed, and why it was not started again
    came_ready: bool = False  # said it was ready since its latest start (Supervisor.check's `ready`)
    restart_argv: list[str] | None = None  # the command of its starts again; None = `argv`
    # asked before each start again the policy allows: None where it may start, else why not (one
    # phrase), e.g. a learner with no state yet to resume from
    restart_check: Callable[[], str | None] | None = None

    @property
    def other_argv_again(self) -> list[str] | None:
        """Its command for a start again where that differs from its first (`restart_argv`), else None."""
        return self.restart_argv if self.restart_argv not in (None, self.argv) else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 25) -> str:
        try:
            with self.log_path.open(errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except FileNotFoundError:
            return "(no log)"


NEVER_RESTARTED = frozenset({2})
"""Exit codes a child is not started again after: 2 is a ConfigError (parley.errors), which the same
command meets again."""

TRANSIENT = frozenset({3})
"""Exit codes after which a child that never came ready is started again all the same: 3 is Unavailable
(parley.errors: NATS or a service not reachable yet; asking again later may succeed)."""


@dataclass(frozen=True)
class RestartPolicy:
    """Which failed children the supervisor starts again: those of `roles`, at most `limit` times in
    any `window_s` (a child that fails more often than that stops the run), after a backoff of
    `backoff_s` doubled by each restart in the window (1, 2, 4 ... s; at most 30), never after an exit
    code of NEVER_RESTARTED, and not when the child failed before it came ready (a start-up failure: a
    model, a memory plan or a GPU that the next start meets the same way, each engine start costing a
    minute) unless its exit code is TRANSIENT, nor while the child's own `restart_check` says why not.
    limit 0 starts nothing again."""

    limit: int = 3
    window_s: float = 600.0
    roles: frozenset[str] = frozenset({"actor", "scorer", "services"})
    backoff_s: float = 1.0
    held: tuple[tuple[str, str], ...] = ()  # (role, why) of roles left out of `roles` on purpose

    def why_not(self, child: Child, now: float) -> str | None:
        """None where `child`, failed, may start again; else why not (one phrase)."""
        if self.limit == 0:
            return "[up] restarts = 0"
        role = child.name.split("-")[0]
        if role not in self.roles:
            return dict(self.held).get(role, f"{role} is not restarted")
        if child.returncode in NEVER_RESTARTED:
            return f"exit code {child.returncode} is a config error, which a restart meets again"
        if not child.came_ready and child.returncode not in TRANSIENT:
            return "it failed before it came ready: a start-up failure, which a restart most likely meets again"
        if child.restart_check is not None and (why := child.restart_check()):
            return why
        if (n := self.recent(child, now)) >= self.limit:
            return f"started again {n} times in the last {self.window_s:.0f} s ([up] restarts = {self.limit})"
        return None

    def recent(self, child: Child, now: float) -> int:
        """Restarts of `child` within the window before `now`."""
        return sum(1 for t in child.restarts if now - t < self.window_s)

    def backoff(self, child: Child, now: float) -> float:
        return min(30.0, self.backoff_s * 2.0 ** self.recent(child, now))


class Supervisor:
    """Starts and stops the run's children; `failed()` reports the first one that failed, and
    `check()` first starts again those a RestartPolicy allows."""

    def __init__(self, run_dir: Path, restart: RestartPolicy | None = None):
        self.run_dir = run_dir
        self.restart = restart or RestartPolicy(limit=0)
        self.children: list[Child] = []
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "roles").mkdir(parents=True, exist_ok=True)

    def parley_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "parley.deploy.cli", *args]

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        config_text: str | None = None,
        *,
        restart_argv: list[str] | None = None,
        restart_check: Callable[[], str | None] | None = None,
    ) -> Child:
        """Start child `name`; `restart_argv` and `restart_check` as Child's (for its starts again)."""
        child = Child(
            name=name,
            argv=argv,
            log_path=self.run_dir / "logs" / f"{name}.log",
            env=env or {},
            restart_argv=restart_argv,
            restart_check=restart_check,
        )
        roles = self.run_dir / "roles"
        (roles / f"{name}.cmd").write_text(
            " ".join(f"{k}={shlex.quote(v)}" for k, v in child.env.items() if not k.endswith("PASSWORD"))
            + (" " if child.env else "")
            + shlex.join(argv)
            + "\n"
            + (f"# started again as: {shlex.join(again)}\n" if (again := child.other_argv_again) else "")
        )
        if config_text is not None:
            (roles / f"{name}.toml").write_text(config_text)
        self._spawn(child)
        self.children.append(child)
        return child

    def _spawn(self, child: Child, again: bool = False) -> None:
        child.came_ready = False
        log = child.log_path.open("ab")
        child.proc = subprocess.Popen(
            (again and child.other_argv_again) or child.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **child.env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # our Ctrl-C is handled here, then forwarded in order
        )
        log.close()
        child.started = time.time()

    def check(self, say=print, ready: Mapping[str, float] | None = None) -> Child | None:
        """The first failed child that the restart policy does not start again (the run stops; its
        `why_not` says why), or None. A failed child the policy allows is started again once its
        backoff has passed, with the same command (its `restart_argv` where it has one) and environment,
        its log continued; `say` gets a
        line when it fails and when it starts again. What the dead child's own children left (a vLLM
        engine core holding GPU memory) is killed first: they share its process group. `ready`: child
        name -> time.time() of its latest heartbeat that said ready; one sent before the child's latest
        start (its previous life) does not count."""
        policy, now = self.restart, time.monotonic()
        for c in self.children:
            if not c.came_ready and (ready or {}).get(c.name, 0.0) >= c.started:
                c.came_ready = True
        for c in self.children:
            rc = c.returncode
            if rc in (None, 0):
                continue
            if c.restart_due is None:
                if (why := policy.why_not(c, now)) is not None:
                    c.why_not = why
                    return c
                wait = policy.backoff(c, now)
                c.restart_due = now + wait
                say(
                    f"{c.name} exited with code {rc}; starting it again in {wait:.1f} s "
                    f"({policy.recent(c, now) + 1} of at most {policy.limit} in {policy.window_s:.0f} s); "
                    f"its last log lines:\n{c.tail(10)}"
                )
                _signal_group(c.proc, signal.SIGKILL)
            if now >= c.restart_due:
                c.proc.wait()
                with c.log_path.open("a") as log:
                    log.write(f"\n--- parley up: {c.name} exited with code {rc}; started again ---\n")
                c.restarts.append(now)
                c.restart_due = None
                self._spawn(c, again=True)
                how = f" as: {shlex.join(other)}" if (other := c.other_argv_again) else ""
                say(f"started {c.name} again: pid {c.proc.pid}{how}")
        return None

    def get(self, name: str) -> Child | None:
        return next((c for c in self.children if c.name == name), None)

    def retire(self, name: str, timeout: float = 30.0) -> int | None:
        """Stop child `name` on purpose (SIGTERM, SIGKILL after `timeout`) and forget it, so its exit
        is no failure of the run; returns its exit code."""
        child = self.get(name)
        if child is None:
            return None
        self.children.remove(child)
        if child.alive:
            _signal_group(child.proc, signal.SIGTERM)
        try:
            return child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(child.proc, signal.SIGKILL)
            return child.proc.wait()

    def stop_all(self, timeout: float = 30.0) -> None:
        """SIGTERM every live child (they drain), then SIGKILL what is left after `timeout`."""
        for c in reversed(self.children):
            if c.alive:
                _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # vLLM engines run in grandchildren; signal the whole process group.
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
