"""The judge as a scorer of one trajectory asks it: one entry, `await ask(op, messages, seed=...)`,
for every operation (topology.JUDGE_OPS: extract, interactivity, ...). `JudgeClient` asks the
judge service over NATS request/reply (the service is services/judge/server.py); `LocalJudge` asks a judge
in this process. rollout.score calls it; the scorer role, the eval and replay build one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from parley.errors import Refused, Unavailable
from parley.protocol.messages import ChatMessage, JudgeReply, JudgeRequest


class JudgeUnavailable(Unavailable, RuntimeError):
    """Nobody answered (no service, or it timed out): retry later, score nothing."""


class JudgeFailed(Refused, RuntimeError):
    """The judge answered but could not give a usable verdict; never scored as 0."""


class Judge(Protocol):
    async def ask(self, op: str, messages: Sequence[ChatMessage], *, seed: int = 0) -> JudgeReply: ...


class JudgeClient:
    """The judge service over NATS request/reply, with at most `concurrency` requests in flight.
    `temperature` (None: the service's own) is asked of every request: the scorer's second verdicts."""

    def __init__(self, nc, *, timeout: float, concurrency: int = 16, temperature: float | None = None):
        self.nc = nc
        self.timeout = timeout
        self.temperature = -1.0 if temperature is None else temperature
        self._slots = asyncio.Semaphore(concurrency)

    async def ask(self, op: str, messages: Sequence[ChatMessage], *, seed: int = 0) -> JudgeReply:
        import msgspec
        import nats.errors

        from parley.protocol import codec, topology
        from parley.protocol.request import request

        subject = topology.judge_subject(op)
        data = codec.encode(JudgeRequest(op=op, messages=list(messages), seed=seed, temperature=self.temperature))
        async with self._slots:
            try:
                msg = await request(
                    self.nc, subject, data, timeout=self.timeout
                )  # deadline + id: see protocol/request.py
            except nats.errors.NoRespondersError:
                raise JudgeUnavailable(f"no judge service answers on {subject}; is `parley judge` running?") from None
            except nats.errors.TimeoutError:
                raise JudgeUnavailable(f"judge on {subject} did not answer within {self.timeout:.0f}s") from None
        try:
            return codec.decode("judge.reply", msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise JudgeFailed(f"judge on {subject} sent a reply that is not a JudgeReply: {e}") from None


class LocalJudge:
    """The judge in this process (a services.judge.server.Judge, or anything with its `handle(op, JudgeRequest)`)."""

    def __init__(self, judge):
        self.judge = judge

    async def ask(self, op: str, messages: Sequence[ChatMessage], *, seed: int = 0) -> JudgeReply:
        return await self.judge.handle(op, JudgeRequest(op=op, messages=list(messages), seed=seed))
