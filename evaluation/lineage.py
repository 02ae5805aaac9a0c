"""The lineage of one training sample, from the run directory alone (it outlives the run and its
NATS server): its prompt, every simulator and judge call with its answer, the policy version of each
turn, the score term by term, and the optimizer step that trained it or why it was dropped.

Sources, all written by the learner: the archive (a Parquet file of Scored per step and kind, which
holds the Trajectory and the judge's raw answers), trained.jsonl (which trajectories each step
trained, which groups left untrained since the previous step and why) and the ledger (each finished
task's kind and reason; the samples still buffered). The caller (deploy/cli_trace.py) finds them
with learner.checkpoint and passes them in, so this package reads no role's code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from parley.errors import ParleyError
from parley.evaluation.evallog import read_log
from parley.protocol import arrays
from parley.protocol.messages import ChatMessage, JudgeOutput, Scored
from parley.rewards.reward import weighted_terms
from parley.rollout.score import future_messages


class TraceError(ParleyError, LookupError):
    """The run directory does not know the trajectory (or holds nothing to trace)."""


@dataclass(frozen=True)
class LedgerView:
    """What trace needs of the learner's ledger (learner.checkpoint.LearnerState)."""

    step: int = 0
    done: dict[str, str] = field(default_factory=dict)  # task_id -> "trained" | "stale" | "timeout" | ...
    reasons: dict[str, str] = field(default_factory=dict)  # task_id -> why it was not trained
    buffered: list[Scored] = field(default_factory=list)  # received, not yet trained or dropped


@dataclass(frozen=True)
class Fate:
    """What the learner did with the sample."""

    kind: str  # "trained" | "dropped" | "buffered" | "unseen"
    step: int = -1  # trained: the optimizer step that used it (its update made version `step`)
    reason: str = ""  # dropped: why; "unseen": what is known of its task
    corrected: bool = False  # trained with the staleness correction (truncated importance sampling)


@dataclass(frozen=True)
class Lineage:
    traj_id: str
    scored: Scored | None  # None: the run directory holds no sample of it (only its task's fate)
    fate: Fate


def _step_lines(trained_log: Path) -> list[dict]:
    if not trained_log.is_file():
        return []
    out = []
    for line in trained_log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a kill: the resume truncation drops it too
            continue
    return out


def _task_of(traj_id: str) -> str:
    return traj_id.rsplit("/", 1)[0]


def _find_in(paths: Sequence[Path], traj_id: str) -> Scored | None:
    for p in paths:
        for rec in read_log(p):
            if isinstance(rec, Scored) and rec.traj_id == traj_id:
                return rec
    return None


def find(traj_id: str, archive: Path, trained_log: Path, ledger: LedgerView | None = None) -> Lineage:
    """The lineage of `traj_id` ("<task_id>/<sample>"). Raises TraceError when the run directory
    knows neither the trajectory nor its task."""
    task_id = _task_of(traj_id)
    ledger = ledger or LedgerView()
    lines = _step_lines(trained_log)
    # A resumed run trains steps again and rewrites their lines: the last mention is the one that holds.
    trained_at = next((ln for ln in reversed(lines) if traj_id in ln.get("traj_ids", ())), None)
    dropped_at = next((ln for ln in reversed(lines) if task_id in (ln.get("not_trained") or {})), None)
    files = sorted([*archive.glob("step*.parquet"), *archive.glob("dropped-*.parquet")]) if archive.is_dir() else []
    dropped_files = [p for p in files if p.name.startswith("dropped-")]  # numbered by ledger write, not step

    def archived(step: int, kind: str) -> Scored | None:
        if kind == "dropped":
            return _find_in(dropped_files, traj_id)
        name = f"step{step:06d}-{kind}.parquet"
        return _find_in([p for p in files if p.name == name], traj_id)

    if trained_at is not None:
        step = int(trained_at["step"])
        fate = Fate("trained", step=step, corrected=task_id in trained_at.get("corrected", ()))
        return Lineage(traj_id, archived(step, "trained"), fate)
    if dropped_at is not None:
        step = int(dropped_at["step"])
        fate = Fate("dropped", step=step, reason=dropped_at["not_trained"][task_id])
        return Lineage(traj_id, archived(step, "dropped"), fate)
    buffered = next((s for s in ledger.buffered if s.traj_id == traj_id), None)
    if buffered is not None:
        return Lineage(
            traj_id, buffered, Fate("buffered", reason=f"waiting in the learner's buffer at step {ledger.step}")
        )
    # Groups dropped after the last step are only in the ledger (and in the archive once a step follows).
    scored = _find_in(dropped_files, traj_id)
    if task_id in ledger.done:
        kind = ledger.done[task_id]
        reason = ledger.reasons.get(task_id, "")
        if kind == "trained":
            return Lineage(traj_id, scored, Fate("unseen", reason="its group was trained, but without this sample"))
        return Lineage(traj_id, scored, Fate("dropped", reason=f"{kind}: {reason}" if reason else kind))
    if scored is not None:
        return Lineage(traj_id, scored, Fate("dropped", reason="archived as dropped; the ledger gives no reason"))
    known = sorted({t for ln in lines for t in ln.get("traj_ids", ())})
    hint = f"; e.g. {', '.join(known[:3])}" if known else ""
    raise TraceError(
        f"trajectory {traj_id!r} is not in this run directory (archive {archive}, {trained_log.name}, ledger): "
        f"give an id as '<task_id>/<sample>'{hint}"
    )


# ---- rendering --------------------------------------------------------------------------------


def _text(s: str, width: int) -> str:
    s = s.replace("\n", " / ")
    return s if width <= 0 or len(s) <= width else s[: width - 1] + "…"


def _msg(m: ChatMessage, width: int) -> str:
    return f"[{m.role}] {_text(m.content, width)}"


def _judged(out: JudgeOutput, has_futures: bool) -> str:
    return f"future {out.conversation}" if has_futures else "the conversation"


def render(lin: Lineage, width: int = 300) -> str:
    """The lineage as text, top to bottom in the order things happened."""
    s, fate = lin.scored, lin.fate
    lines: list[str] = [f"trajectory {lin.traj_id}"]
    if s is None:
        lines.append("  no sample of it in the run directory (dead-lettered before scoring, or not yet archived)")
        lines += _fate_lines(fate, None)
        return "\n".join(lines)
    t = s.trajectory
    lines.append(
        f"  run {t.run}, item {t.item_id}, task {t.task_id} sample {t.sample}, mode {t.mode}; "
        f"policy {t.model or '?'} on actor {t.actor or '?'}, temperature {t.temperature:g}, top_p {t.top_p:g}, "
        f"seed {t.seed}; ended: {t.terminated or '?'}"
    )
    known = t.prefix_messages >= 0
    msgs = list(t.messages)
    # Generated turns are the last len(turns) assistant messages (dataset prefix turns come first).
    assistant_at = [i for i, m in enumerate(msgs) if m.role == "assistant"]
    generated = assistant_at[len(assistant_at) - len(t.turns) :] if t.turns else []
    first_gen = generated[0] if generated else len(msgs)
    prefix = t.prefix_messages if known else first_gen
    lines.append(
        f"prompt ({prefix} message(s) from the task{'' if known else ', up to the first generated turn'}; "
        f"{t.prompt_tokens} tokens):"
    )
    lines += [f"  {_msg(m, width)}" for m in msgs[:prefix]]
    lines.append("conversation:")
    sim_calls = 0
    turn_of = dict(zip(generated, t.turns))
    for i, m in enumerate(msgs[prefix:], start=prefix):
        if i in turn_of:
            turn = turn_of[i]
            lines.append(
                f"  {i:>3} policy version {turn.version}: {arrays.generated(turn)} tokens, finish {turn.finish_reason}"
                f"{'' if turn.trained else ' (not trained)'}"
            )
        elif m.role == "user":
            sim_calls += 1
            fb = " FALLBACK (the simulator's answer was unusable; a stand-in)" if i in t.sim_fallbacks else ""
            lines.append(
                f"  {i:>3} simulator call {sim_calls} (prompt {t.sim_prompt or '?'}; asked with the "
                f"{i - (1 if msgs and msgs[0].role == 'system' else 0)} message(s) before){fb}"
            )
        else:
            lines.append(f"  {i:>3} {m.role}")
        lines.append(f"      {_msg(m, width)}")
    if t.terminated == "sim_done":
        lines.append(f"  simulator call {sim_calls + 1}: said the user is done (not part of the conversation)")
    for k, f in enumerate(t.futures):
        own = future_messages(t, f)
        lines.append(f"future {k} (scored, not trained; {f.assistant_tokens} assistant tokens):")
        for m in own:
            who = "simulator" if m.role == "user" else "policy"
            lines.append(f"      {who}: {_msg(m, width)}")
    lines += _judge_lines("judge calls", s.judge, s.judge_model, bool(t.futures), width)
    lines += _score_lines(s, width)
    if s.audit:
        lines += _judge_lines("audit judge calls (second verdict, not rewarded)", s.audit, "", bool(t.futures), width)
        lines.append("  audit metrics: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(s.audit_metrics.items())))
    lines += _fate_lines(fate, s)
    return "\n".join(lines)


def _judge_lines(title: str, outputs: list[JudgeOutput], model: str, has_futures: bool, width: int) -> list[str]:
    if not outputs:
        return [f"{title}: none (this reward asks no judge, or the scorer did not judge it)"]
    out = [f"{title}{f' (model {model})' if model else ''}:"]
    for o in outputs:
        seed = f"seed {o.seed}" if o.seed >= 0 else "seed not recorded"
        status = "ok" if o.ok else f"FAILED: {o.error}"
        who = f", {o.model}" if o.model and o.model != model else ""
        out.append(f"  {o.op} on {_judged(o, has_futures)} ({seed}, {o.attempts} attempt(s){who}): {status}")
        out.append(f"      answer: {_text(o.raw, width)}")
    return out


def _score_lines(s: Scored, width: int) -> list[str]:
    if not s.metrics:
        return [f"score: total {s.total:.4g}, not judged (ended {s.trajectory.terminated or '?'})"]
    out = [f"score: total {s.total:.6g} (scorer {s.scorer or '?'})"]
    try:
        terms = weighted_terms(s.metrics, s.weights, s.clamps)
    except ValueError:
        terms = {}
    for name, value in sorted(s.metrics.items()):
        if name in terms:
            clamp = f", clamped to {s.clamps[name]}" if name in s.clamps else ""
            out.append(f"  {name:<16} {value:.6g} x weight {s.weights[name]:g}{clamp} = {terms[name]:+.6g}")
        else:
            out.append(f"  {name:<16} {value:.6g} (reported, not weighted)")
    if s.document:
        out.append(f"  document: {_text(s.document, width)}")
    return out


def _fate_lines(fate: Fate, s: Scored | None) -> list[str]:
    versions = sorted({turn.version for turn in s.trajectory.turns}) if s is not None else []
    made = f"generated by version(s) {versions}" if versions else ""
    match fate.kind:
        case "trained":
            lag = f"; lag {fate.step - 1 - min(versions)} version(s)" if versions else ""
            corr = ", with the staleness correction" if fate.corrected else ""
            return [
                f"training: TRAINED by optimizer step {fate.step} (against version {fate.step - 1}, its update "
                f"made version {fate.step}{corr}); {made}{lag}"
            ]
        case "dropped":
            return [f"training: DROPPED, not trained: {fate.reason}" + (f"; {made}" if made else "")]
        case "buffered":
            return [f"training: not yet: {fate.reason}"]
    return [f"training: {fate.reason}"]
