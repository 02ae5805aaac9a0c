"""`parley replay --deterministic`: a run played again from its log. Every logged sample (a Scored of
the learner's archive) is replayed by the conversation loop with the policy engine it is given, the
simulator answered from the sample's recorded calls (Trajectory.sim_calls, by the request's key) and
the judge from its recorded verdicts (Scored.judge, by operation, conversation and seed): no
simulator or judge model is needed. The replay then checks that the policy wrote the same tokens,
token for token, and that the same answers give the same reward.

A request the log does not hold (the replayed conversation left the recorded one, or the sample was
logged before calls were recorded) is a ReplayMiss naming the call. Called by evaluation.commands;
the engine (a PolicyEngine, or a test's double) comes from the caller.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import msgspec

from parley.errors import ParleyError
from parley.protocol import arrays
from parley.protocol.messages import (
    ABANDONED_STALE,
    ChatMessage,
    JudgeOutput,
    JudgeReply,
    Sampling,
    Scored,
    SimCall,
    SimReply,
    SimRequest,
    Task,
    Trajectory,
)
from parley.rollout.conversation import PolicySettings, run_conversation, sim_call_key
from parley.rollout.score import conversations, score_trajectory


def logged_samples(archive: Path) -> list[Scored]:
    """Every sample in a run's archive (learner.checkpoint.archive_dir): trained steps, then dropped groups."""
    from parley.evaluation.evallog import read_log

    files = sorted(archive.glob("step*.parquet")) + sorted(archive.glob("dropped-*.parquet"))
    if not files:
        raise FileNotFoundError(f"no archived samples in {archive}: is it a run directory the learner wrote?")
    return [r for p in files for r in read_log(p) if isinstance(r, Scored)]


class ReplayMiss(ParleyError, LookupError):
    """The log holds no answer to a simulator or judge request of the replay."""


def conversation_key(messages: Sequence[ChatMessage]) -> str:
    body = msgspec.json.encode([(m.role, m.content) for m in messages])
    return hashlib.blake2b(body, digest_size=16).hexdigest()


class RecordedUser:
    """The simulator as a sample's log answered it (services.sim.client.UserSide)."""

    def __init__(self, traj_id: str, calls: Sequence[SimCall]):
        self.traj_id = traj_id
        self.calls = {c.key: c for c in calls}
        self.asked = 0
        self.missed: SimRequest | None = None  # the request the log had no answer to

    async def ask(self, req: SimRequest) -> SimReply:
        self.asked += 1
        call = self.calls.get(sim_call_key(req))
        if call is None:
            self.missed = req
            last = req.messages[-1].content[:80] if req.messages else ""
            raise ReplayMiss(
                f"{self.traj_id}: simulator call {self.asked} (prompt {req.prompt!r}, seed {req.seed}, after "
                f"{len(req.messages)} message(s), the last {last!r}) is not in the log of its "
                f"{len(self.calls)} recorded call(s): the replayed conversation left the recorded one here"
            )
        return SimReply(message=call.message, done=call.done, fallback=call.fallback)


class RecordedJudge:
    """The judge as a sample's log answered it (services.judge.client.Judge): each verdict found by its
    operation, the conversation it judged and the seed it was asked with."""

    def __init__(self, scored: Scored):
        self.traj_id = scored.traj_id
        convs = conversations(scored.trajectory)
        self.answers: dict[tuple[str, str, int], JudgeOutput] = {}
        for o in scored.judge:
            if 0 <= o.conversation < len(convs):
                self.answers[(o.op, conversation_key(convs[o.conversation][0]), o.seed)] = o

    async def ask(self, op: str, messages: Sequence[ChatMessage], *, seed: int = 0) -> JudgeReply:
        o = self.answers.get((op, conversation_key(messages), seed))
        if o is None:
            raise ReplayMiss(
                f"{self.traj_id}: judge call {op} (seed {seed}) on a conversation of {len(messages)} message(s) "
                f"is not in the log ({len(self.answers)} recorded verdict(s))"
            )
        return JudgeReply(
            ok=o.ok,
            document=o.document,
            levels=dict(o.levels),
            score=o.score,
            raw=o.raw,
            attempts=o.attempts,
            error=o.error,
            model=o.model,
            distribution={k: dict(v) for k, v in o.distribution.items()},
        )


def recorded_task(traj: Trajectory, *, max_new_turns: int, max_tokens: int, future_turns: int) -> Task:
    """The Task a logged sample was played from: its opening, simulator prompt and mode from the
    trajectory; the sizes the trajectory does not carry from the run's [rollout] settings."""
    if traj.prefix_messages < 0:
        raise ReplayMiss(f"{traj.traj_id}: logged by an actor that did not record its opening; it cannot be replayed")
    opening = list(traj.messages[: traj.prefix_messages])
    system = opening[0].content if opening and opening[0].role == "system" else ""
    return Task(
        task_id=traj.task_id,
        run=traj.run,
        item_id=traj.item_id,
        n=traj.sample + 1,
        mode=traj.mode,
        prefix=opening[1:] if system else opening,
        reference=traj.reference,
        system_prompt=system,
        sim_prompt=traj.sim_prompt,
        max_new_turns=max_new_turns,
        max_tokens=max_tokens,
        futures=len(traj.futures),
        future_turns=future_turns,
    )


@dataclass
class Outcome:
    traj_id: str
    status: str  # "match" | "mismatch" | "skipped" | "miss"
    detail: str = ""


@dataclass
class ReplayReport:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return self.count("match") > 0 and self.count("mismatch") == 0 and self.count("miss") == 0

    def describe(self) -> str:
        lines = [
            f"{o.traj_id}: {o.status.upper()}{': ' + o.detail if o.detail else ''}"
            for o in self.outcomes
            if o.status != "match"
        ]
        lines.append(
            f"{self.count('match')} sample(s) replayed token for token with the same reward, "
            f"{self.count('mismatch')} differ, {self.count('miss')} asked what the log does not hold, "
            f"{self.count('skipped')} skipped"
        )
        return "\n".join(lines)


def _diverged(t: Trajectory, asked: Sequence[ChatMessage]) -> str:
    """Why a replayed conversation asked the simulator what the log holds no answer to, when the policy
    is the cause: the messages it asked with are no prefix of any logged branch. "" otherwise."""
    branches = [list(t.messages)] + [list(f.messages) for f in t.futures]
    branches = [[m for m in b if m.role != "system"] for b in branches]  # as a SimRequest carries them
    asked = list(asked)
    if any(b[: len(asked)] == asked for b in branches):
        return ""
    best = max(branches, key=lambda b: first_difference(b, asked))
    at = first_difference(best, asked)
    logged = best[at].content[:60] if at < len(best) else "(nothing)"
    return (
        f"the policy's message {at} (after the system prompt) differs from the log before the simulator was asked "
        f"again: logged {logged!r}, replayed {asked[at].content[:60]!r}"
    )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where the token streams differ (the shorter one's length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def replay_one(s: Scored, engine, tokenizer, *, max_model_len: int, rollout, reward, version: int) -> Outcome:
    t = s.trajectory
    if t.terminated == ABANDONED_STALE:
        # where it stopped depends on when the learner's announcement came, not on the log
        return Outcome(s.traj_id, "skipped", "stopped early by the staleness watch (not a deterministic end)")
    versions = sorted({turn.version for turn in t.turns})
    if versions and versions != [version]:
        return Outcome(s.traj_id, "skipped", f"generated by version(s) {versions}: one version is replayed at a time")
    if any(turn.stale_prefix_tokens for turn in t.turns):
        # [actor.engine] prefix_cache_across_versions: a turn attended over KV older weights computed,
        # which a replay (each version over its own KV) does not reproduce
        return Outcome(s.traj_id, "skipped", "generated over a prefix cached by older weights (not replayed exactly)")
    if not t.sim_calls and any(m.role == "user" for m in t.messages[max(0, t.prefix_messages) :]):
        return Outcome(s.traj_id, "miss", "logged without its simulator calls (an older actor)")
    task = recorded_task(
        t, max_new_turns=rollout.max_new_turns, max_tokens=rollout.max_tokens, future_turns=rollout.future_turns
    )
    policy = PolicySettings(max_model_len=max_model_len, sampling=Sampling(temperature=t.temperature, top_p=t.top_p))
    user = RecordedUser(s.traj_id, t.sim_calls)
    try:
        again = await run_conversation(
            engine, user, task, t.sample, lambda: version, tokenizer=tokenizer, policy=policy, seed=t.seed
        )
    except ReplayMiss as e:
        if user.missed is not None and (diverged := _diverged(t, user.missed.messages)):
            return Outcome(s.traj_id, "mismatch", diverged)
        return Outcome(s.traj_id, "miss", str(e))
    old, new = arrays.token_ids(t).tolist(), arrays.token_ids(again).tolist()
    if old != new:
        at = first_difference(old, new)
        return Outcome(
            s.traj_id,
            "mismatch",
            f"policy tokens differ from token {at} of {len(old)} (logged {old[at : at + 5]}, replayed "
            f"{new[at : at + 5]}; {len(new)} tokens replayed)",
        )
    if [f.messages for f in again.futures] != [f.messages for f in t.futures]:
        return Outcome(s.traj_id, "mismatch", "the futures differ")
    if not s.metrics:  # never judged (abandoned, or no judge metric): the tokens are the whole check
        return Outcome(s.traj_id, "match")
    # the logged recipe of the total (weights, clamps) and the seed the judge was asked with (a scorer
    # retrying a failed verdict asks again at another seed)
    recipe = SimpleNamespace(weights=dict(s.weights), clamps=dict(s.clamps))
    seed = next((o.seed for o in s.judge if o.seed >= 0), None)
    try:
        rescored = await score_trajectory(again, RecordedJudge(s), recipe, reward=reward, seed=seed)
    except ReplayMiss as e:
        return Outcome(s.traj_id, "miss", str(e))
    if abs(rescored.total - s.total) > 1e-9:
        return Outcome(s.traj_id, "mismatch", f"reward {rescored.total!r} replayed, {s.total!r} logged")
    return Outcome(s.traj_id, "match")


def _version_of(s: Scored) -> int | None:
    """The one policy version that wrote the sample's turns (None: several, or none)."""
    versions = {turn.version for turn in s.trajectory.turns}
    return versions.pop() if len(versions) == 1 else None


async def replay_deterministic(
    records: Sequence[Scored],
    engine,
    tokenizer,
    *,
    max_model_len: int,
    rollout,
    reward,
    weights_of: Callable[[int], Path | None] | None = None,
) -> ReplayReport:
    """Replay every logged sample, one at a time (batch composition stays out of the engine's numbers).
    Samples are taken version by version: those of the version `engine` serves first, then each other
    version whose weights `weights_of(version)` finds (a folder of safetensors, loaded in place with
    `engine.reload_weights`); the rest are skipped, saying why. Outcomes keep the records' order."""
    outcomes: dict[int, Outcome] = {}
    by_version: dict[int | None, list[int]] = {}
    for i, s in enumerate(records):
        by_version.setdefault(_version_of(s), []).append(i)
    for v in sorted(by_version, key=lambda v: (v != engine.version, v is None, v or 0)):
        if v is not None and v != engine.version:
            path = weights_of(v) if weights_of is not None else None
            if path is None:
                for i in by_version[v]:
                    why = f"the weights of version {v} are not in the run directory"
                    outcomes[i] = Outcome(records[i].traj_id, "skipped", why)
                continue
            await engine.reload_weights(path, version=v)
        for i in by_version[v]:
            outcomes[i] = await replay_one(
                records[i],
                engine,
                tokenizer,
                max_model_len=max_model_len,
                rollout=rollout,
                reward=reward,
                version=engine.version,
            )
    return ReplayReport([outcomes[i] for i in range(len(records))])
