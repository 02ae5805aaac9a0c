"""Child-process management for `parley up`: start roles, record how, watch them, stop them all.

Each role is a `parley <role>` child in its own process group, with its exact command, resolved
config and log written into the run directory. A role that exits non-zero stops the whole run,
and the supervisor shows that role's last log lines.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
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


class Supervisor:
    """Starts and stops the run's children; `check()` reports the first one that failed."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.children: list[Child] = []
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "roles").mkdir(parents=True, exist_ok=True)

    def parley_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "parley.deploy.cli", *args]

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, config_text: str | None = None
    ) -> Child:
        child = Child(name=name, argv=argv, log_path=self.run_dir / "logs" / f"{name}.log", env=env or {})
        roles = self.run_dir / "roles"
        (roles / f"{name}.cmd").write_text(
            " ".join(f"{k}={shlex.quote(v)}" for k, v in child.env.items() if not k.endswith("PASSWORD"))
            + (" " if child.env else "")
            + shlex.join(argv)
            + "\n"
        )
        if config_text is not None:
            (roles / f"{name}.toml").write_text(config_text)
        log = child.log_path.open("ab")
        child.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **child.env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # our Ctrl-C is handled here, then forwarded in order
        )
        log.close()
        child.started = time.time()
        self.children.append(child)
        return child

    def failed(self) -> Child | None:
        for c in self.children:
            rc = c.returncode
            if rc not in (None, 0):
                return c
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
