"""The benchmark runner behind `parley eval`: every condition (a policy model or checkpoint, optionally a
system prompt) plays the same items with the same simulator seeds, through the conversation loop the
actors run (rollout.conversation) and the scoring the scorers run (rollout.score), and yields one
EvalRecord per conversation. The simulator and judge are whatever implements their interfaces
(services.sim.client, services.judge.client): the NATS services, or in-process ones. What is played and scored is the
run's environment (environments/): its held-out items and eval tasks, its user (a programmatic one runs
here, in-process) and its reward; the default environment unless told otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from parley.config.env import default_environment
from parley.environments.base import Environment, LocalUser, ProgrammaticUser
from parley.protocol.messages import EvalRecord, Sampling, SimReply, SimRequest, Task
from parley.services.sim.client import UserSide
from parley.tasks.data import system_prompt_text

log = logging.getLogger(__name__)

CONDITION_FORM = "name=MODEL_OR_CHECKPOINT[,system_prompt=FILE]"


@dataclass(frozen=True)
class Condition:
    """One row of the table: a policy (model name or checkpoint dir) and its system prompt text."""

    name: str
    model: str
    system_prompt: str = ""
    system_prompt_file: str = ""


def parse_condition(text: str) -> Condition:
    """'base=smol', 'step50=runs/x/checkpoints/v50', 'proactive=smol,system_prompt=proactive'."""
    head, *options = [p.strip() for p in text.split(",")]
    name, sep, model = head.partition("=")
    if not sep or not name.strip() or not model.strip():
        raise ValueError(f"condition {text!r} must look like {CONDITION_FORM}")
    name = name.strip()
    if not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"condition name {name!r} may hold only letters, digits, '-', '_' and '.'")
    prompt_file = ""
    for opt in options:
        key, sep, value = opt.partition("=")
        if key.strip() != "system_prompt" or not sep or not value.strip():
            raise ValueError(f"condition {text!r}: option {opt!r} not understood; the form is {CONDITION_FORM}")
        prompt_file = value.strip()
    prompt = system_prompt_text(prompt_file)
    return Condition(name=name, model=model.strip(), system_prompt=prompt, system_prompt_file=prompt_file)


@dataclass
class EvalSettings:
    """The benchmark protocol; the defaults are the reference benchmark's (thinking off, lazy_full
    simulated user, up to 4096 tokens per assistant turn, up to 14 new messages)."""

    sim_prompt: str = "lazy_full"  # "" = the environment's own (its SimulatorUser's prompt)
    assistant_max_tokens: int = 4096
    max_new_turns: int = 14
    seeds: int = 1  # simulator seeds per item; the same for every condition
    enable_thinking: bool = False  # the policy's chat-template option of that name
    sampling: Sampling = field(default_factory=Sampling)
    concurrency: int = 8  # conversations of one condition in flight
    run: str = "eval"
    # A conversation whose verdict failed (the judge answered ok=False) is judged again with a fresh
    # seed, this many times in all, before it is reported unscored. (An unreachable or slow judge is
    # waited for up to [scorer] judge_wait_s instead, as the scorer role waits.)
    judge_attempts: int = 3

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds={self.seeds} must be >= 1")
        if self.assistant_max_tokens < 1:
            raise ValueError(f"assistant_max_tokens={self.assistant_max_tokens} must be >= 1")
        if self.max_new_turns < 2:
            raise ValueError(f"max_new_turns={self.max_new_turns} must be >= 2 (the user opens, the assistant answers)")
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        if self.judge_attempts < 1:
            raise ValueError(f"judge_attempts={self.judge_attempts} must be >= 1")


@dataclass(frozen=True)
class NotScored:
    """A conversation of the eval that has no score, and why; `parley eval` reports each one and writes
    them to OUT/unscored.jsonl, the periodic eval quotes them."""

    eval_id: str
    condition: str
    item_id: str
    stage: str  # "conversation": the simulator never answered, nothing was played; "judge": played, not scored
    reason: str

    def describe(self) -> str:
        return f"{self.eval_id} ({self.stage}): {self.reason}"


UNSCORED_FILE = "unscored.jsonl"


def write_unscored(missing: Sequence[NotScored], out: str | Path) -> Path:
    """OUT/unscored.jsonl, one NotScored per line (written, empty, even when everything was scored, so a
    reader can tell "all scored" from "no report")."""
    import dataclasses
    import json

    path = Path(out) / UNSCORED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataclasses.asdict(m)) + "\n" for m in missing))
    return path


def read_unscored(out: str | Path) -> list[NotScored]:
    """What write_unscored wrote in `out`; [] when there is no report."""
    import json

    path = Path(out) / UNSCORED_FILE
    if not path.is_file():
        return []
    return [NotScored(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def eval_items(data, items_path: str | None, env: Environment | None = None) -> tuple[list, list]:
    """(training items, eval items) for the leakage guard and the run: the environment's train/eval
    split of [data] (a config.learner.DataConfig), or an explicit items file against the training
    data where the environment reads one (TaskSource.items_file)."""
    env = env or default_environment()
    if not items_path:
        train, held = env.tasks.train_eval(data)
        return list(train), list(held)
    if env.tasks.items_file is None:
        raise ValueError(
            f"--items {items_path}: environment {env.name!r} draws its held-out items from its own task "
            "source and reads no items file; leave --items out"
        )
    train, held = env.tasks.items_file(data, items_path)
    return list(train), list(held)


@dataclass(frozen=True)
class EvalRollout:
    """The [rollout] fields an environment's task builder reads, as the benchmark sets them: whole
    conversations, no futures, the task's own system prompt (a condition may replace it)."""

    max_new_turns: int
    max_tokens: int
    sim_prompt: str
    mode: str = "conversation"
    system_prompt: str = ""
    futures: int = 0
    future_turns: int = 0


def user_name(env: Environment, settings: EvalSettings) -> str:
    """The simulator prompt the eval plays under: the settings' own, else the environment's."""
    if isinstance(env.user, ProgrammaticUser):
        return env.user.name
    return settings.sim_prompt or env.user.prompt


def make_tasks(items: Sequence, settings: EvalSettings, env: Environment | None = None) -> list[Task]:
    """One task per item and seed, built by the environment's eval protocol (Environment.eval_task).
    The task id carries no condition, so every condition's user sees the same seeds (rollout.conversation
    derives every call's seed from task id, seed and turn)."""
    env = env or default_environment()
    rollout = EvalRollout(
        max_new_turns=settings.max_new_turns,
        max_tokens=settings.assistant_max_tokens,
        sim_prompt=user_name(env, settings),
    )
    return [
        env.eval_task(
            item, run=settings.run, task_id=f"eval/{item.item_id}/{k}", n=1, rollout=rollout, seed=k, version=0
        )
        for item in items
        for k in range(settings.seeds)
    ]


class NotingSim:
    """Passes requests through and notes the simulator model named in the replies (for EvalRecord.sim_model)."""

    def __init__(self, inner: UserSide, model: str = ""):
        self.inner, self.model = inner, model

    async def ask(self, req: SimRequest) -> SimReply:
        reply = await self.inner.ask(req)
        self.model = reply.model or self.model
        return reply


@dataclass
class Policy:
    """A started policy engine with its tokenizer; `close` is called when its conditions are done."""

    engine: Any
    tokenizer: Any
    version: int = -1
    close: Callable[[], Awaitable[None]] | None = None


class SwappingPolicies:
    """`EvalServices.open_policy` that keeps one engine across conditions whose checkpoints differ
    only in their weights (engines.models.weights_swap_key): the next one's weights are loaded into
    the running engine (vLLM's in-place reload, seconds) instead of a new engine being started (tens
    of seconds on a GPU, more on CPU). Another shape closes the engine and starts one, so one policy
    is in memory at a time; `close()` ends the last one (the conditions' Policy.close is None)."""

    def __init__(self, start: Callable[[str], tuple[Any, Any]], version: int = -1):
        self.start, self.version = start, version  # start(model) -> (engine, tokenizer)
        self.key: str | None = None
        self.engine = self.tokenizer = None
        self.starts = self.swaps = 0

    async def __call__(self, model: str) -> Policy:
        from parley.engines.models import weights_swap_key

        key = weights_swap_key(model)
        if self.engine is not None and key is not None and key == self.key:
            t0 = time.perf_counter()
            await self.engine.reload_weights(model)
            self.swaps += 1
            log.info("policy %s: its weights loaded into the running engine in %.1fs", model, time.perf_counter() - t0)
        else:
            await self.close()
            self.engine, self.tokenizer = self.start(model)  # on the loop, as the engine needs: blocks while it loads
            self.key = key
            self.starts += 1
        return Policy(engine=self.engine, tokenizer=self.tokenizer, version=self.version, close=None)

    async def close(self) -> None:
        engine, self.engine, self.key = self.engine, None, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)


@dataclass
class EvalServices:
    open_policy: Callable[[str], Awaitable[Policy]]  # model name or checkpoint dir -> Policy
    sim: UserSide
    judge: Any  # services.judge.client.Judge; None when the environment's reward asks no judge operation
    scorer_cfg: Any  # config.scorer.ScorerConfig: the BLEU variant (weights only feed Scored.total)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The run's environment (its [env]); None: the default environment, scored as scorer_cfg says
    env: Environment | None = None

    @property
    def environment(self) -> Environment:
        return self.env or default_environment()

    def user(self) -> UserSide:
        """Who plays the user: the environment's programmatic user in this process, else the simulator."""
        user = self.environment.user
        return LocalUser(user) if isinstance(user, ProgrammaticUser) else self.sim


async def score_within_bounds(traj, judge, scorer_cfg, attempts: int, reward=None):
    """rollout.score.score_trajectory with `reward` (None: scorer_cfg's), patient as the scorer role is: while the judge is unreachable or
    does not answer within [scorer] judge_timeout_s, ask again with [scorer]'s back-off until
    [scorer] judge_wait_s have passed since the first try; after a failed verdict, ask again with a
    fresh seed, `attempts` verdicts in all. Then the last error is raised (the caller reports it)."""
    from parley.rollout.score import score_trajectory
    from parley.services.judge.client import JudgeFailed, JudgeUnavailable

    t0 = time.monotonic()
    failed = waits = 0
    while True:
        seed = (traj.seed + 1000 * failed) % 2**31  # as a redelivery in the scorer role: new seeds
        try:
            return await score_trajectory(traj, judge, scorer_cfg, reward=reward, scorer="eval", seed=seed)
        except JudgeUnavailable as e:
            waited = time.monotonic() - t0
            if waited >= scorer_cfg.judge_wait_s:
                raise JudgeUnavailable(
                    f"{e} (waited {waited:.0f}s, the bound is [scorer] judge_wait_s={scorer_cfg.judge_wait_s:.0f}s)"
                ) from None
            waits += 1
            if waits == 1 or waits % 10 == 0:
                log.warning(
                    "%s: %s; waiting (%.0fs of at most %.0fs)", traj.traj_id, e, waited, scorer_cfg.judge_wait_s
                )
            await asyncio.sleep(min(scorer_cfg.retry_delay(waits), max(0.0, scorer_cfg.judge_wait_s - waited)))
        except JudgeFailed as e:
            failed += 1
            if failed >= attempts:
                raise JudgeFailed(f"{e} (verdict {failed} of {attempts})") from None
            log.warning("%s: %s; asking again with a new seed (%d of %d)", traj.traj_id, e, failed + 1, attempts)


async def play_condition(
    cond: Condition,
    tasks: Sequence[Task],
    policy: Policy,
    services: EvalServices,
    settings: EvalSettings,
    on_record: Callable[[EvalRecord], Awaitable[None]] | None = None,
    on_missing: Callable[[NotScored], None] | None = None,
) -> list[EvalRecord]:
    """Every task once with this condition's policy and system prompt, judged; in task order. A task
    whose conversation could not be played (the simulator stayed unreachable) has no record; it and
    every record left unscored are passed to `on_missing` with the reason."""
    from parley.protocol.bus import Retry
    from parley.rollout.conversation import PolicySettings, run_conversation
    from parley.rollout.score import Unscorable
    from parley.services.judge.client import JudgeFailed, JudgeUnavailable

    policy_settings = PolicySettings(
        max_model_len=policy.engine.settings.max_model_len,
        sampling=settings.sampling,
        template_kwargs={**services.template_kwargs, "enable_thinking": settings.enable_thinking},
        model=cond.model,
        actor=f"eval-{cond.name}",
    )
    slots = asyncio.Semaphore(settings.concurrency)
    user = services.user()
    sim = user if isinstance(user, NotingSim) else NotingSim(user)
    # the run's reward; without an environment, the one scorer_cfg describes (rollout.score.scorer_reward)
    reward = services.env.reward if services.env is not None else None

    def missing(task: Task, stage: str, reason: str) -> None:
        m = NotScored(
            eval_id=f"{cond.name}/{task.item_id}/{task.seed}",
            condition=cond.name,
            item_id=task.item_id,
            stage=stage,
            reason=reason,
        )
        log.warning("condition %s: not scored: %s", cond.name, m.describe())
        if on_missing is not None:
            on_missing(m)

    async def one(task: Task) -> EvalRecord | None:
        task = msgspec.structs.replace(task, system_prompt=cond.system_prompt or task.system_prompt)
        async with slots:
            try:
                traj = await run_conversation(
                    policy.engine,
                    sim,
                    task,
                    0,
                    lambda: policy.version,
                    tokenizer=policy.tokenizer,
                    policy=policy_settings,
                )
            except Retry as e:  # SimClient gave up after its own retries ([actor] sim_timeout_s each)
                missing(task, "conversation", f"the user simulator did not answer: {e}")
                return None
            metrics, document, judge, judge_model = {}, "", [], ""
            try:
                scored = await score_within_bounds(
                    traj, services.judge, services.scorer_cfg, settings.judge_attempts, reward=reward
                )
                metrics, document, judge, judge_model = (
                    dict(scored.metrics),
                    scored.document,
                    list(scored.judge),
                    scored.judge_model,
                )
            except (JudgeFailed, JudgeUnavailable, Unscorable) as e:
                # The conversation is kept unscored; `parley replay --judge` can score it later.
                missing(task, "judge", f"{type(e).__name__}: {e}")
        rec = EvalRecord(
            eval_id=f"{cond.name}/{task.item_id}/{task.seed}",
            condition=cond.name,
            item_id=task.item_id,
            model=cond.model,
            system_prompt=cond.system_prompt,
            sim_prompt=task.sim_prompt,
            sim_model=sim.model,
            judge_model=judge_model,
            seed=task.seed,
            messages=traj.messages,
            reference=task.reference,
            assistant_tokens=traj.assistant_tokens,
            metrics=metrics,
            document=document,
            judge=judge,
            version=policy.version,
            created=time.time(),
        )
        if on_record is not None:
            await on_record(rec)
        return rec

    return [r for r in await asyncio.gather(*(one(t) for t in tasks)) if r is not None]


async def run_eval(
    conditions: Sequence[Condition],
    items: Sequence[Any],
    settings: EvalSettings,
    services: EvalServices,
    on_record: Callable[[EvalRecord], Awaitable[None]] | None = None,
    on_missing: Callable[[NotScored], None] | None = None,
) -> list[EvalRecord]:
    """All conditions over the same tasks. Conditions that share a model share one engine, and each
    engine is closed before the next model starts (one policy in memory at a time); `open_policy` may
    keep its engine for the next model instead (SwappingPolicies: a checkpoint of the same base)."""
    names = [c.name for c in conditions]
    if len(set(names)) != len(names):
        raise ValueError(f"condition names must be unique, got {names}")
    if not items:
        raise ValueError("no eval items")
    tasks = make_tasks(items, settings, services.environment)
    by_model: dict[str, list[Condition]] = {}
    for c in conditions:
        by_model.setdefault(c.model, []).append(c)
    records: list[EvalRecord] = []
    for model, conds in by_model.items():
        t0 = time.perf_counter()
        policy = await services.open_policy(model)
        log.info("policy %s ready in %.1fs", model, time.perf_counter() - t0)
        try:
            for cond in conds:
                t0 = time.perf_counter()
                recs = await play_condition(cond, tasks, policy, services, settings, on_record, on_missing)
                unscored = sum(not r.metrics for r in recs)
                log.info(
                    "condition %s: %d of %d conversations played in %.1fs (%d unscored)",
                    cond.name,
                    len(recs),
                    len(tasks),
                    time.perf_counter() - t0,
                    unscored,
                )
                records += recs
        finally:
            if policy.close is not None:
                await policy.close()
    return records
