"""One sample of a Task, played out: the policy writes the assistant turns (token-in/token-out,
with behaviour log-probs and the policy version of each turn), the user side (services.sim.client) writes
the user turns. Called by the actor for every sample and by the eval for every benchmark
conversation; returns the Trajectory.

Modes (Task.mode):
  conversation  from the prefix (the simulated user opens if it is empty) until the simulator says
                done or max_new_turns messages were added; every assistant turn is trained.
  next_turn     one trained assistant turn after the prefix, then Task.futures continuations of
                Task.future_turns messages each (simulator first), kept for scoring only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from parley.errors import ParleyError
from parley.protocol import arrays
from parley.protocol.bus import Poison, Retry
from parley.protocol.messages import (
    ABANDONED_STALE,
    TASK_MAX_FUTURES,
    TASK_MAX_N,
    TASK_MAX_NEW_TURNS,
    AssistantTurn,
    ChatMessage,
    FutureRollout,
    Sampling,
    SimCall,
    SimRequest,
    Task,
    Trajectory,
)
from parley.rollout.chat import ChatTokens
from parley.services.sim.client import FALLBACK_MESSAGE, UserSide

log = logging.getLogger(__name__)

MODES = ("conversation", "next_turn")


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from the identity of a sample / turn: reproducible on redelivery, distinct
    across samples of a group (which must differ) and across turns."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def sim_call_key(req: SimRequest) -> str:
    """The identity of a simulator request for a replay: the prompt variant, the conversation so far and
    the call's seed (derived from the sample's seed and the call's place in it). The task's constant
    fields (reference, title, summary) are left out: the same sample asks them of every call."""
    body = msgspec.json.encode([req.prompt, [(m.role, m.content) for m in req.messages], req.seed])
    return hashlib.blake2b(body, digest_size=16).hexdigest()


@dataclass
class PolicySettings:
    """How the policy samples and what it may not exceed."""

    max_model_len: int
    sampling: Sampling = field(default_factory=Sampling)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str = ""  # recorded in Trajectory.model
    actor: str = ""  # recorded in Trajectory.actor


class StaleWatch:
    """Whether the learner can still train a task's group, watched while its samples play; one is
    shared by all the samples of a task (an actor makes it; `run_conversation(watch=)`).

    Under stale_policy "drop" a group is trained only if its oldest trained turn lags the learner's
    version by at most max_staleness (learner.groups: a group's staleness is its oldest sample's).
    The learner's version is at least the announced one and only rises (a resumed learner re-announces
    lower numbers, and `announced` follows it back), so once the oldest trained turn of any sample
    lags `announced()` by more, no sample of the task can be trained: playing on spends the engine on
    conversations that will be dropped. The samples then stop at their next turn boundary
    (Trajectory.terminated = ABANDONED_STALE), and a generation or simulator call running then is cut
    (the engine aborts the request) and its partial turn left out.

    A running call is cut as soon as what decides changes: a sibling's trained turn of an older version
    (`saw`), or a new announcement when `changed` is given (weights.follow.Follower.announcement: an
    event set when `announced()` next changes). The watch is also read every POLL_S, for an
    `announced` that signals nothing (a generation on the GPU takes a few tenths of a second: a poll
    alone would let much of it run)."""

    POLL_S = 0.25

    def __init__(
        self, announced: Callable[[], int], max_staleness: int, changed: Callable[[], asyncio.Event] | None = None
    ):
        self.announced, self.max_staleness, self.changed = announced, max_staleness, changed
        self.oldest: int | None = None  # the oldest version any sample of the task trained a turn on
        self._moved = asyncio.Event()  # set (and replaced) when `oldest` changes

    def saw(self, version: int) -> None:
        if self.oldest is None or version < self.oldest:
            self.oldest = version
            moved, self._moved = self._moved, asyncio.Event()
            moved.set()

    def events(self) -> list[asyncio.Event]:
        """Events one of which is set when why() may next change."""
        return [self._moved] if self.changed is None else [self._moved, self.changed()]

    def why(self) -> str:
        """ "" while the group may still be trained, else the reason it cannot."""
        if self.oldest is None:
            return ""
        now = self.announced()
        if now - self.oldest <= self.max_staleness:
            return ""
        return (
            f"a trained turn of version {self.oldest} lags the announced version {now} by "
            f"{now - self.oldest} > max_staleness {self.max_staleness}"
        )


class _Abandoned(ParleyError):
    """A call cut because its task's group can no longer be trained (StaleWatch); `what` was cut
    ("turn": a generation, "simulator call")."""

    def __init__(self, what: str, why: str):
        super().__init__(why)
        self.what = what


class _Player:
    """Plays one conversation branch: holds its ChatTokens and what the Trajectory needs."""

    def __init__(
        self,
        engine,
        sim: UserSide,
        task: Task,
        policy: PolicySettings,
        version_fn,
        chat,
        seed,
        watch: StaleWatch | None = None,
    ):
        self.engine, self.sim, self.task, self.policy, self.version_fn = engine, sim, task, policy, version_fn
        self.watch = watch  # None: played to its end whatever the learner's version
        self.chat = chat
        self.seed = seed
        self.turns: list[AssistantTurn] = []
        self.sim_fallbacks: list[int] = []
        self.sim_calls: list[SimCall] = []  # every answer the simulator gave, for a replay
        self.timings = {"generate": 0.0, "sim": 0.0}
        self.n_calls = 0  # engine + sim calls: makes every call's seed distinct
        # an engine serving LoRA adapter versions (engines.engine.PolicyEngine.load_adapter): the version
        # the conversation started on, which all its turns use (None until the first turn)
        self.pinned: int | None = None
        self.terminated = ""  # a future branch's: why its _play ended

    @property
    def awaiting_assistant(self) -> bool:
        return bool(self.chat.messages) and self.chat.messages[-1]["role"] == "user" and len(self.chat) > 0

    async def assistant(self, trained: bool = True) -> bool:
        """Generate one assistant turn; False when the context is full (nothing or a cut turn)."""
        room = self.policy.max_model_len - len(self.chat)
        if room < 1:
            return False
        max_tokens = min(self.task.max_tokens, room)
        version = self.version_fn() if self.pinned is None else self.pinned
        pin = {}
        if getattr(self.engine, "serves_adapters", False):  # adapter versions: every turn on the version it started on
            if self.pinned is None:
                self.engine.pin(version)
                self.pinned = version
            pin = {"version": version}
        self.n_calls += 1
        t0 = time.perf_counter()
        try:
            out = await self._unless_abandoned(
                self.engine.generate(
                    self.chat.prompt_ids,
                    max_tokens=max_tokens,
                    temperature=self.policy.sampling.temperature,
                    top_p=self.policy.sampling.top_p,
                    seed=derive_seed(self.seed, "policy", self.n_calls),
                    stop_token_ids=self.chat.end_token_ids,
                    **pin,
                ),
                "turn",
            )
        finally:
            self.timings["generate"] += time.perf_counter() - t0
        if out.finish_reason == "abort":
            # only happens while the engine shuts down; never publish a half-made turn
            raise Retry("generation aborted (engine stopping)", delay=1.0)
        start = len(self.chat)
        self.chat.add_assistant(out.token_ids, out.finish_reason, logprobs=out.logprobs)
        self.turns.append(
            AssistantTurn(
                start=start,
                logprobs_f32=arrays.pack_logprobs(out.logprobs),
                version=version,
                finish_reason=out.finish_reason,
                trained=trained,
                stale_prefix_tokens=getattr(out, "stale_cached_tokens", 0),
            )
        )
        if trained and self.watch is not None:
            self.watch.saw(version)
        return not (out.finish_reason == "length" and max_tokens < self.task.max_tokens)

    async def _unless_abandoned(self, call, what: str):
        """`await call`, cancelled (raising _Abandoned(what, ...)) once the watch says the task's group
        can no longer be trained (a sibling's turn may doom it while this one's first runs); vLLM
        aborts a cancelled request. Without a watch, just `await call`."""
        w = self.watch
        if w is None:
            return await call
        job = asyncio.ensure_future(call)
        try:
            while not job.done():
                # the events are taken before the wait and why() read after it: no change between the
                # two is missed (nothing else runs until this task awaits)
                waiters = [asyncio.ensure_future(e.wait()) for e in w.events()]
                try:
                    await asyncio.wait({job, *waiters}, timeout=w.POLL_S, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()
                if not job.done() and (why := w.why()):
                    raise _Abandoned(what, why)
            return job.result()
        finally:
            if not job.done():
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job

    async def user(self, opening: bool = False) -> str:
        """Ask the simulator for the next user message and append it.

        Returns "" when a message was added, else why not: "sim_done" or "max_model_len"."""
        t = self.task
        self.n_calls += 1
        req = SimRequest(
            prompt=t.sim_prompt,
            messages=[ChatMessage(m["role"], m["content"]) for m in self.chat.messages if m["role"] != "system"],
            reference=t.reference,
            title=t.title,
            summary=t.summary,
            seed=derive_seed(self.seed, "sim", self.n_calls),
        )
        t0 = time.perf_counter()
        try:
            reply = await self._unless_abandoned(self.sim.ask(req), "simulator call")
        finally:
            self.timings["sim"] += time.perf_counter() - t0
        self.sim_calls.append(
            SimCall(key=sim_call_key(req), message=reply.message, done=reply.done, fallback=reply.fallback)
        )
        if reply.done and not opening:
            return "sim_done"  # the closing "thanks" is not part of the conversation
        text = reply.message
        fallback = reply.fallback or not text.strip()
        if fallback and not reply.fallback:
            text = FALLBACK_MESSAGE  # a user who is "done" before saying anything
        # Probe on a copy: a user message that leaves no room for an answer is not added.
        probe = self.chat.fork()
        probe.add_user(text)
        if len(probe) >= self.policy.max_model_len:
            return "max_model_len"
        self.chat = probe
        if fallback:
            self.sim_fallbacks.append(len(self.chat.messages) - 1)
            log.info(
                "task %s: user turn %d is a simulator fallback (%s)",
                t.task_id,
                len(self.chat.messages) - 1,
                reply.error[:200],
            )
        return ""


def check_task(task: Task) -> None:
    """Tasks that can never be played are poison (dead-lettered), not retried."""
    if task.mode not in MODES:
        raise Poison(f"task {task.task_id}: mode={task.mode!r} not allowed; use one of {MODES}")
    if task.n < 1:
        raise Poison(f"task {task.task_id}: n={task.n} must be >= 1")
    if task.max_tokens < 1:
        raise Poison(f"task {task.task_id}: max_tokens={task.max_tokens} must be >= 1")
    opens_with_user = bool(task.prefix) and task.prefix[-1].role == "user"
    if task.mode == "conversation" and task.max_new_turns < (1 if opens_with_user else 2):
        raise Poison(f"task {task.task_id}: max_new_turns={task.max_new_turns} leaves no assistant turn")
    for i, m in enumerate(task.prefix):
        if m.role not in ("system", "user", "assistant"):
            raise Poison(f"task {task.task_id}: prefix[{i}].role={m.role!r} not allowed")
    if task.futures < 0 or task.future_turns < 0:
        raise Poison(f"task {task.task_id}: futures/future_turns must be >= 0")


def check_task_limits(task: Task, max_model_len: int) -> None:
    """Poison for a Task whose sizes no honest feeder sends (protocol.messages TASK_MAX_*), or whose
    turns could not fit this actor's context: refused on arrival, before any work is started."""
    limits = (
        ("n", task.n, TASK_MAX_N),
        ("max_new_turns", task.max_new_turns, TASK_MAX_NEW_TURNS),
        ("futures", task.futures, TASK_MAX_FUTURES),
        ("future_turns", task.future_turns, TASK_MAX_NEW_TURNS),
        ("max_tokens", task.max_tokens, max_model_len),
    )
    for name, value, most in limits:
        if value > most:
            where = "this actor's max_model_len" if name == "max_tokens" else "the most a task may ask"
            raise Poison(f"task {task.task_id}: {name}={value} exceeds {most} ({where}); lower [rollout] {name}")


async def _play(p: _Player, budget: int, trained: bool = True) -> str:
    """Alternate user / assistant until the simulator is done or `budget` messages were added.
    Stops before a user message that could not be answered within the budget, so a branch
    ends on an assistant turn, and at any turn boundary once the task's group can no longer be
    trained (StaleWatch). Returns the termination reason."""
    added = 0
    while True:
        if p.watch is not None and (why := p.watch.why()):
            log.info("task %s: stopped after %d messages: %s", p.task.task_id, added, why)
            return ABANDONED_STALE
        try:
            if p.awaiting_assistant:
                if added >= budget:
                    return "max_new_turns"
                if not await p.assistant(trained=trained):
                    return "max_model_len"
            else:
                opening = len(p.chat) == 0
                # the opening user message is needed whatever the budget; later ones need a reply
                if not opening and added + 2 > budget:
                    return "max_new_turns"
                if why := await p.user(opening=opening):
                    return why
        except _Abandoned as e:
            log.info("task %s: %s cut after %d messages: %s", p.task.task_id, e.what, added, e)
            return ABANDONED_STALE
        added += 1


async def run_conversation(
    engine,
    sim_client: UserSide,
    task: Task,
    sample: int,
    version_fn: Callable[[], int],
    *,
    tokenizer,
    policy: PolicySettings,
    watch: StaleWatch | None = None,
    seed: int | None = None,
) -> Trajectory:
    """Play sample `sample` of `task` and return its Trajectory (not yet published). With `watch`
    (shared by the task's samples) it stops early once the task's group can no longer be trained,
    terminated ABANDONED_STALE. `seed`: the sample's seed as a Trajectory records it (a replay's);
    default: derived from the task's."""
    check_task(task)
    t0 = time.perf_counter()
    seed = derive_seed(task.task_id, task.seed, sample) if seed is None else seed
    opening = ([{"role": "system", "content": task.system_prompt}] if task.system_prompt else []) + [
        {"role": m.role, "content": m.content} for m in task.prefix
    ]
    chat = ChatTokens(tokenizer, opening, template_kwargs=dict(policy.template_kwargs))
    p = _Player(engine, sim_client, task, policy, version_fn, chat, seed, watch)
    try:
        return await _run(p, task, sample, policy, t0, seed)
    finally:
        if p.pinned is not None:  # the conversation is over: its adapter may go (PolicyEngine.unpin)
            await engine.unpin(p.pinned)


async def _run(p: _Player, task: Task, sample: int, policy: PolicySettings, t0: float, seed: int) -> Trajectory:
    futures: list[FutureRollout] = []

    if task.mode == "conversation":
        terminated = await _play(p, task.max_new_turns)
    else:
        # next_turn: get the conversation to a user message, then the one trained turn
        terminated = ""
        try:
            if not p.awaiting_assistant:
                terminated = await p.user(opening=len(p.chat) == 0)
            if not terminated:
                terminated = "max_new_turns" if await p.assistant(trained=True) else "max_model_len"
        except _Abandoned:
            terminated = ABANDONED_STALE
        if terminated == "max_new_turns" and p.watch is not None and p.watch.why():
            terminated = ABANDONED_STALE  # its futures are for scoring only: not worth playing
        if task.futures and p.turns and terminated == "max_new_turns":
            branches = await asyncio.gather(*(_future(p, k) for k in range(task.futures)))
            for f in branches:
                p.timings["generate"] += f.timings["generate"]
                p.timings["sim"] += f.timings["sim"]
                p.sim_calls += f.sim_calls
            if any(f.terminated == ABANDONED_STALE for f in branches):
                terminated = ABANDONED_STALE  # cut futures would be scored as if complete
            futures = [
                FutureRollout(messages=_messages(f.chat), assistant_tokens=sum(arrays.generated(t) for t in f.turns))
                for f in branches
            ]

    chat = p.chat
    if len(chat.loss_mask) != len(chat.token_ids):
        raise RuntimeError("loss mask and token ids diverged")  # a bug in ChatTokens; never publish it
    traj = Trajectory(
        traj_id=f"{task.task_id}/{sample}",
        task_id=task.task_id,
        sample=sample,
        run=task.run,
        item_id=task.item_id,
        messages=_messages(chat),
        token_ids_i32=arrays.pack_ids(chat.token_ids),
        loss_mask_u8=arrays.pack_mask(chat.loss_mask),  # next_turn: the main branch holds only the trained turn
        turns=p.turns,
        reference=task.reference,
        prompt_tokens=p.turns[0].start if p.turns else len(chat.token_ids),
        assistant_tokens=sum(arrays.generated(t) for t in p.turns),
        sim_fallbacks=p.sim_fallbacks,
        terminated=terminated,
        futures=futures,
        mode=task.mode,
        sim_prompt=task.sim_prompt,
        model=policy.model,
        actor=policy.actor,
        seed=seed,
        temperature=policy.sampling.temperature,
        top_p=policy.sampling.top_p,
        timings={**{k: round(v, 4) for k, v in p.timings.items()}, "total": round(time.perf_counter() - t0, 4)},
        created=time.time(),
        adapter=p.engine.adapter_name(p.pinned) if p.pinned is not None else "",
        prefix_messages=len(task.prefix) + bool(task.system_prompt),  # run_conversation's opening
        sim_calls=p.sim_calls,
    )
    return traj


def _messages(chat: ChatTokens) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in chat.messages]


async def _future(p: _Player, k: int) -> _Player:
    """Continuation k after the trained turn: future_turns messages, the simulator first."""
    f = _Player(
        p.engine, p.sim, p.task, p.policy, p.version_fn, p.chat.fork(), derive_seed(p.seed, "future", k), p.watch
    )
    f.pinned = p.pinned  # the branch plays on the conversation's version (its pin is the conversation's)
    f.terminated = await _play(f, p.task.future_turns, trained=False)
    return f
