"""Which GPU sharing a `parley up` run gets ([up] gpu_share): one rule, `decide`, from the config's
facts, this machine's and what earlier runs measured. The check before start (deploy/up_cli.py, also
under --dry-run) and the start itself (deploy/mps.py start_for) both ask it.

"auto" takes phased sharing (the learner and the actor take the GPU in turns, actors/phases.py) where
config.run.phased_refusal allows it and either the overlapped memory plan does not fit the GPU while
the phased one does, or earlier runs of the same workload on the same GPU model measured phased
faster than overlapped sharing; otherwise what it took before: MPS where the daemon's binary is on
PATH (plain if it cannot serve), plain sharing without it. The measurements are kept by `record`,
which `parley up` calls at the end of a run on a GPU: the sharing it had and its trained tokens/s
over the steady window (from the end of its first step, so start-up is not counted), in
$PARLEY_CACHE/gpu_share.json, by a fingerprint of the workload (`fingerprint`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import msgspec

from parley.deploy.mps import BINARY, FIX, MISSING

log = logging.getLogger(__name__)

Mode = Literal["none", "plain", "mps", "phased"]  # "none": the config puts nothing on a GPU
OVERLAPPED = ("mps", "plain")  # the learner's and the actor's kernels on the GPU at once
EVIDENCE_FILE = "gpu_share.json"
# Keys of the config that do not change the workload a run measures: where it runs and what it is
# called, its length, how it is watched and logged, how the GPU is shared (what is compared) and the
# size the memory plan is told. Everything else (model, batch, sampling, learner settings) stays in.
NOT_WORKLOAD = (
    ("run", "name"),
    ("run", "dir"),
    ("run", "recipe"),  # its settings are in the other keys
    ("nats",),
    ("log",),
    ("learner", "steps"),
    ("up", "gpu_share"),
    ("up", "live"),
    ("up", "metrics"),
    ("up", "gpu_memory_gib"),
)


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    """One run's evidence (finished, or stopped by its operator: measured_end): its sharing and trained
    tokens/s over the steady window."""

    mode: Literal["plain", "mps", "phased"]
    tokens_per_s: float  # trained tokens / s from the end of the first step to the end of the last
    steps: int  # steps in the run; the window is steps 2..steps
    gpu: str  # the GPU's model name (nvidia-smi), e.g. "NVIDIA H100 80GB HBM3"
    run_dir: str
    measured: str  # UTC, when the run ended
    # of the groups that came back in time over the window, the share trained rather than skipped for
    # equal rewards (signal_share); None for a record from before it was kept
    signal_share: float | None = None

    def figure(self) -> str:
        return f"{self.mode} {self.tokens_per_s:,.0f} trained tokens/s ({self.run_dir}, steps 2..{self.steps}, {self.measured})"


class Store(msgspec.Struct, kw_only=True):
    """The evidence file: per workload fingerprint, the latest run of each sharing on each GPU model."""

    version: int = 1
    runs: dict[str, list[Measured]] = msgspec.field(default_factory=dict)


@dataclass(frozen=True)
class Fit:
    """The memory plan (deploy/memory.py) made twice: GiB needed overlapped and phased, of the usable."""

    usable: float
    overlapped: float
    phased: float


@dataclass(frozen=True)
class Facts:
    share: str  # [up] gpu_share as asked
    uses_gpu: bool  # deploy.memory.uses_gpu
    mps_binary: str | None = None  # where nvidia-cuda-mps-control is, None = not on PATH
    phased_refusal: str | None = None  # config.run.phased_refusal: why phased cannot run this config
    sleep_level: int | None = None  # the actor's sleep level under phased, where known
    fit: Fit | None = None  # only where the overlapped plan does not fit (else not needed)
    gpu: str | None = None  # this machine's GPU model name; None = unknown (no nvidia-smi)
    evidence: tuple[Measured, ...] = ()  # for this config's fingerprint
    evidence_note: str = ""  # why the evidence could not be read, said in the line


@dataclass(frozen=True)
class Decision:
    mode: Mode
    line: str  # for the operator ("" = nothing to say)
    refusal: str = ""  # a run must not start: the reason and the fix
    here: bool = False  # the refusal is about this machine (a binary missing): a dry run only notes it
    fallback: bool = False  # "auto" under MPS: plain sharing where the daemon cannot serve


def decide(f: Facts) -> Decision:
    """The sharing a run gets and the line that says why (module docstring)."""
    if f.share == "plain":
        return Decision("plain" if f.uses_gpu else "none", "")
    if not f.uses_gpu:
        refusal = (
            "" if f.share == "auto" else f'[up] gpu_share = "{f.share}", but this config puts nothing on a GPU; {FIX}'
        )
        return Decision("none", "", refusal=refusal)
    if f.share == "phased":
        return Decision("phased", _phased_line(f.sleep_level, ""))
    if f.share == "mps":
        if f.mps_binary is None:
            line = f"GPU sharing: MPS; {BINARY} is not on this machine's PATH, so `parley up` here would refuse"
            return Decision("mps", line, refusal=MISSING, here=True)
        return Decision("mps", _mps_line(f.mps_binary))
    if f.share != "auto":
        raise ValueError(f'[up] gpu_share = "{f.share}": one of "auto", "plain", "mps", "phased"')
    return _auto(f)


def _auto(f: Facts) -> Decision:
    usual: Mode = "mps" if f.mps_binary else "plain"  # what "auto" takes without a reason for phased

    def overlapped(why: str) -> Decision:  # why: "" or "; ..."
        why += f.evidence_note
        if usual == "mps":
            return Decision("mps", _mps_line(f.mps_binary, auto=True) + why, fallback=True)
        return Decision(
            "plain", f'GPU sharing: plain (gpu_share = "auto" and {BINARY} is not on this machine\'s PATH)' + why
        )

    ev = {m.mode: m for m in f.evidence if f.gpu is not None and m.gpu == f.gpu}  # another GPU's say nothing
    phased = ev.get("phased")
    over = ev.get(usual) or next((ev[m] for m in OVERLAPPED if m in ev), None)
    if f.phased_refusal is not None:
        return overlapped(f"; not phased, though measured at {phased.figure()}: {f.phased_refusal}" if phased else "")
    fit = f.fit
    if fit is not None and fit.overlapped > fit.usable >= fit.phased:
        why = (
            f'gpu_share = "auto": overlapped, the memory plan needs {fit.overlapped:.1f} GiB of {fit.usable:.1f} '
            f"usable; phased, {fit.phased:.1f}"
        )
        return Decision("phased", _phased_line(f.sleep_level, why) + f.evidence_note)
    if phased is not None and over is not None:
        measured = f"measured on {f.gpu}: {phased.figure()} against {over.figure()}"
        if not comparable(phased, over):
            return overlapped(
                f"; not compared: the {phased.mode} run trained {phased.signal_share:.0%} of its groups back in "
                f"time, the {over.mode} run {over.signal_share:.0%} (the rest had equal rewards): they were at "
                f"different stages of learning, which moves trained tokens/s more than sharing does ({measured}); "
                f'run both again over the same steps to compare, or set gpu_share = "phased"'
            )
        if phased.tokens_per_s > over.tokens_per_s:
            return Decision("phased", _phased_line(f.sleep_level, f'gpu_share = "auto", faster {measured}'))
        return overlapped(f"; not phased, slower {measured}")
    if phased is not None:
        return overlapped(f'; measured on {f.gpu}: {phased.figure()}; run once with gpu_share = "{usual}" to compare')
    if over is not None:
        return overlapped(f'; measured on {f.gpu}: {over.figure()}; run once with gpu_share = "phased" to compare')
    if f.gpu is not None:
        return overlapped(
            f'; nothing measured for this config on {f.gpu}: run once with gpu_share = "phased" and once '
            f'with "{usual}" to compare (gpu_share = "auto" then takes the faster)'
        )
    return overlapped("")


def _phased_line(level: int | None, why: str) -> str:
    sleeps = f"sleeps (sleep level {level})" if level is not None else "sleeps"
    return (
        f"GPU sharing: phased{f' ({why})' if why else ''}, no MPS daemon: the actor's engine {sleeps} once a "
        "step's groups are played and wakes for the learner's next version; the learner steps alone meanwhile"
    )


def _mps_line(where: str, auto: bool = False) -> str:
    how = ' (gpu_share = "auto"; plain if a CUDA process cannot run under it)' if auto else ""
    return f"GPU sharing: MPS{how}, a daemon of the run's own ({where} -d), every child's kernels through its server"


# -- the workload's fingerprint --------------------------------------------------------------------


def fingerprint(cfg) -> str:
    """A short hash of the config's workload: every key but NOT_WORKLOAD's, so runs that differ only in
    their sharing, length or directory share their evidence."""
    tree = msgspec.to_builtins(cfg)
    for path in NOT_WORKLOAD:
        *parents, leaf = path
        node = tree
        for name in parents:
            node = node.get(name, {})
        node.pop(leaf, None)
    text = json.dumps(tree, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- this machine ----------------------------------------------------------------------------------


def gpu_name() -> str | None:
    """The model name of the GPU the run's children see first (nvidia-smi, as deploy/gpu_samples
    asks it; CUDA_VISIBLE_DEVICES's first entry where set), or None without nvidia-smi or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", first],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


# -- the evidence ----------------------------------------------------------------------------------


def evidence_path() -> Path:
    from parley.engines.models import cache_dir

    return cache_dir() / EVIDENCE_FILE


def read_evidence(key: str, path: Path | None = None) -> tuple[tuple[Measured, ...], str]:
    """(this fingerprint's evidence, a note): a file that cannot be read gives none, a warning and a
    note for the decision's line, never an error (the run goes on with the choice made without it)."""
    path = path or evidence_path()
    try:
        store = _load(path)
    except (OSError, msgspec.MsgspecError) as e:
        log.warning('%s cannot be read (%s): gpu_share = "auto" decides without measurements', path, e)
        return (), f"; {path} cannot be read ({_first_line(e)}), so no measurement was used"
    return tuple(store.runs.get(key, ())), ""


def _load(path: Path) -> Store:
    if not path.exists():
        return Store()
    return msgspec.json.decode(path.read_bytes(), type=Store)


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def steady(rows: list[dict]) -> tuple[float, int] | None:
    """(trained tokens/s, steps) from a run's metrics.jsonl rows: the tokens of steps 2..N over the
    time from the first step's end to the last's (each end with its publish, on the step's path);
    None with fewer than two timed steps."""
    steps = sorted((r for r in rows if "ended_at" in r and "trained_tokens" in r), key=lambda r: r["step"])
    if len(steps) < 2:
        return None
    end = [r["ended_at"] + r.get("publish_s", 0.0) for r in steps]
    span = end[-1] - end[0]
    if span <= 0:
        return None
    return sum(r["trained_tokens"] for r in steps[1:]) / span, len(steps)


def signal_share(rows: list[dict]) -> float | None:
    """Of the groups that came back in time between the first step's end and the last's, the share
    trained; the rest had equal rewards and were skipped (the learner's cumulative `groups` counts in
    metrics.jsonl). It falls as the policy masters its task: trained tokens/s then falls with it
    whatever the sharing (SmolLM2 hidden_goal on an H100, 2026-12-07: 0.07 in a run that learned in 50
    steps and went on to 112, against 0.38-0.82 in the others). None where the rows do not say."""
    counted = sorted((r for r in rows if isinstance(r.get("groups"), dict)), key=lambda r: r.get("step", 0))
    if len(counted) < 2:
        return None
    first, last = counted[0]["groups"], counted[-1]["groups"]
    trained = last.get("trained", 0) - first.get("trained", 0)
    equal = last.get("zero_advantage", 0) - first.get("zero_advantage", 0)
    return round(trained / (trained + equal), 3) if trained + equal > 0 else None


# Two runs whose signal shares differ by more than this factor were at different stages of learning:
# their trained tokens/s say more about that than about their sharing, so "auto" does not compare them
COMPARABLE_SIGNAL = 2.0


def comparable(a: Measured, b: Measured) -> bool:
    """Whether two runs' trained tokens/s may be compared (COMPARABLE_SIGNAL); a record without its share says nothing against it."""
    if a.signal_share is None or b.signal_share is None:
        return True
    low, high = sorted((a.signal_share, b.signal_share))
    return high <= COMPARABLE_SIGNAL * low


def record(key: str, mode: str, gpu: str, run_dir: Path, rows: list[dict], path: Path | None = None) -> Measured | None:
    """Keep what this run measured (None where it has no steady window) as the latest of its sharing
    for its fingerprint on this GPU model. A file that cannot be read is set aside (.bad), not lost."""
    got = steady(rows)
    if got is None:
        return None
    path = path or evidence_path()
    entry = Measured(
        mode=mode,
        tokens_per_s=round(got[0], 1),
        steps=got[1],
        gpu=gpu,
        run_dir=str(run_dir),
        measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        signal_share=signal_share(rows),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:  # two runs ending at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            store = _load(path)
        except (OSError, msgspec.MsgspecError) as e:
            log.warning(
                "%s cannot be read (%s): set aside as %s.bad, a new one begins", path, _first_line(e), path.name
            )
            with contextlib.suppress(OSError):
                path.replace(path.with_name(path.name + ".bad"))
            store = Store()
        kept = [m for m in store.runs.get(key, []) if (m.mode, m.gpu) != (mode, gpu)]
        store.runs[key] = [*kept, entry]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(store), indent=1))
        tmp.replace(path)
    return entry


STOPPED = 130  # up's exit code when the operator (or a wall budget's SIGINT) stopped the run


def measured_end(code: int) -> bool:
    """Whether a run that ended with `code` measured its sharing: one that finished (0), and one the
    operator stopped (130; a benchmark's wall budget stops its runs that way), whose steps up to the
    stop are as steady as a finished run's. A run that failed is no measurement."""
    return code in (0, STOPPED)


def record_run(key: str, mode: str, run_dir: Path) -> str:
    """What `parley up` calls at the end of a run on a GPU: its metrics.jsonl recorded (`record`) as
    the evidence of `mode`; a line for the operator ("" where there is no GPU name to key it by)."""
    gpu = gpu_name()
    if gpu is None:
        return ""
    metrics = run_dir / "metrics.jsonl"
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        entry = record(key, mode, gpu, run_dir, rows)
    except (OSError, ValueError) as e:
        log.warning("the GPU sharing measurement was not recorded: %s", e)
        return f"GPU sharing: not recorded ({_first_line(e)})"
    if entry is None:
        return "GPU sharing: not recorded (fewer than two timed steps: no steady window)"
    return f'GPU sharing measured: {entry.figure()} on {gpu}, kept in {evidence_path()} for gpu_share = "auto"'


# -- the facts of a config -------------------------------------------------------------------------


def facts_of(cfg, key: str = "", plan_cfg=None) -> Facts:
    """Facts for `decide` from the config and this machine. Under "auto" on a GPU also the memory plan
    overlapped and phased (where phased is allowed and the overlapped plan does not fit: `plan_cfg`,
    the config as the plan reads it) and, with `key` (fingerprint), the evidence on this GPU model."""
    from parley.config.run import phased_refusal
    from parley.deploy.memory import uses_gpu

    gpu = uses_gpu(cfg)
    facts = Facts(
        share=cfg.up.gpu_share,
        uses_gpu=gpu,
        mps_binary=shutil.which(BINARY),
        phased_refusal=phased_refusal(cfg),
        sleep_level=cfg.actor.sleep_level_served(cfg.weights),
    )
    if cfg.up.gpu_share != "auto" or not gpu:
        return facts
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:  # nvidia-smi beside the plan's own question to the driver
        asked = pool.submit(gpu_name)
        fit = plan_fit(plan_cfg if plan_cfg is not None else cfg) if facts.phased_refusal is None else None
        name = asked.result()
    evidence, note = read_evidence(key) if key and name else ((), "")
    return replace(facts, fit=fit, gpu=name, evidence=evidence, evidence_note=note)


def plan_fit(cfg) -> Fit | None:
    """Both memory plans where the overlapped one does not fit (None where it fits, or the GPU's total
    or a model's shape is unknown: the plan's own check says so later)."""
    from parley.deploy.memory import PlanError, make_plan, with_settings

    try:
        over = make_plan(cfg)
        if over is None or over.fits is not False:
            return None
        phased = make_plan(with_settings(cfg, {"up.gpu_share": "phased", "up.gpu_memory_gib": over.total}))
    except PlanError:
        return None
    return Fit(usable=over.usable, overlapped=over.need, phased=phased.need)
