"""Scoring one trajectory: judge calls, metrics, the futures average and the weighted total.

`score_trajectory` is pure apart from the judge it is given (services.judge.client), so the scorer role,
eval and replay all reuse it. The metrics are the run's environment's (`parley.environments.base.Reward`): the judge operations its
judge metrics name are asked, then the reward evaluates the conversation with their replies.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from parley.config.env import default_scored_as
from parley.environments.base import Conversation, Reward
from parley.errors import BadMessage
from parley.protocol.messages import ChatMessage, FutureRollout, JudgeOutput, JudgeReply, Scored, Trajectory
from parley.rewards.reward import average_futures, total_reward
from parley.services.judge.client import Judge, JudgeFailed


class Unscorable(BadMessage):
    """The trajectory itself cannot be scored (e.g. no reference document); retrying won't help."""


class ScoringSettings(Protocol):
    """What scoring reads of the [scorer] section (config.scorer.ScorerConfig has these)."""

    weights: dict[str, float]  # {} = the reward's default weights
    clamps: dict[str, list[float]]  # metric -> [low, high]


def future_messages(traj: Trajectory, future: FutureRollout) -> list[ChatMessage]:
    """The messages a future added after the conversation. Actors store each future as its whole
    branch (a fork of the conversation, then its own messages), so the conversation is cut off here;
    a future holding only its own messages (built by hand) is taken as it is."""
    main, own = list(traj.messages), list(future.messages)
    return own[len(main) :] if main and own[: len(main)] == main else own


def conversations(traj: Trajectory) -> list[tuple[list[ChatMessage], int]]:
    """What gets judged: the conversation itself, or one per sampled future (the conversation once,
    then that future's own messages), each with the assistant tokens it holds."""
    if not traj.futures:
        return [(list(traj.messages), traj.assistant_tokens)]
    return [
        (list(traj.messages) + future_messages(traj, f), traj.assistant_tokens + f.assistant_tokens)
        for f in traj.futures
    ]


def new_from(traj: Trajectory) -> int:
    """Index of the trajectory's first message its sample added: next_turn mode plays one turn after the
    prefix (the last message of the trajectory, its futures after it); conversation mode starts after
    the opening user message, so the first assistant message."""
    if traj.mode == "next_turn":
        return max(0, len(traj.messages) - 1)
    return next((i for i, m in enumerate(traj.messages) if m.role == "assistant"), len(traj.messages))


def _checked(reply: JudgeReply, op: str, traj_id: str) -> JudgeReply:
    if not reply.ok:
        raise JudgeFailed(
            f"judge {op} failed for {traj_id} after {reply.attempts} attempt(s): {reply.error or 'no error given'}"
        )
    return reply


async def _all(*coros) -> list:
    """Run concurrently; the first failure cancels the rest and is raised as itself (not a group). A
    cancellation of the caller always goes on as CancelledError. (Not a TaskGroup: on Python 3.11 a
    cancel that arrives while a child fails is dropped for the child's error, and the scorer's wait for
    an unreachable judge then asked again instead of stopping: a SIGTERM'd scorer ran on for hours.)"""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:  # an environment without judge metrics asks nothing
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a cancel of ours meanwhile goes on from here
        raise failed.exception()
    return [t.result() for t in tasks]


def scorer_reward(cfg) -> Reward:
    """The reward a bare [scorer] section describes: the default environment's, scored as its
    settings say (for callers that hold no environment; a run's roles pass their environment's reward)."""
    return default_scored_as(cfg).reward


async def _judge_one(
    judge: Judge | None,
    messages,
    tokens: int,
    traj: Trajectory,
    reward: Reward,
    seed: int,
    timings: dict[str, float],
    conversation: int = 0,
):
    """Metrics of one conversation, the document the reward judged, the judge model, raw outputs."""

    async def timed(op: str):
        t0 = time.perf_counter()
        reply = await judge.ask(op, messages, seed=seed)
        timings[op] = timings.get(op, 0.0) + time.perf_counter() - t0
        return reply

    ops = reward.judge_ops  # () for an environment without judge metrics: no judge call at all
    replies = dict(zip(ops, await _all(*(timed(op) for op in ops))))
    outputs = [
        JudgeOutput(
            op=op,
            raw=r.raw,
            attempts=r.attempts,
            ok=r.ok,
            error=r.error,
            seed=seed,
            conversation=conversation,
            model=r.model,
            document=r.document,
            levels=dict(r.levels),
            score=r.score,
            distribution={k: dict(v) for k, v in r.distribution.items()},
        )
        for op, r in replies.items()
    ]
    for op, reply in replies.items():
        _checked(reply, op, traj.traj_id)
    conv = Conversation(messages=messages, reference=traj.reference, assistant_tokens=tokens, new_from=new_from(traj))
    try:
        metrics = reward.evaluate(conv, replies)
    except ValueError as e:
        # A verdict the metric cannot read is the judge's failure (asked again with another seed); with
        # no judge in the reward only the conversation went in, and scoring it again gives the same.
        if ops:
            raise JudgeFailed(f"judge reply for {traj.traj_id} ({', '.join(ops)}) is unusable: {e}") from None
        raise Unscorable(f"trajectory {traj.traj_id} cannot be scored: {e}") from None
    document = reward.document(conv, replies) if reward.document else ""
    model = ",".join(dict.fromkeys(r.model for r in replies.values()))
    return metrics, document, model, outputs


async def score_trajectory(
    traj: Trajectory,
    judge: Judge | None,
    cfg: ScoringSettings,
    *,
    reward: Reward | None = None,
    scorer: str = "",
    seed: int | None = None,
) -> Scored:
    """Judge `traj` (every future, if it carries any), compute its metrics and weighted total.

    `reward` is the run's environment's (default: scorer_reward(cfg), the default environment's); `judge` may be
    None when it asks no judge operation. `seed` goes to the judge (default: the trajectory's own
    seed); a caller retrying after a failed verdict passes a fresh one, or a deterministic judge
    would fail the same way again. The weights are cfg.weights, or the reward's defaults if empty.
    Raises JudgeUnavailable / JudgeFailed when no trustworthy verdict came back (the caller retries
    later) and Unscorable when the trajectory cannot be scored at all. Never fills in a default.
    """
    reward = reward or scorer_reward(cfg)
    seed = traj.seed if seed is None else seed
    if reward.judge_ops and not traj.reference.strip():
        raise Unscorable(f"trajectory {traj.traj_id} has no reference document; the judge's metrics need one")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    results = await _all(
        *(_judge_one(judge, m, n, traj, reward, seed, timings, k) for k, (m, n) in enumerate(conversations(traj)))
    )
    timings["total"] = time.perf_counter() - t0

    # Each metric is averaged over the futures before weighting, so a clamp bounds the average.
    metrics = average_futures([m for m, _, _, _ in results])
    clamps = {k: (v[0], v[1]) for k, v in cfg.clamps.items()}
    _, document, judge_model, _ = results[0]
    weights = dict(cfg.weights) or reward.default_weights()
    return Scored(
        traj_id=traj.traj_id,
        task_id=traj.task_id,
        sample=traj.sample,
        run=traj.run,
        metrics=metrics,
        weights=weights,
        total=total_reward(metrics, weights, clamps),
        trajectory=traj,
        document=document,
        judge=[o for _, _, _, outputs in results for o in outputs],
        judge_model=judge_model,
        scorer=scorer,
        timings=timings,
        created=time.time(),
        clamps={k: [lo, hi] for k, (lo, hi) in clamps.items()},
    )
