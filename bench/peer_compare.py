"""parley and TRL side by side on one recipe (issue 26 item 3), from what `bash bench/gpu_run.sh P` leaves
in OUT: parley's metrics.jsonl, eval_history.jsonl and parley_steps.log (the learner's step and eval
lines), TRL's peer_trl.json (bench/peer_trl.py) and p_clock.json (when each run was launched).

    python bench/peer_compare.py --out gpu-out --json bench/results/raw/peer_trl.json
    python bench/peer_compare.py --over OUT_SEED0 OUT_SEED1 OUT_SEED2 --json SEEDS.json  # one command, seeds

It prints trained tokens/s and wall s/step (steady state: from the end of step 1 to the end of the
last step, so start-up is reported apart; parley's step ends as its learner recorded them, before the
last step's checkpoint), the held-out reward at equal wall time (each system's
latest eval result at the times either one reported one, counted from its launch) and the loss
settings of both, and writes them as JSON. Nothing in parley imports this file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/peer_compare.py`
    sys.path.insert(0, str(ROOT))
from parley.config.learner import LearnerConfig  # noqa: E402
from parley.learner.steplog import PHASES, behaviour_gap  # noqa: E402

METRIC = "goal_match"
GAP_ALARM = LearnerConfig().behaviour_gap_alarm  # nats: a step's logp_mismatch past it is flagged
GOAL = 1.5  # issue 26: parley at least 1.5x TRL's trained tokens/s at equal or better held-out reward
# the learner's end-of-step line (learner.stepper) under runtime.process's log format
_STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?: step (\d+): loss")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def local_time(text: str) -> datetime:
    """A device-local time, as logging's asctime ("2026-12-02 06:22:48,123") or `date '+%F %T.%N'` writes it."""
    text = text.strip().replace(",", ".")
    day, _, frac = text.partition(".")
    return datetime.strptime(f"{day}.{(frac or '0')[:6]}", "%Y-%m-%d %H:%M:%S.%f")


def step_times(lines: list[str], start_local: str) -> dict[int, float]:
    """step -> seconds from the launch to the learner's end-of-step line."""
    t0 = local_time(start_local)
    out = {}
    for line in lines:
        m = _STEP_LINE.match(line)
        if m:
            out[int(m.group(2))] = (local_time(m.group(1)) - t0).total_seconds()
    return out


def steady(steps: list[dict]) -> dict:
    """From [{step, t (s since launch), trained_tokens, signal_tokens}]: the first step's end (start-up
    included), the whole run, and the steady state between the end of step 1 and the end of the last
    step. signal_tokens: the trained tokens of groups whose rewards differ (a group of equal rewards
    has advantage 0 everywhere and adds nothing to the gradient, with no KL term)."""
    steps = sorted(steps, key=lambda s: s["step"])
    if len(steps) < 2:
        raise ValueError(f"{len(steps)} step(s) recorded; the steady state needs two or more")
    first, last = steps[0], steps[-1]
    span = last["t"] - first["t"]
    tokens = sum(s["trained_tokens"] for s in steps[1:])
    signal = sum(s["signal_tokens"] for s in steps[1:])
    return {
        "steps": len(steps),
        "first_step_end_s": round(first["t"], 2),
        "last_step_end_s": round(last["t"], 2),
        "wall_s_per_step": round(span / (len(steps) - 1), 4),
        "trained_tokens_per_s": round(tokens / span, 1),
        "signal_tokens_per_s": round(signal / span, 1),
        "trained_tokens": sum(s["trained_tokens"] for s in steps),
        "trained_tokens_per_step": round(tokens / (len(steps) - 1), 1),
    }


def latest(evals: list[dict], t: float, by: str = "t_result") -> dict | None:
    """The last eval whose result was in by `t` (seconds since launch), or None; `by="t_version"`: the
    last whose version had been trained by `t`."""
    done = [e for e in evals if e[by] <= t]
    return max(done, key=lambda e: e[by]) if done else None


def at_equal_wall_time(parley: list[dict], trl: list[dict], metric: str = METRIC) -> list[dict]:
    """At every time either system had an eval result in, each one's latest held-out `metric`."""
    rows = []
    for t in sorted({e["t_result"] for e in (*parley, *trl)}):
        p, q = latest(parley, t), latest(trl, t)
        rows.append(
            {
                "t_s": round(t, 1),
                "parley": None if p is None else {"version": p["version"], metric: p[metric]},
                "trl": None if q is None else {"version": q["version"], metric: q[metric]},
            }
        )
    return rows


_PLAYED = re.compile(r"task \S+: \d+ samples stored in ([0-9.]+)s")
# the same line's tail since 2026-12-05 (actors.actor.sample_split): a sample's mean split
_SPLIT = re.compile(r"a sample's mean: play ([0-9.]+)s, generate ([0-9.]+)s, simulator ([0-9.]+)s, rest (-?[0-9.]+)s")
# rollout.conversation's lines for a conversation stopped at a turn boundary or with a call cut
_STOPPED = re.compile(r"task \S+: (stopped|turn cut|simulator call cut) after \d+ messages: ")
# `parley up`'s start-up lines (deploy.up._wait_ready), counted from its roles' launch; since issue 56 each
# ends with the seconds since up's own start (deploy.common.stamped), older logs without
_READY = re.compile(r"^ready after ([0-9.]+) s: (.+?)(?: \[\+[0-9.]+ s\])?$")
_ALL_READY = re.compile(r"^all roles ready in ([0-9.]+) s$")
_STAMP = re.compile(r"^(.+?) \[\+([0-9.]+) s\]$")


# an actor's line for each task it played (actors.actor), its running count of sampled assistant tokens;
# part P greps the actors' logs with their names (`actor-0.log:...`) since issue 56, older files without
_GENERATED = re.compile(
    r"^(?:([^\s:]+):)?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?task \S+: \d+ samples stored in "
    r"[0-9.]+s \((\d+) assistant tokens generated so far\)"
)


def generated_series(lines: list[str], start_local: str) -> list[tuple[float, int]]:
    """[(seconds since launch, assistant tokens all actors had sampled by then)], one point per played
    task, from the actors' task lines: every group played counts, trained, dropped as stale or cut."""
    t0 = local_time(start_local)
    events = []
    for line in lines:
        m = _GENERATED.match(line)
        if m:
            events.append(((local_time(m.group(2)) - t0).total_seconds(), m.group(1) or "", int(m.group(3))))
    latest_of: dict[str, int] = {}
    out = []
    for t, actor, count in sorted(events):
        latest_of[actor] = max(count, latest_of.get(actor, 0))
        out.append((round(t, 3), sum(latest_of.values())))
    return out


def tokens_by(series: list[tuple[float, int]], t: float | None) -> int | None:
    """The series' count at time `t` (0 before its first point); None without a series or a time."""
    if not series or t is None:
        return None
    done = [n for s, n in series if s <= t]
    return done[-1] if done else 0


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return round(xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2, 4)


def step_breakdown(metrics: list[dict], actor_lines: list[str]) -> dict:
    """Where parley's steps 2..N went (medians): the learner waiting for a step's groups, training,
    publishing; and an actor's time to play a task (a group) from its log."""
    later = [m for m in metrics if m.get("step", 0) >= 2]
    out = {k: _median([m.get(k) for m in later]) for k in ("wait_s", "train_s", "publish_s")}
    if any(PHASES[0] in m for m in later):  # where train_s went (recorded since 2026-12-05 night)
        out.update((k, _median([m.get(k) for m in later])) for k in PHASES)
    out["checkpoints_before_the_last_step"] = sum(1 for m in later[:-1] if "checkpoint_s" in m)
    played = [float(m.group(1)) for m in map(_PLAYED.search, actor_lines) if m]
    out["task_play_s"] = _median(played)
    out["tasks_played"] = len(played)
    split = [m.groups() for m in map(_SPLIT.search, actor_lines) if m]
    if split:  # where a sample's play went (older logs have no split)
        for i, k in enumerate(("sample_play_s", "sample_generate_s", "sample_simulator_s", "sample_rest_s")):
            out[k] = _median([float(g[i]) for g in split])
    # conversations the actor stopped because the learner could no longer train their group
    # (rollout.conversation: at a turn boundary, or with the running generation or simulator call cut)
    how = Counter(m.group(1) for m in map(_STOPPED.search, actor_lines) if m)
    out.update(
        conversations_stopped=how["stopped"],
        generations_cut=how["turn cut"],
        simulator_calls_cut=how["simulator call cut"],
    )
    return out


def startup(up_lines: list[str]) -> dict:
    """When each of parley's roles came ready, in seconds from their launch, and all of them (from
    `parley up`'s output, part P's up_peer.log); {} for a log from before those lines were printed."""
    roles: dict[str, float] = {}
    out: dict = {}
    stamps: dict[str, float] = {}  # each stamped line's head -> seconds since up's own start (issue 56)
    for line in up_lines:
        if (m := _STAMP.match(line.strip())) and not line.startswith("ready after "):
            head = m.group(1).split(":", 1)[0].split(" (", 1)[0]
            stamps.setdefault(head, float(m.group(2)))
        if m := _READY.match(line.strip()):
            roles.update((name, float(m.group(1))) for name in m.group(2).split(", "))
        elif m := _ALL_READY.match(line.strip()):
            out["all_ready_s"] = float(m.group(1))
    if roles:
        out["roles_ready_s"] = roles
    if stamps:
        out["since_launch_s"] = stamps
    return out


def recorded_ends(metrics: dict[int, dict], launched: float) -> dict[int, float]:
    """step -> seconds from the launch to the step's end as the learner recorded it (metrics.jsonl's
    `ended_at`, the device's wall clock, plus the step's publish), for the steps that carry it. The
    step's log line comes later, after the step's checkpoint and eval export: the last step takes both,
    3-4 s on the H100 (2026-12-05), which the steady state must not count (the settings table puts
    parley's final checkpoint outside the timed steps; TRL's run saves none)."""
    return {s: m["ended_at"] + m.get("publish_s", 0.0) - launched for s, m in metrics.items() if "ended_at" in m}


TIMED_BY = (
    "recorded",
    "log",
)  # parley's step ends: as its learner recorded them, or its log lines (before 2026-12-05 evening)


def parley_side(out: Path, clock: dict, timed_by: str = "recorded", metric: str = METRIC) -> dict:
    metrics = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl")}
    # the learner's log lines, overridden by its recorded step ends (a run from before metrics carried
    # them keeps its lines); timed_by "log": the lines alone, how this file timed parley before 2026-12-05 evening
    times = step_times((out / "parley_steps.log").read_text().splitlines(), clock["parley_start_local"])
    if timed_by == "recorded":
        times.update(recorded_ends(metrics, clock["parley_start"]))
    elif timed_by != "log":
        raise ValueError(f"timed_by {timed_by!r}: one of {', '.join(TIMED_BY)}")
    # parley trains no group of equal rewards (learner.grouper skips it before a step): every trained token carries signal
    steps = [
        {
            "step": s,
            "t": times[s],
            "trained_tokens": metrics[s]["trained_tokens"],
            "signal_tokens": metrics[s]["trained_tokens"],
        }
        for s in sorted(metrics)
        if s in times
    ]
    evals = [
        {
            **{k: e[k] for k in ("version", "step", "n", "seconds") if k in e},
            metric: e[metric],
            "t_result": e["created"] - clock["parley_start"],
            "t_version": times.get(e["version"], 0.0),
        }
        for e in read_jsonl(out / "eval_history.jsonl")
    ]
    # what the held-out evals cost the learner's path (learner.stepper): on a step whose version is
    # evaluated, the weights written for the eval (its publish_s beyond a usual step's) at the step's
    # end, then the export, after it; the eval itself runs beside, in the eval child
    usual = median([m["publish_s"] for m in metrics.values() if "publish_s" in m and "eval_export_s" not in m]) or 0.0
    inline = []
    for n, m in sorted(metrics.items()):
        if "eval_export_s" in m and n in times:
            inline.append((times[n], max(0.0, m.get("publish_s", 0.0) - usual), True))
            inline.append((times[n], m["eval_export_s"], False))
    actor_log = out / "parley_actor.log"
    breakdown = step_breakdown(list(metrics.values()), actor_log.read_text().splitlines() if actor_log.exists() else [])
    up_log = out / "up_peer.log"
    return {
        "steps": steps,
        "evals": evals,
        # (t, seconds, inside): held-out eval work on the training path, by the end of the step it
        # follows (inside: counted in that step's end already)
        "inline_evals": inline,
        # every assistant token its actors sampled, by time since launch (dropped and stale groups too)
        "generated": generated_series(
            actor_log.read_text().splitlines() if actor_log.exists() else [], clock["parley_start_local"]
        ),
        "total_s": clock["parley_end"] - clock["parley_start"],
        "breakdown": breakdown,
        # steps whose behaviour log-probs were far from the learner's ([learner] behaviour_gap_alarm's
        # default, also for runs from before the learner flagged them): the actor sampled another model
        "behaviour_gap_steps": [n for n, m in sorted(metrics.items()) if behaviour_gap(m, GAP_ALARM)],
        "startup": startup(up_log.read_text(errors="replace").splitlines() if up_log.exists() else []),
    }


def at_equal_training_time(parley: dict, trl: dict, metric: str = METRIC) -> list[dict]:
    """at_equal_wall_time with each system's clock started at the end of its own step 1, so that
    start-up (engines, compile caches) is left out; reported beside the clock from launch."""

    def shifted(side):
        t1 = min(s["t"] for s in side["steps"])
        return [{**e, "t_result": e["t_result"] - t1} for e in side["evals"] if e["t_result"] >= t1]

    return at_equal_wall_time(shifted(parley), shifted(trl), metric)


def at_trls_last_version(parley: dict, trl: dict, metric: str = METRIC) -> dict:
    """The held-out reward at equal training time, read where TRL's run ends: at the end of the step that
    made TRL's last evaluated version (seconds since TRL's step 1 ended), each side's latest evaluated
    version whose step had ended by the same time since its own step 1. A version counts when it was
    trained, not when its eval result came in: TRL evaluates inline, between its steps (its steps pay
    for it), parley on an engine beside them, whose results can come in after its last step. With as
    many steps on both sides and parley the faster, that is each one's last; given more steps
    (PARLEY_STEPS), parley counts with the version it had trained by then."""
    t1 = {"parley": min(s["t"] for s in parley["steps"]), "trl": min(s["t"] for s in trl["steps"])}
    # version 0 (t_version 0, before any step) is in by any time
    shifted = {
        k: [{**e, "t_version": e["t_version"] - t1[k]} for e in side["evals"]]
        for k, side in (("parley", parley), ("trl", trl))
    }
    if not shifted["trl"]:
        return {"t_s": None, "parley": None, "trl": None, "difference": None}
    t = max(e["t_version"] for e in shifted["trl"])
    p, q = latest(shifted["parley"], t, by="t_version"), latest(shifted["trl"], t, by="t_version")
    cell = lambda e: None if e is None else {"version": e["version"], metric: e[metric]}  # noqa: E731
    return {
        "t_s": round(t, 1),
        "parley": cell(p),
        "trl": cell(q),
        "difference": None if p is None else round(p[metric] - q[metric], 4),
    }


def signal_tokens(step: dict, n: int) -> float:
    """A TRL step's trained tokens less its groups of equal rewards' share (flat_groups of the
    step's conversations / n groups; exact at one group a step)."""
    groups = max(1, step["conversations"] // n)
    return step["trained_tokens"] * (1 - step.get("flat_groups", 0) / groups)


def trl_side(peer: dict, launched: float, metric: str = METRIC) -> dict:
    n = peer["recipe"]["n"]
    steps = [
        {
            "step": s["step"],
            "t": s["t_end"] - launched,
            "trained_tokens": s["trained_tokens"],
            "signal_tokens": signal_tokens(s, n),
        }
        for s in peer["steps"]
    ]
    ends = {s["step"]: s["t"] for s in steps}
    evals = [
        {
            "version": e["version"],
            "n": e["n"],
            "seconds": e["seconds"],
            metric: e[metric],
            "t_result": e["t_end"] - launched,
            "t_version": ends.get(e["version"], 0.0),
        }
        for e in peer["evals"]
    ]
    # TRL evaluates version k right after step k, before step k + 1: inside the steady state for k >= 1
    # up to the last step but one
    numbers = [s["step"] for s in steps]
    eval_s = sum(e["seconds"] for e in peer["evals"] if numbers and min(numbers) <= e["version"] < max(numbers))
    # a run cut by its time limit has no end time: its last record is the end
    end = peer.get("ended_at") or max([s["t_end"] for s in peer["steps"]] + [e["t_end"] for e in peer["evals"]])
    # its rollouts' sampled tokens by the end of each step (peer_trl.py records them since issue 56; a
    # synchronous trainer discards none); [] for an older record
    generated, total = [], 0
    for s in sorted(peer["steps"], key=lambda s: s["t_end"]):
        if "generated_tokens" not in s:
            generated = []
            break
        total += s["generated_tokens"]
        generated.append((s["t_end"] - launched, total))
    return {
        "steps": steps,
        "evals": evals,
        # TRL evaluates version k after step k's end, before step k + 1 (v0 before step 1)
        "inline_evals": [(ends.get(e["version"], 0.0), e["seconds"], False) for e in peer["evals"]],
        "generated": generated,
        "inline_eval_s": round(eval_s, 2),
        "total_s": end - launched,
    }


def _pair_files(out: Path, trl_out: Path | None) -> tuple[dict, dict, dict]:
    """parley's clock from `out`, TRL's result and clock from `trl_out` (default: the same call);
    ValueError when the two calls ran different seeds."""
    clock = json.loads((out / "p_clock.json").read_text())
    trl_dir = trl_out or out
    if not (trl_dir / "peer_trl.json").is_file():
        what = "TRL's side" if trl_out is not None else "parley's side only"
        raise ValueError(
            f"{trl_dir} holds {what}, no peer_trl.json (a SIDE=parley or TRL=0 call): pair each parley file with "
            "its seed's TRL file, --over p_parley_sS.tgz=p_trl_sS.tgz (--trl-out for --out)"
            if trl_out is None
            else f"{trl_dir}, given as {what}, has no peer_trl.json: give the TRL call's file (SIDE=trl, p_trl_sS.tgz)"
        )
    peer = json.loads((trl_dir / "peer_trl.json").read_text())
    trl_clock = json.loads((trl_dir / "p_clock.json").read_text())
    if trl_out is not None and trl_clock.get("seed", 0) != clock.get("seed", 0):
        raise ValueError(
            f"{out} ran seed {clock.get('seed', 0)} but its TRL side {trl_out} ran seed "
            f"{trl_clock.get('seed', 0)}: pair each parley call with TRL's call at the same SEED"
        )
    return clock, peer, trl_clock


def compare(out: Path, trl_out: Path | None = None, timed_by: str = "recorded") -> dict:
    """`trl_out`: TRL's run from another call of part P (its peer_trl.json and p_clock.json), when
    parley's side of `out` was re-run alone (TRL=0); both calls' SEED must agree (ValueError).
    `timed_by`: where parley's step ends come from (parley_side)."""
    clock, peer, trl_clock = _pair_files(out, trl_out)
    same_card(clock, trl_clock, out, trl_out)
    parley, trl = parley_side(out, clock, timed_by), trl_side(peer, trl_clock["trl_start"])
    ps, ts = steady(parley["steps"]), steady(trl["steps"])
    # TRL's eval runs between its steps; without it its steady state would be this much shorter
    ts["wall_s_per_step_without_eval"] = round(
        (ts["last_step_end_s"] - ts["first_step_end_s"] - trl["inline_eval_s"]) / (ts["steps"] - 1), 4
    )
    both_end = min(parley["total_s"], trl["total_s"])
    p_end, t_end = latest(parley["evals"], both_end), latest(trl["evals"], both_end)
    return {
        "recipe": peer["recipe"],
        "versions": peer.get("versions", {}),
        "device": peer.get("device", ""),
        "parley": {**ps, "total_s": round(parley["total_s"], 1), "evals": parley["evals"]},
        "trl": {
            **ts,
            "total_s": round(trl["total_s"], 1),
            "inline_eval_s": trl["inline_eval_s"],
            "evals": trl["evals"],
        },
        "speedup_trained_tokens_per_s": round(ps["trained_tokens_per_s"] / ts["trained_tokens_per_s"], 3),
        "speedup_signal_tokens_per_s": round(ps["signal_tokens_per_s"] / ts["signal_tokens_per_s"], 3),
        # the same batch a step (one group of n conversations) on both sides: the tokens/s ratio is this
        # times the ratio of trained tokens per step, which is what each policy chose to write
        "speedup_steps_per_s": round(ts["wall_s_per_step"] / ps["wall_s_per_step"], 3),
        "speedup_steps_per_s_without_trls_eval": round(ts["wall_s_per_step_without_eval"] / ps["wall_s_per_step"], 3),
        # parley's eval runs beside its steps on an engine of its own; TRL's between its steps: the
        # ratio against TRL's steps alone is the lower bound, what a TRL user evaluating elsewhere would see
        "speedup_trained_tokens_per_s_without_trls_eval": round(
            ps["trained_tokens_per_s"] * ts["wall_s_per_step_without_eval"] / ts["trained_tokens_per_step"], 3
        ),
        "runs": {
            "parley_launched": clock.get("parley_start_local", ""),
            "seed": clock.get("seed", 0),
            "parley_timed_by": timed_by,
            "parley_sets": clock.get("parley_sets", ""),
            "trl_launched_unix": trl_clock["trl_start"],
            "same_call": trl_out is None,
        },
        "goal": f"parley >= {GOAL}x TRL's trained tokens/s at equal or better held-out {METRIC}",
        "at_equal_wall_time": at_equal_wall_time(parley["evals"], trl["evals"]),
        "at_equal_training_time": at_equal_training_time(parley, trl),
        "at_trls_last_version": at_trls_last_version(parley, trl),
        "parley_breakdown": parley["breakdown"],
        "parley_startup": parley["startup"],
        "at_the_shorter_run_s": {
            "t_s": round(both_end, 1),
            "parley": None if p_end is None else {"version": p_end["version"], METRIC: p_end[METRIC]},
            "trl": None if t_end is None else {"version": t_end["version"], METRIC: t_end[METRIC]},
        },
        "settings": parley_settings(peer["settings"], clock, peer["recipe"].get("behaviour_correction")),
    }


def parley_settings(rows: list[dict], clock: dict, recipe_correction: str | None = None) -> list[dict]:
    """peer_trl.py's settings table (the shared recipe as both read it) with what part P gave parley
    alone (p_clock.json: PARLEY_SETS and ACTORS, recorded since 2026-12-03): the engines row names the
    actors that ran, the policy-lag, vLLM-compilation, clip-range and behaviour-mismatch rows the lag, the
    engines' compilation and the behaviour correction parley ran with (`recipe_correction`: the one the
    recipe gave both), and a last row lists the parley-only settings."""
    rows = [dict(r) for r in rows]
    if "actors" in clock:
        for r in rows:
            if r["setting"] == "engines":
                r["parley"] = re.sub(r"^\d+ actor", f"{clock['actors']} actor", r["parley"])
    sets = parley_sets(clock.get("parley_sets") or "")
    if "learner.max_staleness" in sets:  # the recipe's lag row would name the shared value, not parley's
        n = int(sets["learner.max_staleness"])
        for r in rows:
            if r["setting"] == "policy lag":
                r["parley"] = re.sub(r"max_staleness = \d+", f"max_staleness = {n} (PARLEY_SETS)", r["parley"])
                r["same"] = "no" if n else "yes"
    if sets.get("actor.engine.torch_compile") == "false":  # the recipe's row names vLLM's compiled default
        for r in rows:
            if r["setting"] == "vLLM compilation":
                r["parley"] = "no torch.compile, full CUDA graphs of decode steps only (PARLEY_SETS)"
                r["same"] = "no: parley's engines start sooner"
    mode = sets.get("learner.behaviour_correction", "").strip('"')
    if mode and mode != recipe_correction:  # the recipe's rows name the correction both were given
        rows = _parley_correction(rows, mode, sets)
    if clock.get("parley_sets"):
        rows.append(
            {
                "setting": "parley only (PARLEY_SETS, not in TRL's run)",
                "parley": clock["parley_sets"],
                "trl": "-",
                "same": "no",
            }
        )
    if clock.get("parley_steps") not in (None, clock.get("trl_steps")):  # PARLEY_STEPS: for equal wall time
        rows.append(
            {
                "setting": "steps (PARLEY_STEPS)",
                "parley": str(clock["parley_steps"]),
                "trl": str(clock.get("trl_steps")),
                "same": "no",
            }
        )
    return rows


def parley_sets(text: str) -> dict[str, str]:
    """PARLEY_SETS ("KEY=VALUE KEY=VALUE", split on spaces as part P's shell loop splits it) as a dict."""
    return dict(kv.split("=", 1) for kv in text.split())


def _parley_correction(rows: list[dict], mode: str, sets: dict[str, str]) -> list[dict]:
    """The clip-range and behaviour-mismatch rows with parley's cells for the `mode` PARLEY_SETS gave it
    (the recipe's config under those settings, described by bench/peer_trl.py); TRL's cells stay those of
    the correction it ran, and the rows say "no" where parley's differs from it."""
    from bench import peer_trl

    keys = ("behaviour_correction", "clip_low", "clip_high", "dual_clip", "is_cap")  # what the two cells read
    lc = peer_trl.load_recipe(
        None, [f"learner.{k}={sets[f'learner.{k}']}" for k in keys if f"learner.{k}" in sets]
    ).learner
    cells = dict(zip(("clip range", "behaviour mismatch"), peer_trl.parley_correction(lc)))
    out = []
    for r in rows:
        if r["setting"] in cells:
            r = {
                **r,
                "parley": f"{cells[r['setting']]} (PARLEY_SETS: behaviour_correction = {mode})",
                "same": "no: parley ran another behaviour correction (PARLEY_SETS)",
            }
        out.append(r)
    return out


def _cell(side: dict | None) -> str:
    return "-" if side is None else f"v{side['version']} {side[METRIC]:.3f}"


def _at_trls_end_line(a: dict) -> str:
    if a["t_s"] is None:
        return f"held-out {METRIC} at equal training time: TRL recorded no held-out result"
    diff = "-" if a["difference"] is None else f"{a['difference']:+.3f}"
    return (
        f"held-out {METRIC} at equal training time, {a['t_s']:.1f} s after each one's step 1 (the end of TRL's "
        f"last evaluated step): parley {_cell(a['parley'])}, TRL {_cell(a['trl'])}, parley - TRL {diff}"
    )


def render(res: dict) -> str:
    p, t = res["parley"], res["trl"]
    lines = [
        "| | parley | TRL |",
        "|---|---|---|",
        f"| trained tokens/s (steps 2..N) | {p['trained_tokens_per_s']:,.0f} | {t['trained_tokens_per_s']:,.0f} |",
        f"| trained tokens of groups with differing rewards /s | {p['signal_tokens_per_s']:,.0f} | "
        f"{t['signal_tokens_per_s']:,.0f} |",
        f"| wall s/step (steps 2..N) | {p['wall_s_per_step']:.3f} | {t['wall_s_per_step']:.3f} "
        f"({t['wall_s_per_step_without_eval']:.3f} without its inline eval) |",
        f"| trained tokens a step (steps 2..N) | {p['trained_tokens_per_step']:,.0f} | {t['trained_tokens_per_step']:,.0f} |",
        f"| end of step 1 (start-up) s | {p['first_step_end_s']:.1f} | {t['first_step_end_s']:.1f} |",
        f"| steps, total wall s | {p['steps']}, {p['total_s']:.1f} | {t['steps']}, {t['total_s']:.1f} |",
        f"| held-out {METRIC}, last | {_cell(p['evals'][-1] if p['evals'] else None)} | "
        f"{_cell(t['evals'][-1] if t['evals'] else None)} |",
        "",
        f"parley / TRL trained tokens/s: {res['speedup_trained_tokens_per_s']:.2f}x (goal: {GOAL}x); "
        f"counting only groups with differing rewards: {res['speedup_signal_tokens_per_s']:.2f}x; "
        f"against TRL's steps without its inline eval: {res['speedup_trained_tokens_per_s_without_trls_eval']:.2f}x"
        + ("" if res["runs"]["same_call"] else " (TRL's run from another device call: --trl-out)"),
        f"parley / TRL steps/s, one group a step on both: {res['speedup_steps_per_s']:.2f}x "
        f"({res['speedup_steps_per_s_without_trls_eval']:.2f}x against TRL's steps without its inline eval); "
        "the tokens/s ratio is this times the ratio of trained tokens a step, which each policy's replies set",
        "",
        f"| s since launch | parley {METRIC} | TRL {METRIC} |",
        "|---|---|---|",
        *(f"| {r['t_s']:.1f} | {_cell(r['parley'])} | {_cell(r['trl'])} |" for r in res["at_equal_wall_time"]),
        "",
        f"| s since each one's step 1 ended | parley {METRIC} | TRL {METRIC} |",
        "|---|---|---|",
        *(f"| {r['t_s']:.1f} | {_cell(r['parley'])} | {_cell(r['trl'])} |" for r in res["at_equal_training_time"]),
        "",
        *([_at_trls_end_line(res["at_trls_last_version"]), ""] if res.get("at_trls_last_version") else []),
        "parley's steps 2..N (medians): " + ", ".join(f"{k} {v}" for k, v in res["parley_breakdown"].items()),
        "",
        *(
            [
                "parley's roles ready, s from their launch: "
                + ", ".join(f"{k} {v}" for k, v in res["parley_startup"].get("roles_ready_s", {}).items())
                + f"; all {res['parley_startup'].get('all_ready_s', '-')} (step 1 ended {p['first_step_end_s']:.1f} s "
                "after parley's launch)",
                *(
                    [
                        "parley up's start-up lines, s from its launch: "
                        + ", ".join(f"{k} {v}" for k, v in res["parley_startup"]["since_launch_s"].items())
                    ]
                    if "since_launch_s" in res["parley_startup"]
                    else []
                ),
                "",
            ]
            if res.get("parley_startup")
            else []
        ),
        "| setting | parley | TRL | same |",
        "|---|---|---|---|",
        *(f"| {r['setting']} | {r['parley']} | {r['trl']} | {r['same']} |" for r in res["settings"]),
    ]
    return "\n".join(lines)


def over_seeds(outs: list[Path | tuple[Path, Path]], timed_by: str = "recorded") -> dict:
    """Part P calls of one command at several seeds (`SEED`), each compared as `compare` does: per call
    the seed, parley's settings, the trained-tokens ratio, s/step and both last held-out results; then
    the means and the paired differences of the last held-out result (parley - TRL, per seed). The goal
    counts as met by the means when the mean ratio is >= GOAL and the mean paired difference >= 0.
    An item (OUT, TRL_OUT) takes TRL's side from another call (`compare`'s `trl_out`: parley ran alone,
    TRL=0); its row says so (`same_call` false)."""
    rows = []
    for item in outs:
        out, trl_out = item if isinstance(item, tuple) else (item, None)
        res = compare(out, trl_out, timed_by)
        p_last, t_last = res["parley"]["evals"][-1], res["trl"]["evals"][-1]
        rows.append(
            {
                "out": str(out),
                "trl_out": str(trl_out or out),
                "same_call": res["runs"]["same_call"],
                "seed": res["runs"]["seed"],
                "parley_sets": res["runs"]["parley_sets"],
                "ratio": res["speedup_trained_tokens_per_s"],
                "signal_ratio": res["speedup_signal_tokens_per_s"],
                "ratio_without_trls_eval": res["speedup_trained_tokens_per_s_without_trls_eval"],
                "parley_s_per_step": res["parley"]["wall_s_per_step"],
                "trl_s_per_step": res["trl"]["wall_s_per_step"],
                "steps_ratio": res["speedup_steps_per_s"],
                "steps_ratio_without_trls_eval": res["speedup_steps_per_s_without_trls_eval"],
                "parley_tokens_per_step": res["parley"]["trained_tokens_per_step"],
                "trl_tokens_per_step": res["trl"]["trained_tokens_per_step"],
                "parley_last": {"version": p_last["version"], METRIC: p_last[METRIC]},
                "trl_last": {"version": t_last["version"], METRIC: t_last[METRIC]},
                "difference": round(p_last[METRIC] - t_last[METRIC], 4),
                "at_trls_end": res["at_trls_last_version"],
            }
        )
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    # at equal training time: the calls where parley had trained an evaluated version by TRL's last one
    at_end = [r["at_trls_end"] for r in rows if r["at_trls_end"]["difference"] is not None]
    means = {
        "ratio": mean([r["ratio"] for r in rows]),
        "signal_ratio": mean([r["signal_ratio"] for r in rows]),
        "ratio_without_trls_eval": mean([r["ratio_without_trls_eval"] for r in rows]),
        "steps_ratio": mean([r["steps_ratio"] for r in rows]),
        "steps_ratio_without_trls_eval": mean([r["steps_ratio_without_trls_eval"] for r in rows]),
        "parley_last": mean([r["parley_last"][METRIC] for r in rows]),
        "trl_last": mean([r["trl_last"][METRIC] for r in rows]),
        "difference": mean([r["difference"] for r in rows]),
        "parley_at_trls_end": mean([a["parley"][METRIC] for a in at_end]),
        "trl_at_trls_end": mean([a["trl"][METRIC] for a in at_end]),
        "difference_at_trls_end": mean([a["difference"] for a in at_end]),
        "calls_at_trls_end": len(at_end),
    }
    return {
        "calls": rows,
        "means": means,
        "seeds": sorted({r["seed"] for r in rows}),
        "parley_timed_by": timed_by,
        # the same settings in another order are the same run
        "parley_sets": sorted(
            {" ".join(f"{k}={v}" for k, v in sorted(parley_sets(r["parley_sets"]).items())) for r in rows}
        ),
        "goal": f"parley >= {GOAL}x TRL's trained tokens/s at equal or better held-out {METRIC}, by the means over seeds",
        "goal_met_by_the_means": means["ratio"] >= GOAL and means["difference"] >= 0,
        # the issue's own terms: the held-out reward at equal wall time (each one's training time, read at
        # the end of TRL's last evaluated step), in every call
        "goal_met_at_equal_training_time": (
            means["ratio"] >= GOAL and len(at_end) == len(rows) and means["difference_at_trls_end"] >= 0
        ),
    }


def render_seeds(res: dict) -> str:
    lines = [
        f"| seed | parley / TRL trained tokens/s (groups with differing rewards; TRL without its eval) | "
        "s/step parley / TRL | steps/s ratio (TRL without its eval) | trained tokens a step parley / TRL | "
        f"held-out {METRIC}, last: parley | TRL | parley - TRL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["calls"]:
        lines.append(
            f"| {r['seed']} | {r['ratio']:.2f}x ({r['signal_ratio']:.2f}x; {r['ratio_without_trls_eval']:.2f}x) | "
            f"{r['parley_s_per_step']:.3f} / "
            f"{r['trl_s_per_step']:.3f} | {r['steps_ratio']:.2f}x ({r['steps_ratio_without_trls_eval']:.2f}x) | "
            f"{r['parley_tokens_per_step']:,.0f} / {r['trl_tokens_per_step']:,.0f} | "
            f"{_cell(r['parley_last'])} | {_cell(r['trl_last'])} | {r['difference']:+.3f} |"
        )
    m = res["means"]
    lines += [
        "",
        f"means over {len(res['calls'])} calls: {m['ratio']:.2f}x ({m['signal_ratio']:.2f}x; "
        f"{m['ratio_without_trls_eval']:.2f}x against TRL without its eval) trained tokens/s, "
        f"{m['steps_ratio']:.2f}x ({m['steps_ratio_without_trls_eval']:.2f}x) steps/s, held-out "
        f"{METRIC} {m['parley_last']:.3f} against {m['trl_last']:.3f} (paired difference {m['difference']:+.3f}); "
        f"goal met by the means: {res['goal_met_by_the_means']}",
    ]
    if m.get("calls_at_trls_end") is not None:
        lines.append(
            f"at equal training time (each call read at the end of TRL's last evaluated step, counted from each "
            f"one's step 1, with the latest evaluated version each had trained by then; "
            f"{m['calls_at_trls_end']} of {len(res['calls'])} calls with a parley version by then): "
            + (
                "no call"
                if not m["calls_at_trls_end"]
                else f"{METRIC} {m['parley_at_trls_end']:.3f} against {m['trl_at_trls_end']:.3f} "
                f"(paired difference {m['difference_at_trls_end']:+.3f}); per call "
                + ", ".join(
                    f"seed {r['seed']} {_cell(r['at_trls_end']['parley'])} / {_cell(r['at_trls_end']['trl'])}"
                    for r in res["calls"]
                )
            )
            + f"; goal met at equal training time: {res['goal_met_at_equal_training_time']}"
        )
    apart = [r for r in res["calls"] if not r["same_call"]]
    if apart:
        lines.append(
            f"note: TRL's side of seed(s) {', '.join(str(r['seed']) for r in apart)} comes from another call "
            "(parley ran alone): its held-out results are TRL's at that seed on that kind of GPU, "
            "its ratio carries the machine's noise between calls"
        )
    if len(res["parley_sets"]) > 1:
        lines.append(
            "note: the calls ran different parley settings (PARLEY_SETS): "
            + " | ".join(repr(x) for x in res["parley_sets"])
        )
    return "\n".join(lines)


# ---- time to target (issue 56 item 4): the headline --------------------------------------------

# the held-out column each environment is judged by, and issue 56's target reward on it
ENV_METRIC = {"hidden_goal": "goal_match", "random_words": "low_share"}
TARGETS = {"goal_match": 0.8, "low_share": 0.55}
GOAL_TIME_RATIO = 0.67  # issue 56: parley's time to target at most 0.67x TRL's (1.5x faster)
MIN_PAIRS = 5  # issue 56: the median over at least 5 paired seeds


def same_card(clock: dict, trl_clock: dict, out: Path, trl_out: Path | None, *, strict: bool = False) -> None:
    """A pair is compared only within one machine: TRL's side from another call must have run on the
    same GPU (p_clock.json's gpu_uuid, recorded by part P since issue 56). ValueError when the two
    differ, or, `strict` (time to target), when either call recorded none."""
    if trl_out is None or trl_out == out:
        return
    a, b = clock.get("gpu_uuid"), trl_clock.get("gpu_uuid")
    if a and b and a != b:
        raise ValueError(
            f"{out} ran on GPU {a} ({clock.get('gpu_name', '?')}) but its TRL side {trl_out} on {b} "
            f"({trl_clock.get('gpu_name', '?')}): a pair is compared only within one machine; pair each with "
            "a call of its own machine"
        )
    if strict and not (a and b):
        raise ValueError(
            f"{out} and its TRL side {trl_out} are separate calls and {'neither' if not (a or b) else 'one'} "
            "recorded its GPU (p_clock.json gpu_uuid): pair a call only with TRL from its own call, or rerun "
            "with this part P"
        )


def staged_bytecode(clock: dict) -> bool:
    """Whether the call's site had its Python bytecode (p_clock.json "bytecode", recorded by bench/gpu_run.sh
    since 2026-12-07). A call from before then recorded nothing and had none: the device writes no bytecode
    at import and the site was staged without it (docs/gpu.md, "Bytecode on the device")."""
    return bool(clock.get("bytecode", False))


def unpack(path: Path) -> Path:
    """A run folder, or part PS's packed seed (p_s<SEED>.tgz) unpacked into a folder of its own."""
    path = Path(path)
    if path.is_dir():
        return path
    if not path.is_file() or not path.name.endswith((".tgz", ".tar.gz")):
        raise ValueError(f"{path}: neither a run folder nor a packed seed (.tgz) of bench/gpu_run.sh PS")
    import tarfile
    import tempfile

    dest = Path(tempfile.mkdtemp(prefix=f"peer_{path.name.split('.')[0]}_"))
    with tarfile.open(path) as tar:
        tar.extractall(dest, filter="data")
    return dest


def time_to_target(evals: list[dict], target: float, metric: str) -> dict | None:
    """The first held-out result, in the order they came in, at or above `target`: {t_s (since
    launch), version, metric}; None when no result reached it."""
    for e in sorted(evals, key=lambda e: e["t_result"]):
        if e[metric] >= target:
            return {"t_s": round(e["t_result"], 1), "version": e["version"], metric: e[metric]}
    return None


def reward_at(evals: list[dict], t: float, metric: str) -> float | None:
    """The latest held-out result in by `t` (seconds since launch), or None."""
    e = latest(evals, t)
    return None if e is None else e[metric]


def eval_free(side: dict, version: int | None) -> float | None:
    """When `version`'s training step ended, less the held-out eval work the side did on its training
    path before it (side["inline_evals"]): TRL's in-process evals, parley's weights written for its
    eval child and their export. A secondary figure, as if evaluating took no time and nothing else
    moved: it answers a skeptic's "the peer loses by its evals", not the user's wall time."""
    if version is None:
        return None
    ends = {s["step"]: s["t"] for s in side["steps"]}
    t = ends.get(version, 0.0 if version == 0 else None)
    if t is None:
        return None
    cost = sum(sec for at, sec, inside in side.get("inline_evals", []) if at < t or (inside and at <= t))
    return round(t - cost, 1)


def target_side(side: dict, target: float, metric: str, gpus: int = 1) -> dict:
    """One side of a pair: time to target from launch, its end (its last held-out result) and the
    result there, GPU-seconds and sampled tokens to target (all played groups: parley's dropped and
    stale ones too), trained tokens/s from the end of step 1 as a secondary figure."""
    evals = sorted(side["evals"], key=lambda e: e["t_result"])
    hit = time_to_target(evals, target, metric)
    t = hit["t_s"] if hit else None
    end = evals[-1] if evals else None
    end_s = round(end["t_result"], 1) if end else None
    st = steady(side["steps"]) if len(side["steps"]) >= 2 else None
    return {
        "time_to_target_s": t,
        "target_version": hit["version"] if hit else None,
        "end_s": end_s,
        "at_end": end[metric] if end else None,
        "end_version": end["version"] if end else None,
        "gpus": gpus,
        "gpu_s_to_target": None if t is None else round(t * gpus, 1),
        "generated_tokens_to_target": tokens_by(side.get("generated", []), t),
        "generated_tokens_to_end": tokens_by(side.get("generated", []), end_s),
        "trained_tokens_per_s": st["trained_tokens_per_s"] if st else None,
        "launch_to_step1_s": st["first_step_end_s"] if st else None,
        # parley: its steps flagged for a behaviour gap, and how many steps it recorded (TRL: none kept)
        "behaviour_gap_steps": side.get("behaviour_gap_steps"),
        "steps": len(side["steps"]),
        # the same two times from the target's (end's) training step, less the evals on the path (eval_free)
        "eval_free_time_to_target_s": eval_free(side, hit["version"]) if hit else None,
        "eval_free_end_s": eval_free(side, end["version"]) if end else None,
        # the first held-out result in hand (parley: its eval child's first; TRL: its inline v0)
        "first_result_s": round(evals[0]["t_result"], 1) if evals else None,
        "evals": [[round(e["t_result"], 1), e["version"], e[metric]] for e in evals],
    }


def reached(p: float | None, q: float | None) -> str:
    return {(True, True): "both", (True, False): "parley", (False, True): "trl", (False, False): "neither"}[
        (p is not None, q is not None)
    ]


def target_pair(out: Path, trl_out: Path | None, target: float | None, timed_by: str = "recorded") -> dict:
    """One seed's pair, parley from `out` and TRL from `trl_out` (default: the same call), read from
    launch: each one's time to `target` (default: TARGETS for the environment's metric), the held-out
    result each had at the other's end, GPU-seconds and sampled tokens to target."""
    clock, peer, trl_clock = _pair_files(out, trl_out)
    same_card(clock, trl_clock, out, trl_out, strict=True)
    bytecode = staged_bytecode(clock)
    if staged_bytecode(trl_clock) != bytecode:
        raise ValueError(
            f"{out} ran {'with' if bytecode else 'without'} Python bytecode in its site but its TRL side "
            f"{trl_out} {'without' if bytecode else 'with'} (p_clock.json bytecode): launches differ by seconds "
            "a process; pair each call with TRL from its own call"
        )
    metric = ENV_METRIC.get(peer["recipe"].get("env"), METRIC)
    target = TARGETS.get(metric) if target is None else target
    if target is None:
        raise ValueError(f"no target for {metric}: give --target")
    parley = parley_side(out, clock, timed_by, metric)
    trl = trl_side(peer, trl_clock["trl_start"], metric)
    p = target_side(parley, target, metric, clock.get("gpus", 1))
    q = target_side(trl, target, metric, trl_clock.get("gpus", 1))
    how = reached(p["time_to_target_s"], q["time_to_target_s"])
    p_at_q_end = None if q["end_s"] is None else reward_at(parley["evals"], q["end_s"], metric)
    q_at_p_end = None if p["end_s"] is None else reward_at(trl["evals"], p["end_s"], metric)
    row = {
        "out": str(out),
        "trl_out": str(trl_out or out),
        "same_call": trl_out is None or trl_out == out,
        "seed": clock.get("seed", 0),
        "card": {"name": clock.get("gpu_name") or peer.get("device", ""), "uuid": clock.get("gpu_uuid")},
        "parley_launched": clock.get("parley_start_local", ""),
        "parley_sets": clock.get("parley_sets", ""),
        "trl_options": clock.get("trl_options", ""),
        "bytecode": bytecode,
        # a digest of parley's sources as the call ran them (gpu_run.sh part P); "" for a call from before
        "code": clock.get("code", ""),
        "metric": metric,
        "target": target,
        "reached": how,
        "ratio": round(p["time_to_target_s"] / q["time_to_target_s"], 4) if how == "both" else None,
        "parley": p,
        "trl": q,
        "parley_at_trls_end": p_at_q_end,
        "difference_at_trls_end": None
        if p_at_q_end is None or q["at_end"] is None
        else round(p_at_q_end - q["at_end"], 4),
        "trl_at_parleys_end": q_at_p_end,
    }
    b = ratio_bounds(row)
    # [at least, at most] (None: no upper bound), or None where neither reached the target
    row["ratio_bounds"] = None if b is None else [_finite(b[0]), _finite(b[1])]
    e = eval_free_bounds(row)
    row["eval_free_ratio_bounds"] = None if e is None else [_finite(e[0]), _finite(e[1])]
    return row


def eval_free_bounds(row: dict) -> tuple[float, float] | None:
    """ratio_bounds over each side's eval-free times (eval_free)."""

    def side(x: dict) -> dict:
        return {"time_to_target_s": x.get("eval_free_time_to_target_s"), "end_s": x.get("eval_free_end_s")}

    return ratio_bounds({"parley": side(row["parley"]), "trl": side(row["trl"])})


def median(xs: list[float]) -> float | None:
    """The median (the mean of the middle two for an even count; inf allowed), None for no values."""
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _finite(x: float | None) -> float | None:
    return None if x is None or x == float("inf") else round(x, 4)


def ratio_bounds(row: dict) -> tuple[float, float] | None:
    """What one seed says of parley / TRL time to target, as (at least, at most); inf for no upper
    bound, None where neither side reached the target (the seed says nothing of the ratio). A side that
    did not reach it is censored at its last held-out result (`end_s`): its time to target is later
    than that, if it comes at all. So where only parley reached the target, the ratio is below parley's
    time over TRL's end (a TRL run that ended early bounds it only weakly), and where only TRL did, it
    is above parley's end over TRL's time."""
    p, q = row["parley"], row["trl"]
    pt, qt = p["time_to_target_s"], q["time_to_target_s"]
    inf = float("inf")
    if pt is not None and qt is not None:
        return (pt / qt, pt / qt) if qt > 0 else (inf, inf)
    if pt is not None:
        return (0.0, pt / q["end_s"] if q.get("end_s") else inf)
    if qt is not None:
        return (p["end_s"] / qt if p.get("end_s") and qt > 0 else 0.0, inf)
    return None


def launch_stats(rows: list[dict]) -> dict:
    """Issue 56's launch goal over paired seeds: launch to the end of step 1, each side's median and the
    median of parley - TRL over the seeds where both sides have it (the goal: <= 0, parley no slower,
    over at least MIN_PAIRS seeds), and in how many of them parley was no slower. Empty where no seed
    has both."""
    pairs = [
        (r["parley"].get("launch_to_step1_s"), r["trl"].get("launch_to_step1_s"))
        for r in rows
        if r["parley"].get("launch_to_step1_s") is not None and r["trl"].get("launch_to_step1_s") is not None
    ]
    if not pairs:
        return {}
    diff = median([p - q for p, q in pairs])
    return {
        "launch_to_step1_s": {
            "seeds": len(pairs),
            "parley_median": _finite(median([p for p, _ in pairs])),
            "trl_median": _finite(median([q for _, q in pairs])),
            "paired_difference_median": _finite(diff),
            "parley_no_slower_in": sum(p <= q for p, q in pairs),
            "goal_met": len(pairs) >= MIN_PAIRS and diff <= 0,
        }
    }


def target_stats(rows: list[dict]) -> dict:
    """The headline over paired seeds, from each row's `reached`, both sides' times to target and ends
    (ratio_bounds) and `difference_at_trls_end`: the median ratio at least (each seed at its lower
    bound) and at most (each at its upper bound); they are equal when both sides reached the target
    in every counted seed. A seed where neither did is left out of the ratio (it says nothing there).
    The goal is judged on the upper bound: at least MIN_PAIRS seeds counted, median ratio at most
    <= GOAL_TIME_RATIO, median held-out difference at TRL's end >= 0 (over the seeds that have one).
    A side that stops before the other reaches the target thus cannot win the goal by stopping."""
    inf = float("inf")
    bounds = [b for b in map(ratio_bounds, rows) if b is not None]
    low, high = median([b[0] for b in bounds]), median([b[1] for b in bounds])
    p_times = [inf if r["parley"]["time_to_target_s"] is None else r["parley"]["time_to_target_s"] for r in rows]
    q_times = [inf if r["trl"]["time_to_target_s"] is None else r["trl"]["time_to_target_s"] for r in rows]
    diffs = [r["difference_at_trls_end"] for r in rows if r["difference_at_trls_end"] is not None]
    m_diff = median(diffs)
    free = [b for b in (r.get("eval_free_ratio_bounds") for r in rows) if b is not None]
    free = [(lo, inf if hi is None else hi) for lo, hi in free]
    return {
        **launch_stats(rows),
        # the secondary figure: the same medians over eval-free times (eval_free); not the goal's
        "eval_free": {
            "seeds_counted": len(free),
            "median_ratio_at_least": _finite(median([b[0] for b in free])),
            "median_ratio_at_most": _finite(median([b[1] for b in free])),
        },
        "seeds": len(rows),
        "seeds_counted": len(bounds),
        "reached": {k: sum(r["reached"] == k for r in rows) for k in ("both", "parley", "trl", "neither")},
        # the exact median where every counted seed has both times, else None (see the bounds)
        "median_ratio": _finite(low) if low == high else None,
        "median_ratio_is_infinite": low == high == inf,
        "median_ratio_at_least": _finite(low),
        "median_ratio_at_most": _finite(high),
        "median_ratio_at_most_is_infinite": high == inf,
        "median_parley_time_to_target_s": _finite(median(p_times)),
        "median_trl_time_to_target_s": _finite(median(q_times)),
        "median_difference_at_trls_end": _finite(m_diff),
        "goal_met": len(bounds) >= MIN_PAIRS
        and high is not None
        and high <= GOAL_TIME_RATIO
        and m_diff is not None
        and m_diff >= 0,
    }


def earlier_pairs(path: Path) -> list[dict]:
    """The pairs of a comparison this script wrote with --target --json: seeds of an earlier session,
    whose packed files may be gone, pooled under the same checks as freshly read ones."""
    try:
        res = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a comparison written by --target --json ({e})") from e
    pairs = res.get("pairs") if isinstance(res, dict) else None
    if (
        not isinstance(pairs, list)
        or not pairs
        or "metric" not in res
        or not all(isinstance(r, dict) and "ratio" in r for r in pairs)
    ):
        raise ValueError(
            f"{path} holds no time-to-target pairs: give a JSON written by peer_compare.py --target --json, "
            "or the calls' folders or .tgz files"
        )
    return pairs


def over_targets(outs: list[Path | tuple[Path, Path]], target: float | None, timed_by: str = "recorded") -> dict:
    """Paired seeds from any number of calls and sessions (folders or part PS's .tgz files, or the pairs
    of an earlier --target --json: earlier_pairs): one row a seed (target_pair), then target_stats. Pairs
    differ in machine, never within one."""
    rows = []
    for item in outs:
        given, trl_given = item if isinstance(item, tuple) else (item, None)
        if trl_given is None and str(given).endswith(".json"):  # an earlier comparison's pairs, as written
            earlier = earlier_pairs(Path(given))
            if target is not None and any(r["target"] != target for r in earlier):
                raise ValueError(
                    f"{given} was read at target {earlier[0]['target']}, not the {target} given: its pairs keep "
                    "the target they were read at (rerun over the calls' files for another)"
                )
            rows.extend(earlier)
            continue
        out, trl_out = unpack(given), None if trl_given is None else unpack(trl_given)
        try:
            rows.append(target_pair(out, trl_out, target, timed_by))
        except ValueError as e:  # name the files as given, not the folders they were unpacked into
            named = {str(out): str(given), **({} if trl_out is None else {str(trl_out): str(trl_given)})}
            raise ValueError(re.sub("|".join(map(re.escape, named)), lambda m: named[m.group(0)], str(e))) from e
    metrics = {(r["metric"], r["target"]) for r in rows}
    if len(metrics) > 1:
        raise ValueError(f"the seeds were read by different metrics or targets {sorted(metrics)}: one table each")
    kinds = {r["bytecode"]: r["seed"] for r in rows}
    if len(kinds) > 1:
        raise ValueError(
            f"seed {kinds[True]} ran with Python bytecode in its site and seed {kinds[False]} without "
            "(p_clock.json bytecode): launches differ by seconds a process, so they are not pooled; one table each"
        )
    codes = {r.get("code", ""): r["seed"] for r in rows}
    if len(codes) > 1:
        (a, sa), (b, sb) = list(codes.items())[:2]
        raise ValueError(
            f"seeds {sa} and {sb} ran different parley code (p_clock.json code {a or 'unrecorded'!r} and "
            f"{b or 'unrecorded'!r}): a speed claim is one version's; one table each"
        )
    arms: dict[str, int] = {}
    for r in rows:  # parley's settings, in any order: one arm a table
        key = " ".join(f"{k}={v}" for k, v in sorted(parley_sets(r.get("parley_sets") or "").items()))
        arms.setdefault(key, r["seed"])
    if len(arms) > 1:
        (a, sa), (b, sb) = list(arms.items())[:2]
        raise ValueError(
            f"seeds {sa} and {sb} ran parley with different settings (p_clock.json parley_sets {a!r} and "
            f"{b!r}): two arms, not one sample; one table each"
        )
    seeds = [r["seed"] for r in rows]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"seed(s) {sorted({s for s in seeds if seeds.count(s) > 1})} given twice: one pair a seed")
    metric, tgt = metrics.pop() if metrics else (METRIC, target)
    return {
        "question": f"wall time from launch to held-out {metric} >= {tgt}, parley against TRL, paired by seed",
        "metric": metric,
        "target": tgt,
        "goal": f"median over >= {MIN_PAIRS} paired seeds of parley / TRL time to target <= {GOAL_TIME_RATIO}, "
        f"and held-out {metric} at TRL's end >= TRL's (median paired difference >= 0)",
        "pairs": rows,
        **target_stats(rows),
    }


def _t(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _ratio_cell(r: dict) -> str:
    """A seed's parley / TRL ratio: exact where both reached the target, else its bound and who reached it."""
    if r["ratio"] is not None:
        return f"{r['ratio']:.2f}x"
    b = r.get("ratio_bounds")
    if r["reached"] == "parley" and b and b[1] is not None:
        return f"< {b[1]:.2f}x (parley reached)"
    if r["reached"] == "trl" and b and b[0]:
        return f"> {b[0]:.2f}x (trl reached)"
    return f"- ({r['reached']} reached)"


def render_targets(res: dict) -> str:
    m = res["metric"]
    lines = [
        f"time from launch to held-out {m} >= {res['target']} (s), parley / TRL, paired by seed; each pair on one GPU",
        "",
        f"| seed | card | to target s parley / TRL | ratio | {m} at TRL's end parley / TRL | at parley's end "
        "parley / TRL | GPU-s to target | sampled tokens to target (parley: all played) | trained tokens/s | "
        "launch to step 1 s | first held-out result s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["pairs"]:
        p, q = r["parley"], r["trl"]
        ratio = _ratio_cell(r)
        lines.append(
            f"| {r['seed']} | {r['card']['name'] or '?'} | {_t(p['time_to_target_s'])} / {_t(q['time_to_target_s'])} | "
            f"{ratio} | {_r(r['parley_at_trls_end'])} / {_r(q['at_end'])} | {_r(p['at_end'])} / "
            f"{_r(r['trl_at_parleys_end'])} | {_t(p['gpu_s_to_target'])} / {_t(q['gpu_s_to_target'])} | "
            f"{_n(p['generated_tokens_to_target'])} / {_n(q['generated_tokens_to_target'])} | "
            f"{_t(p['trained_tokens_per_s'])} / {_t(q['trained_tokens_per_s'])} | "
            f"{_t(p['launch_to_step1_s'])} / {_t(q['launch_to_step1_s'])} | "
            f"{_t(p.get('first_result_s'))} / {_t(q.get('first_result_s'))} |"
        )
    if res["median_ratio"] is not None or res["median_ratio_is_infinite"]:
        ratio = "inf" if res["median_ratio_is_infinite"] else _r(res["median_ratio"])
    else:  # some seed is censored: the median lies between its bounds; the goal reads the upper one
        most = "inf" if res["median_ratio_at_most_is_infinite"] else _r(res["median_ratio_at_most"])
        ratio = f"between {_r(res['median_ratio_at_least'])} and {most}"
    lines += [
        "",
        f"median over {res['seeds_counted']} of {res['seeds']} seeds (reached by both {res['reached']['both']}, "
        f"parley only {res['reached']['parley']}, TRL only {res['reached']['trl']}, neither "
        f"{res['reached']['neither']}): parley / TRL time to target {ratio} (goal <= {GOAL_TIME_RATIO}); "
        f"median time parley {_t(res['median_parley_time_to_target_s'])} s, TRL "
        f"{_t(res['median_trl_time_to_target_s'])} s; {m} at TRL's end, parley - TRL "
        f"{'-' if res['median_difference_at_trls_end'] is None else format(res['median_difference_at_trls_end'], '+.3f')}"
        f"; goal met: {res['goal_met']}"
        + ("" if res["seeds_counted"] >= MIN_PAIRS else f" (fewer than {MIN_PAIRS} seeds counted)"),
    ]
    free = res.get("eval_free")
    if free and free["seeds_counted"]:
        lo, hi = free["median_ratio_at_least"], free["median_ratio_at_most"]
        ratio = _r(lo) if lo == hi else f"between {_r(lo)} and {'inf' if hi is None else _r(hi)}"
        lines.append(
            f"eval-free (each side's target step, less the held-out eval work on its training path; not the "
            f"goal): median parley / TRL {ratio} over {free['seeds_counted']} seeds"
        )
    for r in res["pairs"]:
        flagged = r["parley"].get("behaviour_gap_steps")
        if flagged:
            lines.append(
                f"seed {r['seed']}: {len(flagged)} of {r['parley']['steps']} parley steps had behaviour log-probs "
                f"more than {GAP_ALARM:g} nats a token from the learner's (first at step {flagged[0]}): its actors "
                "sampled another model than the one trained, so the seed does not measure parley's learning "
                "([learner] behaviour_gap_alarm)"
            )
    launch = res.get("launch_to_step1_s")
    if launch:
        lines.append(
            f"launch to step 1 over {launch['seeds']} seeds: median parley {launch['parley_median']:.1f} s, TRL "
            f"{launch['trl_median']:.1f} s; paired parley - TRL median {launch['paired_difference_median']:+.1f} s, "
            f"parley no slower in {launch['parley_no_slower_in']} of {launch['seeds']} (goal <= 0: "
            f"{'met' if launch['goal_met'] else 'not met'})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="the folder bench/gpu_run.sh P wrote")
    where.add_argument(
        "--over",
        nargs="+",
        metavar="OUT",
        help="several such folders, one command at several seeds: a table and the means over them; "
        "OUT=TRL_OUT takes TRL's side from another call at the same seed (parley ran alone: TRL=0)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=ROOT / "bench" / "results" / "raw" / "peer_trl.json",  # raw output stays out of git
        help="where the comparison goes (default for --out: %(default)s; --over writes only where told)",
    )
    p.add_argument("--date", default="", help="the date of the run, recorded in the JSON")
    p.add_argument(
        "--trl-out",
        type=Path,
        default=None,
        help="take TRL's side (peer_trl.json, p_clock.json) from this folder of another part P call",
    )
    p.add_argument(
        "--timed-by",
        choices=TIMED_BY,
        default="recorded",
        help="parley's step ends: as its learner recorded them in metrics.jsonl (ended_at + publish_s; "
        "default), or its log lines, which come after the last step's checkpoint (how this "
        "script timed parley before 2026-12-05 evening, for the old figures)",
    )
    p.add_argument(
        "--target",
        type=float,
        nargs="?",
        const=-1.0,
        default=None,
        help="the headline of issue 56: time from launch to this held-out reward, paired by seed (--target alone: "
        f"the environment's, {TARGETS}); OUT may be a folder, part PS's p_s<SEED>.tgz, or a JSON an earlier "
        "--target --json wrote (its pairs are pooled with the rest)",
    )
    args = p.parse_args(argv)
    if args.target is not None:
        target = None if args.target == -1.0 else args.target
        if args.trl_out and args.over:
            p.error("--trl-out goes with --out (one parley call against another call's TRL)")
        if args.over:
            pairs = [o.partition("=") for o in args.over]
            items = [(Path(out), Path(trl)) if trl else Path(out) for out, _, trl in pairs]
        else:
            items = [(args.out, args.trl_out) if args.trl_out else args.out]
        try:
            res = over_targets(items, target, args.timed_by)
        except (ValueError, KeyError, FileNotFoundError) as e:
            p.error(f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e))
        print(render_targets(res))
        if args.json != p.get_default("json") or args.out:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"date": args.date, **res} if args.date else res, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0
    if args.over:
        if args.trl_out:
            p.error("--trl-out goes with --out (one parley call against another call's TRL)")
        pairs = [o.partition("=") for o in args.over]  # OUT or OUT=TRL_OUT
        items = [(Path(out), Path(trl)) if trl else Path(out) for out, _, trl in pairs]
        try:
            res = over_seeds(items, args.timed_by)
        except ValueError as e:  # a pair of calls at different seeds
            p.error(str(e))
        print(render_seeds(res))
        if args.json != p.get_default("json"):
            args.json.write_text(json.dumps({"date": args.date, **res} if args.date else res, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0
    try:
        res = compare(args.out, args.trl_out, args.timed_by)
    except ValueError as e:
        p.error(str(e))
    if args.date:
        res = {"date": args.date, **res}
    print(render(res))
    command = "bash bench/gpu_run.sh P; python bench/peer_compare.py --out OUT" + (
        " --trl-out OTHER_OUT" if args.trl_out else ""
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": command, **res}, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
