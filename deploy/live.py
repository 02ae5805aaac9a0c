"""The live view of a run: roles, streams, throughput, learner progress, reward terms.

Everything comes from NATS (heartbeats on the status subjects, stream and consumer info), so the
same view serves `parley up` on one machine and `parley top --nats URL --run RUN` for a run whose
roles live elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from parley.protocol import status, topology
from parley.protocol.backlog import WARN_SHARE, unconsumed_share, warning
from parley.protocol.messages import Heartbeat

STALE_AFTER_S = 10.0  # a role silent this long is shown as "lost"


@dataclass
class StreamRow:
    messages: int = 0
    pending: int = 0  # not yet delivered to the shared consumer
    ack_pending: int = 0  # delivered, not yet acked (work in progress)
    redelivered: int = 0
    backlog: float = 0.0  # share of the stream's max_bytes held by unconsumed messages (protocol.backlog)
    max_bytes: int = 0


@dataclass
class Snapshot:
    roles: dict[str, Heartbeat] = field(default_factory=dict)  # key "role/id"
    streams: dict[str, StreamRow] = field(default_factory=dict)
    traj_rate: float = 0.0  # trajectories/s over the last minute
    taken: float = 0.0


class RunWatcher:
    """Keeps a Snapshot of a run up to date from heartbeats and stream info."""

    def __init__(self, nc, run: str):
        self.nc, self.js, self.run = nc, nc.jetstream(), run
        self.snap = Snapshot()
        self._traj_hist: deque[tuple[float, int]] = deque(maxlen=120)
        self._sub = None

    async def start(self) -> None:
        self._sub = await status.keep_latest(self.nc, self.run, self.snap.roles)

    async def poll(self) -> Snapshot:
        for key, channel in topology.CHANNELS.items():
            row = StreamRow()
            name = topology.stream_name(self.run, key)
            with contextlib.suppress(Exception):
                info = await self.js.stream_info(name)
                row.messages = info.state.messages
                row.max_bytes = info.config.max_bytes or 0
            if channel.durable:
                with contextlib.suppress(Exception):
                    ci = await self.js.consumer_info(name, channel.durable)
                    row.pending = ci.num_pending or 0
                    row.ack_pending = ci.num_ack_pending or 0
                    row.redelivered = ci.num_redelivered or 0
                    row.backlog = unconsumed_share(
                        info.state.messages, info.state.bytes, row.pending + row.ack_pending, row.max_bytes
                    )
            self.snap.streams[key] = row
        now = time.time()
        self._traj_hist.append((now, self.snap.streams.get("traj", StreamRow()).messages))
        old = next((h for h in self._traj_hist if now - h[0] <= 60.0), self._traj_hist[0])
        dt = now - old[0]
        self.snap.traj_rate = (self._traj_hist[-1][1] - old[1]) / dt if dt > 0 else 0.0
        self.snap.taken = now
        return self.snap

    async def stop(self) -> None:
        if self._sub:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


def learner_beat(snap: Snapshot) -> Heartbeat | None:
    """The learner's latest heartbeat. Its id is host-pid, so after the learner was started again the
    snapshot also holds the last heartbeat of the one before, under another key."""
    return max((hb for hb in snap.roles.values() if hb.role == "learner"), key=lambda hb: hb.created, default=None)


def render(snap: Snapshot, run: str, title: str = ""):
    """A rich renderable of the snapshot."""
    from rich.console import Group
    from rich.table import Table

    roles = Table(title=f"parley run {run} {title}".strip(), expand=True)
    for col in ("role", "id", "state", "version", "activity"):
        roles.add_column(col)
    now = time.time()
    latest_learner = learner_beat(snap)
    for key in sorted(snap.roles):
        hb = snap.roles[key]
        if hb.role == "learner" and hb is not latest_learner:
            continue  # the last heartbeat of a learner since started again (another id: host-pid)
        state = hb.state if now - hb.created < STALE_AFTER_S else f"lost ({now - hb.created:.0f}s)"
        counters = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(hb.counters.items()) if not k.startswith("reward."))
        roles.add_row(hb.role, hb.id, state, str(hb.version), counters)

    streams = Table(title="streams", expand=True)
    for col in ("stream", "stored", "waiting", "in progress", "redelivered", "of max_bytes"):
        streams.add_column(col, justify="right" if col != "stream" else "left")
    for key, row in snap.streams.items():
        share = f"{row.backlog:.0%}" + (" FULL SOON" if row.backlog >= WARN_SHARE else "")
        streams.add_row(key, str(row.messages), str(row.pending), str(row.ack_pending), str(row.redelivered), share)
    warnings = backlog_warnings(snap)
    if warnings:
        streams.caption = "\n".join(warnings)

    learner = learner_beat(snap)
    progress = Table(title="learning", expand=True)
    progress.add_column("metric")
    progress.add_column("value", justify="right")
    progress.add_row("trajectories/s (1 min)", f"{snap.traj_rate:.2f}")
    scoring = snap.streams.get("traj", StreamRow())
    progress.add_row("scoring backlog", str(scoring.pending + scoring.ack_pending))
    if learner:
        progress.add_row("learner step", _fmt(learner.counters.get("step", 0)))
        progress.add_row("policy version", str(learner.version))
        for k, v in sorted(learner.counters.items()):
            if k.startswith(("reward.", "staleness")):
                progress.add_row(k, _fmt(v))
    judge_rows, flagged = judge_reliability(snap)
    for k, v in judge_rows:
        progress.add_row(k, v)
    if learner and learner.counters.get("train.behaviour_gap"):
        flagged.append(
            f"BEHAVIOUR GAP: the last step's behaviour log-probs were "
            f"{_fmt(learner.counters['train.logp_mismatch'])} nats a token from the learner's "
            "([learner] behaviour_gap_alarm): the learner's log says what to check"
        )
    if flagged:
        progress.caption = "\n".join(flagged)
    return Group(roles, streams, progress)


JUDGE_KEYS = ("judge_audit.agreement", "judge.tie_share", "judge_audit.drift", "judge_audit.audited")


def judge_reliability(snap: Snapshot) -> tuple[list[tuple[str, str]], list[str]]:
    """The scorers' judge reliability ([scorer] audit_*): a row per scorer and number, and a line per
    scorer whose judge agreement is below its bar."""
    rows, flagged = [], []
    for key in sorted(snap.roles):
        hb = snap.roles[key]
        if hb.role != "scorer":
            continue
        rows += [(f"{k} ({hb.id})", _fmt(hb.counters[k])) for k in JUDGE_KEYS if k in hb.counters]
        if hb.counters.get("judge_audit.flagged"):
            flagged.append(
                f"JUDGE UNRELIABLE on {hb.id}: agreement {_fmt(hb.counters.get('judge_audit.agreement', 0.0))} "
                "below [scorer] audit_min_agreement"
            )
    return rows, flagged


def backlog_warnings(snap: Snapshot) -> list[str]:
    """One line per stream whose unconsumed messages approach its byte limit."""
    return [warning(key, row.backlog, row.max_bytes) for key, row in snap.streams.items() if row.backlog >= WARN_SHARE]


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


async def watch(nc, run: str, stop: asyncio.Event, *, refresh: float = 1.0, title: str = "", console=None) -> None:
    """Show the live view until `stop` is set."""
    from rich.live import Live

    watcher = RunWatcher(nc, run)
    await watcher.start()
    try:
        with Live(render(watcher.snap, run, title), console=console, refresh_per_second=2, transient=False) as live:
            while not stop.is_set():
                live.update(render(await watcher.poll(), run, title))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=refresh)
    finally:
        await watcher.stop()
