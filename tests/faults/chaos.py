"""The fault-injection harness: a small real parley run as child processes (nats-server, `parley
sim`, `parley judge`, two `parley actor`, a `parley scorer` and `parley learner`), SIGKILLed and
restarted on a seeded schedule, and the books settled afterwards (`settle`). Used by
tests/faults/test_chaos.py; what it proves and the figures are in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from parley.config.run import load_config
from parley.deploy.natsserver import NatsServer, free_port
from parley.learner.checkpoint import read_state
from parley.protocol import codec, topology
from parley.protocol.messages import Heartbeat

REPO = Path(__file__).resolve().parents[2]
# A restarted nats-server recovers its JetStream store before it reports its port: seconds when the
# machine is idle, past the default 10 s at load 40-50 (seen: the first run that got that far failed so).
NATS_START_S = 120.0
# DeepSpeed builds its CPU comm op (deepspeed_shm_comm) on first use into TORCH_EXTENSIONS_DIR. The
# default, ~/.cache/torch_extensions, is shared by every checkout on the machine and rebuilt by each
# one whose venv path differs (minutes on 2 loaded cores, under a lock: every other learner waits,
# forever if the builder dies). The suite's roles keep their own, built once and reused by later runs.
TORCH_EXTENSIONS = Path(tempfile.gettempdir()) / "parley-faults-torch-extensions"
READY = ("ready", "busy")


@dataclass
class Role:
    """One role process and what happened to it."""

    name: str  # "actor-0", "scorer", ...
    kind: str  # heartbeat role: "actor" | "scorer" | "learner" | "sim" | "judge"
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0  # unix time of the latest start
    starts: int = 0
    kills: int = 0
    crashes: list[str] = field(default_factory=list)  # exits we did not cause: "code N: last log line"
    stalled: bool = False
    resumed: float = 0.0  # unix time of the latest SIGCONT: the heartbeats before it are of a stopped process
    held_down: bool = False  # kept down on purpose (an outage, or stopped)
    finished: bool = False  # exited 0 on its own after its work (the learner at its last step)
    env: dict[str, str] = field(default_factory=dict)  # its NATS user, when the server checks them
    module: str = "parley.deploy.cli"  # what `python -m` runs (tests.faults.clock_ahead: the same, its clock moved)
    sets: list[str] = field(default_factory=list)  # its own --set overrides, after the run's (the learner's last step)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """The run's processes. Role processes are `python -m parley.deploy.cli <role>` in their own process
    group (vLLM's engine core is a child: a kill takes the group). nats-server keeps its store
    directory and port across kills, as a restarted server on the same host would."""

    def __init__(self, root: Path, model: str, *, run: str, sets: list[str], server_conf: str | None = None):
        self.root, self.model, self.run, self.sets = root, model, run, sets
        self.cfg = load_config(None, sets)  # the run's config, as every role reads it (before a role's own sets)
        (root / "logs").mkdir(parents=True, exist_ok=True)
        self.server = NatsServer(root / "nats", port=free_port(), extra_conf=server_conf or "")
        self.url = ""
        self.nats_kills = 0
        self.roles: dict[str, Role] = {}
        self.beats: dict[tuple[str, str], Heartbeat] = {}
        self.events: list[str] = []  # what the chaos loop did, with times
        self.refused: dict[str, list[str]] = {}  # role -> the server's refusals in its log (scan_refusals)
        self.orphan_replies: dict[str, list[str]] = {}  # role -> replies refused after a restart (orphan_reply)
        self._scanned: dict[str, int] = {}  # role -> bytes of its log scanned so far

    # -- processes --------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        kind: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        module: str = "parley.deploy.cli",
    ) -> None:
        self.roles[name] = Role(name, kind, argv, self.root / "logs" / f"{name}.log", env=env or {}, module=module)

    def start(self, name: str, *extra: str) -> None:
        r = self.roles[name]
        cmd = [
            sys.executable,
            "-m",
            r.module,
            *r.argv,
            *extra,
            "--nats",
            self.url,
            *(x for s in [*self.sets, *r.sets] for x in ("--set", s)),
        ]
        with r.log.open("ab") as out:
            banner = f"\n===== start {r.starts + 1} at {time.strftime('%H:%M:%S')}: {' '.join(cmd[3:6])} ...\n"
            out.write(banner.encode())
            out.flush()
            r.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={
                    **os.environ,
                    "PARLEY_LOG": "INFO",
                    "PYTHONUNBUFFERED": "1",
                    "TORCH_EXTENSIONS_DIR": str(TORCH_EXTENSIONS),
                    **r.env,
                },
                start_new_session=True,
            )
        r.started, r.starts = time.time(), r.starts + 1

    def restart(self, name: str) -> None:
        # The learner comes back from its ledger and checkpoint; every other role just starts again.
        self.start(name, *(["--resume"] if self.roles[name].kind == "learner" else []))

    def kill(self, name: str, *, count: bool = True) -> None:
        """SIGKILL, as a crash or an OOM kill would. count=False: not one of the chaos's kills (the
        learner's at the end of the schedule, to give it its last step: Chaos.end_learner)."""
        if name == "nats":
            self.server.kill()
            self.nats_kills += 1
            return
        r = self.roles[name]
        if r.stalled:
            self.resume(name)
        _signal_group(r.proc, signal.SIGKILL)
        r.proc.wait()
        r.kills += count

    def stall(self, name: str) -> None:
        _signal_group(self.roles[name].proc, signal.SIGSTOP)
        self.roles[name].stalled = True

    def resume(self, name: str) -> None:
        _signal_group(self.roles[name].proc, signal.SIGCONT)
        self.roles[name].stalled = False
        self.roles[name].resumed = time.time()  # after the signal: no heartbeat of the stopped process counts

    def terminate(self, name: str, timeout: float = 60.0) -> int:
        """SIGTERM (the role drains and saves), SIGKILL if it hangs; returns the exit code."""
        r = self.roles[name]
        if not r.alive:
            return r.proc.returncode if r.proc else 0
        _signal_group(r.proc, signal.SIGTERM)
        try:
            return r.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(r.proc, signal.SIGKILL)
            r.proc.wait()
            return -9

    def reap(self) -> list[str]:
        """Restart roles that exited on their own (a supervisor would), except a learner that
        exited 0 (it trained its last step); returns what happened, one line each."""
        said = self.scan_refusals()
        for r in self.roles.values():
            if r.proc is None or r.held_down or r.proc.poll() is None:
                continue
            if r.kind == "learner" and r.proc.returncode == 0:
                r.finished = r.held_down = True
                said.append(f"{r.name} exited 0 on its own (its last step); not restarted")
                continue
            r.crashes.append(f"code {r.proc.returncode}: {last_error(r.log)}")
            said.append(f"CRASH {r.name} exited with {r.proc.returncode}; restarted")
            self.restart(r.name)
        if self.server.proc is not None and self.server.proc.poll() is not None:
            self.server.start(timeout=NATS_START_S)
            said.append("CRASH nats-server exited; restarted")
        return said

    def scan_refusals(self) -> list[str]:
        """Read what the roles logged since the last scan for the server's refusals (`refusals`), kept
        in self.refused; one line per role that has new ones."""
        said = []
        for r in self.roles.values():
            if not r.log.exists():
                continue
            with r.log.open("rb") as f:
                f.seek(self._scanned.get(r.name, 0))
                new = f.read()
            new = new[: new.rfind(b"\n") + 1]  # a line still being written waits for the next scan
            self._scanned[r.name] = self._scanned.get(r.name, 0) + len(new)
            found = refusals(new.decode(errors="replace"))
            restarts = self.server_restarts() if any(ORPHAN_REPLY.search(line) for line in found) else []
            orphans = [line for line in found if self.orphan_reply(line, restarts)]
            others = [line for line in found if line not in orphans]
            for kept, lines, what in (
                (self.orphan_replies, orphans, "replies refused after a nats-server restart"),
                (self.refused, others, "REFUSED by the server"),
            ):
                if lines:
                    kept.setdefault(r.name, []).extend(lines)
                    said.append(f"{r.name}: {len(lines)} {what}, the first: {lines[0]}")
        return said

    def server_restarts(self) -> list[float]:
        """When nats-server said ready after a restart (its log's times; the first start is not one)."""
        log = self.server.log_file.read_text(errors="replace") if self.server.log_file.exists() else ""
        ready = [time.mktime(time.strptime(m.group(1), "%Y/%m/%d %H:%M:%S")) for m in SERVER_READY.finditer(log)]
        return ready[1:]  # the first start: no request was lost yet

    def orphan_reply(self, refusal: str, restarts: list[float]) -> bool:
        """Whether a refusal is a service's answer refused because nats-server restarted between the
        request and the answer: a service may answer only requests the server delivered to it
        (allow_responses), and a restarted server knows none of the old ones. The requester times out
        and asks again; no grant is missing. Such a refusal names a reply inbox and comes within a
        response window (response_window_s) after one of `restarts` (server_restarts); its log line's
        time says when."""
        if not ORPHAN_REPLY.search(refusal):
            return False
        try:
            at = time.mktime(time.strptime(refusal[:19], "%Y-%m-%d %H:%M:%S"))
        except ValueError:
            return False
        from parley.deploy.permissions import response_window_s

        window = response_window_s(self.cfg)
        return any(0 <= at - t <= window for t in restarts)

    def checkpointed_step(self) -> int:
        """The step of the learner's ledger (its last checkpoint), which a --resume trains on from."""
        state = read_state(self.cfg.run_dir)
        return state.step if state is not None else 0

    def stop_all(self) -> None:
        for name in self.roles:
            if self.roles[name].stalled:
                self.resume(name)
            self.terminate(name, timeout=30)
        self.server.stop()

    # -- readiness ------------------------------------------------------------------------------

    def on_beat(self, hb: Heartbeat) -> None:
        self.beats[(hb.role, hb.id)] = hb

    def beat(self, name: str) -> Heartbeat | None:
        """The latest heartbeat of the role's current process, sent since it started or was last
        resumed: a stalled (SIGSTOPped) process's last heartbeat says what it held when it stopped
        (18 conversations in flight once, 0.1 s after its SIGCONT, when it held none: 2026-12-07)."""
        r = self.roles[name]
        since = max(r.started, r.resumed)
        if r.kind == "services":  # one process, two heartbeats (<id>-sim, <id>-judge): the older one speaks
            found = [self.beats.get((k, f"{name}-{k}")) for k in ("sim", "judge")]
            if any(hb is None or hb.created < since for hb in found):
                return None
            return min(found, key=lambda h: h.created)
        if r.kind == "learner":  # its id is <host>-<pid>
            found = [
                hb
                for (role, ident), hb in self.beats.items()
                if role == "learner" and r.proc and ident.endswith(f"-{r.proc.pid}")
            ]
        else:
            found = [hb for (role, ident), hb in self.beats.items() if role == r.kind and ident == name]
        hb = max(found, key=lambda h: h.created) if found else None
        return hb if hb is not None and hb.created >= since else None

    def is_up(self, name: str) -> bool:
        if name == "nats":
            return self.server.proc is not None and self.server.proc.poll() is None
        r = self.roles[name]
        hb = self.beat(name)
        return r.alive and not r.stalled and not r.held_down and hb is not None and hb.state in READY

    def note(self, t0: float, text: str) -> None:
        self.events.append(f"{time.time() - t0:7.1f}s  {text}")
        print(f"[chaos {time.time() - t0:6.1f}s] {text}", flush=True)


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unreachable)\b.*$", re.M)


def build_deepspeed_ops() -> float:
    """Build (or find built) DeepSpeed's CPU comm op in TORCH_EXTENSIONS before any role starts, so no
    learner start waits on a compile; returns the seconds it took."""
    t0 = time.time()
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=1200,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(TORCH_EXTENSIONS)},
    )
    return time.time() - t0


def last_error(log: Path) -> str:
    """The last exception line of a role's log ("nats.errors.TimeoutError: nats: timeout")."""
    found = [m.group(0) for m in _ERROR_LINE.finditer(log.read_text(errors="replace"))]
    return found[-1][:300] if found else "(no exception in the log)"


def up_credentials(root: Path, run: str, cfg=None) -> tuple[dict[str, tuple[str, str]], str]:
    """Every role's NATS user, made as `parley up` makes them (deploy.up.up_main: generate_credentials
    under root/auth, services answering for response_window_s(cfg)), and the server's authorization
    block for them (NatsServer's extra_conf). ({role: (user, password)}, block)."""
    from parley.deploy.credentials import generate_credentials, server_auth_conf
    from parley.deploy.permissions import response_window_s

    window = response_window_s(cfg)
    creds = generate_credentials(run, root / "auth", response_window=window)
    return creds, server_auth_conf(creds, response_window=window)


def up_env(role: str, creds: dict[str, tuple[str, str]]) -> dict[str, str]:
    """What `parley up` adds to a `role` child's environment for NATS (deploy.up.child_env): its role's
    user, and the learner's eval user too. Not up's count of CPU engines: the suite's engines share the
    cores as they did before it ran under auth."""
    from parley.deploy.up import child_env
    from parley.engines.engine import CPU_ENGINES_ENV

    env = child_env(role, creds, 1)
    del env[CPU_ENGINES_ENV]
    return env


REFUSED = re.compile(r"^.*permissions violation.*$", re.M | re.I)
ORPHAN_REPLY = re.compile(r'permissions violation for publish to "_inbox', re.I)
SERVER_READY = re.compile(r"\] (\d{4}/\d\d/\d\d \d\d:\d\d:\d\d)\.\d+ \[INF\] Server is ready")


def refusals(text: str) -> list[str]:
    """The lines of a role's log where the server refused it something (a grant missing from
    deploy/permissions.py: the role then times out, retries or gives up, so a test that waits on it
    fails late and far from the cause)."""
    return [m.group(0)[:400] for m in REFUSED.finditer(text)]


def nats_outage_at_start(crash: str) -> bool:
    """A role that met no NATS server while starting (it is restarted, as any supervisor would)."""
    return ": nats.errors." in crash or "could not connect to NATS" in crash or "NatsUnreachable" in crash


def _signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


# -- the faults ----------------------------------------------------------------------------------

VICTIMS = ["actor-0", "actor-1", "scorer", "learner", "sim", "judge", "nats"]
ENGINE_ROLES = {"actor-0", "actor-1", "sim", "judge"}  # a restart costs a vLLM start-up (~40-250 s here)
ACTORS = ("actor-0", "actor-1")
# Killed at least once in the last phase (the sim's and the judge's kills are their outages).
KILL_PHASE = ("actor-0", "actor-1", "scorer", "learner", "nats")


@dataclass
class Schedule:
    """When what happens, in seconds from the start of the chaos. In order:

    1. the stalled actor, with no kill meanwhile, so its task visibly moves to actor-1;
    2. the simulator SIGKILLed and held down `sim_outage_s` once an actor holds conversations (or
       after `sim_outage_wait_s`): the actors, the simulator and the judge are spared; the scorer,
       the learner and nats-server are killed every `outage_kill_every_s`, and so on while the
       simulator comes back;
    3. once the restarted simulator is ready, the judge down `judge_outage_s` while every engine
       role is spared (trajectories keep coming and the scorer must hold them), the others killed
       as in 2;
    4. a kill every `kill_every_s` among the actors, the scorer, the learner and nats-server until
       each of them was killed in this phase's bag and `min_kills` + 2 kills in all (or `max_s`).

    Besides, in whatever phase: the learner's first kill once it is past its first checkpoint with
    steps left to train (`learner_kill_due`), so it is killed however fast it trains.

    The learner trains with no last step (learner.steps = 0) through all of it, so every phase has
    work in flight however fast the machine is; when the schedule ends it is given one
    (`Chaos.end_learner`: killed, restarted with --resume and learner.steps = its checkpointed step +
    `steps_after`) and stops there by itself.
    """

    ack_wait_s: float
    stall_at_s: float = 5.0
    judge_outage_s: float = 45.0
    sim_outage_s: float = 300.0
    sim_outage_wait_s: float = 120.0
    min_kills: int = 20
    max_s: float = 1200.0
    kill_every_s: tuple[float, float] = (10.0, 15.0)
    outage_kill_every_s: tuple[float, float] = (20.0, 30.0)
    steps_after: int = 8  # the learner's steps after the schedule, from its checkpointed step (end_learner)

    @property
    def stall_s(self) -> float:
        return 3 * self.ack_wait_s  # long enough for the stalled actor's tasks to be redelivered


def learner_kill_due(step: int | None, kills: int, *, past_step: int, last_step: int) -> bool:
    """Whether the chaos kills the learner now, by its progress: `step` is what its current process's
    heartbeat reports (None: none yet), `kills` how often it was killed so far. Its first kill comes
    as soon as it is past `past_step` (its first checkpoint: the resume loads one and trains again the
    steps after it) and before `last_step`, at which it stops by itself (0: none, it trains on). Not
    by the schedule's clock: on an idle machine it trained all its 40 steps within the first 35 s of
    the chaos, during the stall, and the kill phase began at 491 s, so it was never killed (2026-12-07)."""
    return kills == 0 and step is not None and past_step < step and (last_step == 0 or step < last_step)


def holds_work(in_flight: dict[str, float | None], tasks_ack_pending: int) -> bool:
    """Whether the actors named in `in_flight` hold conversations, by fresh state: each one's
    conversations in flight from its heartbeat since its process started or was resumed (None: no
    heartbeat since, so unknown; Cluster.beat), and the TASKS consumer's unacknowledged tasks now,
    the server's word (a heartbeat is up to 2 s old, and a task finished meanwhile is acked). On the
    idle machine of 2026-12-07 the simulator outage began on a stalled actor's last heartbeat (18
    conversations in flight) with 0 tasks unacknowledged, and saw 0 sim waits."""
    known = list(in_flight.values())
    return None not in known and sum(known) > 0 and tasks_ack_pending > 0


async def retrying(call, what: str, attempts: int = 60):
    """A JetStream request from the observer, retried while nats-server restarts."""
    last = None
    for _ in range(attempts):
        try:
            return await call()
        except Exception as e:  # noqa: BLE001 - timeouts / no responders while the server is down
            last = e
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{what} kept failing: {last!r}")


class Chaos:
    """Runs the Schedule on a Cluster: SIGSTOP/SIGCONT, the judge and simulator outages, the seeded kills."""

    def __init__(self, cluster: Cluster, js, rng: random.Random, schedule: Schedule):
        self.cluster, self.js, self.rng, self.s = cluster, js, rng, schedule
        self.stall: dict = {"state": "pending"}
        self.outage: dict = {"state": "pending"}  # the judge's
        self.sim: dict = {"state": "pending"}
        self.kills = 0
        self.by_phase: Counter[str] = Counter()
        self.phase_kills: Counter[str] = Counter()  # victim -> kills in the last phase
        self.phases: dict[str, float] = {}  # phase boundary -> seconds from the start of the chaos
        self.load: dict[str, float] = {}  # phase boundary -> 1-minute load average
        self.bag: list[str] = []
        self.t0 = self.next_kill = self.last_poll = 0.0
        lc = cluster.cfg.learner
        self.learner_steps = (lc.checkpoint_every, lc.steps)  # learner_kill_due's past_step and last_step
        self.learner_steps_at_kills: list[int | None] = []  # the learner's heartbeat step at each of its kills
        self.learner_end: dict = {}  # end_learner: how the learner was given its last step

    def note(self, text: str) -> None:
        self.cluster.note(self.t0, text)

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.time() - self.t0, 1)
        self.load[phase] = os.getloadavg()[0]  # the machine is shared: how busy it was then

    @property
    def phase(self) -> str:
        if self.stall["state"] in ("pending", "stalled"):
            return "stall"
        if self.sim["state"] in ("pending", "down"):
            return "sim outage"
        if self.outage["state"] in ("pending", "down"):
            return "judge outage"
        return "kills"

    def kill_phase_done(self) -> bool:
        c = self.cluster
        return all(self.phase_kills[v] >= 1 or (v in c.roles and c.roles[v].finished) for v in KILL_PHASE)

    async def run(self) -> None:
        self.t0 = time.time()
        self.next_kill = self.t0 + self.rng.uniform(*self.s.kill_every_s)
        while True:
            now = time.time()
            for text in self.cluster.reap():
                self.note(text)
            if self.cluster.refused:  # a missing grant: the books would only show its consequences, later
                raise AssertionError(f"the server refused roles (deploy/permissions.py): {self.cluster.refused}")
            el = now - self.t0
            done = (
                self.phase == "kills"
                and self.kill_phase_done()
                and self.kills >= self.s.min_kills + 2
                or el >= self.s.max_s
            )
            if done and self.stall["state"] != "stalled" and "down" not in (self.outage["state"], self.sim["state"]):
                self.mark("end")
                return
            await self._stall(now, el)
            await self._learner_progress()
            await self._sim_outage(now)
            await self._outage(now)
            if not done and now >= self.next_kill and self.phase != "stall" and self.sim["state"] != "pending":
                await self._kill(now)
            await asyncio.sleep(0.5)

    async def _stored(self, key: str) -> int:
        stream = topology.stream_name(self.cluster.run, key)
        return (await retrying(lambda: self.js.stream_info(stream), "stream info")).state.messages

    async def _consumer(self, key: str):
        stream = topology.stream_name(self.cluster.run, key)
        return await retrying(lambda: self.js.consumer_info(stream, topology.CHANNELS[key].durable), "consumer info")

    async def _stall(self, now: float, el: float) -> None:
        # SIGSTOP actor-0 while it holds work, SIGCONT after 3 x ack_wait; meanwhile the TASKS
        # consumer must hand its tasks to actor-1 (num_redelivered: such messages now outstanding).
        c, st = self.cluster, self.stall
        if st["state"] == "pending" and el >= self.s.stall_at_s:
            hb = c.beat("actor-0")
            holding = hb.counters.get("in_flight", 0.0) if hb and hb.state in READY else None
            # the server's word only when the heartbeat says actor-0 holds some
            pending = (await self._consumer("tasks")).num_ack_pending if holding and c.is_up("actor-1") else 0
            if c.is_up("actor-1") and holds_work({"actor-0": holding}, pending):
                st.update(state="stalled", since=now, holding=holding, tasks_ack_pending=pending, max_redelivered=0)
                c.stall("actor-0")
                self.note(f"SIGSTOP actor-0 (holding {holding:.0f} conversations; {pending} tasks unacked)")
            elif el > 120:
                st["state"] = "skipped: actor-0 held no work for 2 minutes"
                self.note(st["state"])
        elif st["state"] == "stalled":
            info = await self._consumer("tasks")
            st["max_redelivered"] = max(st["max_redelivered"], info.num_redelivered)
            # On a loaded machine actor-1 may take a while to pull: keep actor-0 stopped until a
            # redelivery was seen (at most 4 x stall_s).
            waited = now - st["since"]
            if waited >= self.s.stall_s and (st["max_redelivered"] >= 1 or waited >= 4 * self.s.stall_s):
                st["state"] = "done"
                c.resume("actor-0")
                st["stalled_s"] = round(waited, 1)
                self.mark("stall over")
                self.note(
                    f"SIGCONT actor-0 after {waited:.0f}s; TASKS messages redelivered meanwhile: "
                    f"{st['max_redelivered']}"
                )

    async def _outage(self, now: float) -> None:
        # The judge down right after the stall, while the actors and the simulator are spared.
        c, out = self.cluster, self.outage
        if out["state"] == "pending" and self.phase == "judge outage":
            if not (c.is_up("sim") and c.is_up("judge")):
                return  # the restarted simulator (and judge) first: trajectories must arrive while it is down
            out.update(
                state="down",
                since=now,
                traj_before=await self._stored("traj"),
                scored_before=await self._stored("scored"),
                scorer_judge_waits=0,
            )
            self._hold_down("judge")
            self.mark("judge down")
            self.note(f"kill #{self.kills}: judge, kept down {self.s.judge_outage_s:.0f}s")
        elif out["state"] == "down":
            hb = c.beat("scorer")
            out["scorer_judge_waits"] = max(out["scorer_judge_waits"], hb.counters.get("judge_wait", 0) if hb else 0)
            if now - out["since"] >= self.s.judge_outage_s:
                traj, scored = await self._stored("traj"), await self._stored("scored")
                out.update(
                    state="done",
                    traj_during=traj - out.pop("traj_before"),
                    scored_during=scored - out.pop("scored_before"),
                    unscored_at_restart=traj - scored,
                )
                out.pop("since")
                self._bring_back("judge")
                self.mark("judge back")
                self.note(
                    f"judge restarted after {self.s.judge_outage_s:.0f}s; meanwhile {out['traj_during']} "
                    f"trajectories stored, {out['scored_during']} scored, {traj - scored} waiting to be scored; "
                    f"scorer judge_wait retries: {out['scorer_judge_waits']:.0f}"
                )

    def _actor_counter(self, name: str, missing: float | None = 0.0) -> dict[str, float | None]:
        """An actor counter from each actor's heartbeat since its process started or was resumed
        (`missing` where there is none)."""
        return {a: (hb.counters.get(name, 0.0) if (hb := self.cluster.beat(a)) else missing) for a in ACTORS}

    async def _sim_outage(self, now: float) -> None:
        # The simulator down for minutes while the actors hold their conversations: they must wait
        # it out (in_progress, no delivery spent, nothing dead-lettered), then finish them.
        c, out = self.cluster, self.sim
        if out["state"] == "pending":
            if self.phase != "sim outage":
                return
            out.setdefault("ready_since", now)
            if not c.is_up("sim"):
                return
            holding = self._actor_counter("in_flight", missing=None)
            tasks = await self._consumer("tasks") if any(holding.values()) else None
            held = tasks is not None and holds_work(holding, tasks.num_ack_pending)
            if not held and now - out["ready_since"] < self.s.sim_outage_wait_s:
                return
            tasks = tasks or await self._consumer("tasks")
            holding = {a: v or 0.0 for a, v in holding.items()}
            out.update(
                state="down",
                since=now,
                conversations_held=holding,
                tasks_ack_pending=tasks.num_ack_pending,
                redelivered_before=tasks.num_redelivered,
                max_redelivered=tasks.num_redelivered,
                dead_before=await self._stored("dead"),
                traj_before=await self._stored("traj"),
                sim_waits_before=self._actor_counter("sim_waits"),
                tasks_done_before=self._actor_counter("tasks"),
            )
            out.pop("ready_since")
            self.mark("sim down")
            self._hold_down("sim")
            self.note(
                f"kill #{self.kills}: sim, kept down {self.s.sim_outage_s:.0f}s; actors hold {holding} "
                f"conversations, {tasks.num_ack_pending} tasks unacked"
            )
        elif out["state"] == "down":
            if now - self.last_poll >= 5.0:
                self.last_poll = now
                out["max_redelivered"] = max(out["max_redelivered"], (await self._consumer("tasks")).num_redelivered)
            if now - out["since"] >= self.s.sim_outage_s:
                waits, finished = self._actor_counter("sim_waits"), self._actor_counter("tasks")
                out.update(
                    state="done",
                    down_s=round(now - out.pop("since"), 1),
                    sim_waits={a: waits[a] - out["sim_waits_before"][a] for a in ACTORS},
                    tasks_finished_during={a: finished[a] - out["tasks_done_before"][a] for a in ACTORS},
                    traj_during=await self._stored("traj") - out.pop("traj_before"),
                    dead_during=await self._stored("dead") - out.pop("dead_before"),
                )
                del out["sim_waits_before"], out["tasks_done_before"]
                self._bring_back("sim")
                hb = c.beat("learner")
                out["learner_step_at_end"] = hb.version if hb else None
                self.mark("sim back")
                self.note(
                    f"sim restarted after {out['down_s']:.0f}s; actors' sim_waits meanwhile {out['sim_waits']}, "
                    f"tasks finished {out['tasks_finished_during']}, trajectories stored {out['traj_during']}, "
                    f"dead letters {out['dead_during']}, TASKS redelivered (most at once) {out['max_redelivered']}"
                )

    def _hold_down(self, name: str) -> None:
        self.cluster.kill(name)
        self.cluster.roles[name].held_down = True
        self.kills += 1
        self.by_phase[self.phase] += 1

    def _bring_back(self, name: str) -> None:
        self.cluster.roles[name].held_down = False
        self.cluster.restart(name)

    def _kills_of(self, victim: str) -> int:
        return self.cluster.nats_kills if victim == "nats" else self.cluster.roles[victim].kills

    def _spared(self, now: float) -> set[str]:
        if self.phase == "kills":
            return {"sim", "judge"}  # their kills were their outages; another engine start would stall the run
        return ENGINE_ROLES  # the outages: the actors hold their work, the other service stays up

    async def _kill(self, now: float) -> None:
        c = self.cluster
        spared = self._spared(now)
        eligible = [v for v in VICTIMS if v not in spared and c.is_up(v)]
        if not self.bag:
            self.bag = seeded_bag(self.rng, VICTIMS)
        # the bag takes every role in turn; when none of its remaining roles may go now, the least killed goes
        victim = next((v for v in self.bag if v in eligible), None)
        if victim is None and eligible:
            victim = min(eligible, key=lambda v: (self._kills_of(v), self.rng.random()))
        if victim is None:
            return
        if victim in self.bag:
            self.bag.remove(victim)
        phase = self.phase
        await self._kill_and_restart(victim)
        every = self.s.kill_every_s if phase == "kills" else self.s.outage_kill_every_s
        self.next_kill = time.time() + self.rng.uniform(*every)

    async def _learner_progress(self) -> None:
        # The learner's first kill by its progress (learner_kill_due), in whatever phase, the stall's too.
        c = self.cluster
        hb = c.beat("learner")
        past_step, last_step = self.learner_steps
        due = learner_kill_due(
            hb.version if hb else None, c.roles["learner"].kills, past_step=past_step, last_step=last_step
        )
        if due and c.is_up("learner"):
            of = f" of {last_step}" if last_step else ""
            await self._kill_and_restart("learner", f"{of}, by its progress (past step {past_step})")

    def end_learner(self) -> int:
        """When the schedule is over: give the learner, which trained with no last step through it
        (learner.steps = 0), its last step: SIGKILL, then --resume with learner.steps = its checkpointed
        step + `steps_after`, so it trains that many steps after the chaos and stops by itself. Not one
        of the chaos's kills (they are counted and checked without it). The last step; a learner
        configured with one keeps it (nothing done)."""
        c, r = self.cluster, self.cluster.roles["learner"]
        if self.learner_steps[1] or r.finished:
            return self.learner_steps[1]
        hb = c.beat("learner")
        c.kill("learner", count=False)
        checkpointed = c.checkpointed_step()
        last = checkpointed + self.s.steps_after
        r.sets = [*r.sets, f"learner.steps={last}"]  # its every start from now on, a crash's restart too
        c.restart("learner")
        self.learner_end = {
            "step_at_kill": hb.version if hb else None,
            "checkpointed_step": checkpointed,
            "last_step": last,
        }
        self.note(
            f"the schedule is over: learner (at step {hb.version if hb else '?'}) killed and restarted with "
            f"--resume from step {checkpointed} to stop at step {last} (learner.steps={last}; not counted as a kill)"
        )
        return last

    async def _kill_and_restart(self, victim: str, why: str = "") -> None:
        c, phase = self.cluster, self.phase
        if victim == "learner":
            hb = c.beat("learner")
            self.learner_steps_at_kills.append(hb.version if hb else None)
            why = f" at step {hb.version if hb else '?'}{why}"
        c.kill(victim)
        self.kills += 1
        self.by_phase[phase] += 1
        if phase == "kills":
            self.phase_kills[victim] += 1
        if victim == "nats":
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))  # a moment with no server at all
            c.server.start(timeout=NATS_START_S)
            self.note(f"kill #{self.kills} ({phase}): nats-server (restarted on the same store and port)")
        else:
            c.restart(victim)
            self.note(f"kill #{self.kills} ({phase}): {victim}{why} (restarted)")

    def summary(self) -> dict:
        kills = {name: r.kills for name, r in self.cluster.roles.items()} | {"nats": self.cluster.nats_kills}
        stall = {k: v for k, v in self.stall.items() if k != "since"}
        return {
            "chaos_s": round(time.time() - self.t0, 1),
            "kills": kills,
            "kills_total": sum(kills.values()),
            "kills_by_phase": dict(self.by_phase),
            "learner_steps_at_kills": list(self.learner_steps_at_kills),
            "learner_end": dict(self.learner_end),
            "phases_s": dict(self.phases),
            "load_average": dict(self.load),
            "stall": stall,
            "judge_outage": dict(self.outage),
            "sim_outage": dict(self.sim),
        }


# -- reading the run back -----------------------------------------------------------------------


async def read_channel(js, run: str, key: str) -> list:
    """Every message stored on a channel, decoded (undecodable ones as None)."""
    stream = topology.stream_name(run, key)
    info = await js.stream_info(stream)
    out = []
    if not info.state.messages:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await js.get_msg(stream, seq)
        except Exception:  # noqa: BLE001 - a removed sequence
            continue
        try:
            out.append(codec.decode(key, raw.data))
        except Exception:  # noqa: BLE001 - reported by the ledger as unattributable
            out.append(None)
    return out


async def unacked(js, run: str, key: str, settle_s: float) -> list:
    """What a channel's durable consumer still owes (never acked or termed), decoded; its roles
    must be stopped. Fetched through the durable itself, so it is exactly what a restarted role
    would be given; nothing is acked here."""
    import nats.errors

    durable = topology.CHANNELS[key].durable
    stream = topology.stream_name(run, key)
    sub = await js.pull_subscribe_bind(durable, stream=stream)
    got: dict[int, object] = {}
    deadline = time.monotonic() + settle_s
    try:
        while True:
            try:
                for m in await sub.fetch(64, timeout=1.0):
                    try:
                        got[m.metadata.sequence.stream] = codec.decode(key, m.data)
                    except (msgspec.DecodeError, msgspec.ValidationError):  # unplayable junk still owed
                        got[m.metadata.sequence.stream] = None
            except (TimeoutError, nats.errors.TimeoutError):
                info = await js.consumer_info(stream, durable)
                if info.num_pending == 0 and info.num_ack_pending <= len(got) or time.monotonic() > deadline:
                    break
    finally:
        await sub.unsubscribe()
    return list(got.values())


async def owed_ids(js, run: str, settle_s: float) -> dict[str, set[str]]:
    """The ids each channel's durable still owes (unacked): task ids of TASKS, trajectory ids of TRAJ
    and SCORED, junk left out; what `settle` counts as waiting."""
    owed = {key: await unacked(js, run, key, settle_s=settle_s) for key in ("tasks", "traj", "scored")}
    return {
        "tasks": {t.task_id for t in owed["tasks"] if t is not None},
        "traj": {t.traj_id for t in owed["traj"] if t is not None},
        "scored": {s.traj_id for s in owed["scored"] if s is not None},
    }


async def publish_poison(js, run: str, poison: dict[str, bytes]) -> None:
    """Publish each payload straight to the run's TASKS subject, as a hostile or broken producer
    would (no feeder, no codec check); a Msg-Id per label, so a retried publish is stored once."""
    subject = topology.subject(run, "tasks")
    for label, payload in poison.items():
        await retrying(
            lambda p=payload, i=f"poison:{label}": js.publish(subject, p, headers={"Nats-Msg-Id": i}),
            f"publishing poison {label!r}",
        )


def trained_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "trained.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the ledger ----------------------------------------------------------------------------------


@dataclass
class Ledger:
    tasks: int = 0
    samples: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)  # kind -> samples the learner gave up (timeout, dead, ...)
    dead: Counter = field(default_factory=Counter)  # channel -> samples dead-lettered after the learner's last read
    pending: Counter = field(default_factory=Counter)  # where a sample waits at shutdown -> samples
    fates: Counter = field(default_factory=Counter)  # per issued task: trained | dropped | dead | waiting | lost
    dead_reasons: Counter = field(default_factory=Counter)  # every dead letter of the run, by reason_kind
    poison: dict[str, str] = field(default_factory=dict)  # poison label -> the reason it was dead-lettered with
    poison_missing: list[str] = field(default_factory=list)  # poison published but not found in DEAD
    lost: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)
    inconsistent: list[str] = field(default_factory=list)
    past_deadline: list[str] = field(default_factory=list)  # tasks the ledger still held in flight past task_deadline_s
    reasons: dict[str, str] = field(default_factory=dict)  # task -> recorded reason of a drop / dead letter
    steps: int = 0

    def summary(self) -> dict:
        return {
            "tasks": self.tasks,
            "samples": self.samples,
            "steps": self.steps,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "dead_lettered": dict(self.dead),
            "pending": dict(self.pending),
            "task_fates": dict(self.fates),
            "dead_letters_by_reason": dict(self.dead_reasons),
            "poison": dict(self.poison),
            "poison_missing": list(self.poison_missing),
            "lost": len(self.lost),
            "trained_twice": len(self.trained_twice),
            "inconsistent": len(self.inconsistent),
            "held_past_deadline": len(self.past_deadline),
        }


def reason_kind(reason: str) -> str:
    """A dead letter's reason without the ids and numbers that differ per message, for counting:
    "task chaos-g000003: n=1025 exceeds 1024 (...)" -> "n=N exceeds N"."""
    text = re.sub(r"^(task|sample) \S+: ", "", reason)
    text = re.split(r" \(|; |: ", text, maxsplit=1)[0]
    return re.sub(r"\d+(\.\d+)?", "N", text)[:80]


def settle(
    tasks: list,
    dead: list,
    lines: list[dict],
    state,
    buffered_ids: set[str],
    unacked_ids: dict[str, set[str]],
    poison: dict[str, bytes] | None = None,
    task_deadline_s: float | None = None,
    deadline_slack_s: float = 30.0,
) -> Ledger:
    """Account for every (task, sample) the feeder published, and for every poison message.

    tasks: Task messages in TASKS (None for one that does not decode); dead: the run's DEAD stream
    as (stream sequence, DeadLetter or None) pairs; lines: trained.jsonl; state: the learner's
    final ledger (LearnerState); buffered_ids: traj ids held in state.groups; unacked_ids: channel
    -> ids its durable still owes ("tasks": task ids, "traj"/"scored": traj ids); poison: label ->
    the exact payload published straight to TASKS that no actor may play (it must be in DEAD);
    task_deadline_s: the learner's, to check that no task is still held in flight (its slot taken)
    longer than that after its issue, by the ledger's own clock (`saved`; a resume moves `at` by the
    time the learner was down), give or take the deadline watcher's poll (`deadline_slack_s`).

    Each issued task ends trained, dropped by the learner with a recorded reason, dead-lettered
    after the learner's last read of DEAD, or waiting; a sample with no such place is lost.
    """
    poison = poison or {}
    led = Ledger(steps=len(lines))
    poison_ids = set()
    for payload in poison.values():
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):  # the undecodable one names no task
            poison_ids.add(codec.decode("tasks", payload).task_id)
    n_of: dict[str, int] = {}
    for t in tasks:
        if t is not None and t.task_id not in poison_ids:
            n_of.setdefault(t.task_id, t.n)
    led.tasks, led.samples = len(n_of), sum(n_of.values())

    count = Counter(tid for line in lines for tid in line["traj_ids"])
    led.trained_twice = sorted(tid for tid, c in count.items() if c > 1)
    not_trained = {task: reason for line in lines for task, reason in line.get("not_trained", {}).items()}
    steps = [line["step"] for line in lines]
    if steps != list(range(1, len(steps) + 1)) or (state is not None and state.step != len(steps)):
        led.inconsistent.append(f"trained.jsonl steps {steps} vs ledger step {state.step if state else None}")

    done = state.done if state is not None else {}  # a learner.groups.Finished: tasks under its watermark too
    in_flight = set(state.in_flight) if state is not None else set()
    read_up_to = state.dead_seq if state is not None else 1  # the learner has applied letters before this
    dead_tasks: dict[str, str] = {}
    dead_trajs: dict[str, tuple[str, str]] = {}
    by_payload = {payload: label for label, payload in poison.items()}
    for seq, dl in dead:
        if dl is None:
            led.inconsistent.append(f"DEAD holds an undecodable letter at sequence {seq}")
            continue
        led.dead_reasons[reason_kind(dl.reason)] += 1
        key = dl.subject.rsplit(".", 1)[-1]
        if key == "tasks" and dl.payload in by_payload:
            led.poison[by_payload[dl.payload]] = dl.reason
            continue
        try:
            msg = codec.decode(key, dl.payload)
        except Exception:  # noqa: BLE001 - junk nobody published on purpose here
            led.inconsistent.append(f"unattributable dead letter on {dl.subject}: {dl.reason[:100]}")
            continue
        if key == "tasks":
            task, sample = msg.task_id, None
            dead_tasks[task] = dl.reason
        else:
            task, sample = msg.task_id, msg.sample
            dead_trajs[msg.traj_id] = (key, dl.reason)
        # A letter the learner has read (before its dead_seq) about a task it issued must have freed
        # the task's slot, unless a complete group (or the dead sample itself) was buffered anyway.
        if task in n_of and seq < read_up_to and task in in_flight and task not in done:
            held = {tid for tid in buffered_ids if tid.rsplit("/", 1)[0] == task}
            complete = len(held) == n_of[task]
            if not complete and (sample is None or f"{task}/{sample}" not in held):
                led.inconsistent.append(
                    f"the learner read dead letter {seq} ({key}: {dl.reason[:80]}) but still "
                    f"holds task {task} in flight"
                )
    led.poison_missing = sorted(label for label in poison if label not in led.poison)

    for task, n in sorted(n_of.items()):
        if task not in done and task not in in_flight and state is not None:
            led.inconsistent.append(f"task {task} is in TASKS but the learner's ledger neither issued nor finished it")
        # under the ledger's watermark a task has no entry: trained (the reasons log gives the others' kinds)
        kind = done.get(task) or ("trained" if task in done else None)
        if kind not in (None, "trained"):
            reason = not_trained.get(task) or (state.reasons.get(task) if state is not None else None)
            if reason:
                led.reasons[task] = reason
            else:
                led.inconsistent.append(f"task {task} dropped as {kind!r} without a recorded reason")
        lost_before, dead_before = len(led.lost), sum(led.dead.values())
        for sample in range(n):
            tid = f"{task}/{sample}"
            if count[tid] >= 1:
                led.trained += 1
                if kind != "trained":
                    led.inconsistent.append(f"{tid} is in trained.jsonl but the ledger says {kind!r}")
            elif kind not in (None, "trained"):
                led.dropped[kind] += 1
            # waiting first: a sample stored before its Task (or another copy of it) was dead-lettered still trains
            elif tid in buffered_ids:
                led.pending["learner buffer (acked, in the ledger)"] += 1
            elif tid in unacked_ids.get("scored", set()):
                led.pending["SCORED, unacked by the learner"] += 1
            elif tid in unacked_ids.get("traj", set()):
                led.pending["TRAJ, unacked by the scorer"] += 1
            elif task in unacked_ids.get("tasks", set()):
                led.pending["TASKS, unacked by the actors"] += 1
            elif task in dead_tasks:
                led.dead["tasks"] += 1
                led.reasons[task] = dead_tasks[task]
            elif tid in dead_trajs:
                led.dead[dead_trajs[tid][0]] += 1
                led.reasons[tid] = dead_trajs[tid][1]
            else:
                where = "trained" if kind == "trained" else kind or "unknown to the learner"
                led.lost.append(f"{tid} (task {where})")
        if len(led.lost) > lost_before:
            led.fates["lost"] += 1
        elif kind is not None:
            led.fates["trained" if kind == "trained" else "dropped"] += 1
        else:
            led.fates["dead" if sum(led.dead.values()) > dead_before else "waiting"] += 1
    if task_deadline_s is not None and state is not None:
        led.past_deadline = sorted(
            f"{i.task_id} ({state.saved - i.at:.0f}s)"
            for i in state.issued
            if i.task_id in in_flight and state.saved - i.at > task_deadline_s + deadline_slack_s
        )
    phantom = sorted(tid for tid in count if tid.rsplit("/", 1)[0] not in n_of)
    led.inconsistent += [f"{tid} trained but its task was never published" for tid in phantom]
    return led


def load_final_state(run_dir: Path):
    state = read_state(run_dir)
    buffered = {s.traj_id for g in state.groups for s in g.samples} if state is not None else set()
    return state, buffered


def tasks_played_twice(cluster: Cluster) -> dict[str, list[str]]:
    """Tasks that more than one actor process finished (a stalled actor's task redelivered), from the logs."""
    by_task: dict[str, list[str]] = {}
    pat = re.compile(r"task (\S+): \d+ samples stored")
    for r in cluster.roles.values():
        if r.kind != "actor":
            continue
        for m in pat.finditer(r.log.read_text(errors="replace")):
            by_task.setdefault(m.group(1), []).append(r.name)
    return {t: who for t, who in by_task.items() if len(who) > 1}


def seeded_bag(rng: random.Random, names: list[str]) -> list[str]:
    bag = list(names)
    rng.shuffle(bag)
    return bag
