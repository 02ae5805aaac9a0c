"""The environment interface: the four things a multi-turn task names so that every role can play
it without knowing it: its task source, its user side, its reward and its eval protocol.

Plain frozen dataclasses of values and functions, so an environment is written without subclassing
anything and can be inspected. Environments are built by the modules the `parley.environments`
entry points name (registry.py); the roles call what is here (docs/environments.md, "wiring").
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from parley.protocol.messages import ChatMessage, JudgeReply, SimReply, SimRequest, Task


class Finished(Protocol):
    """What a metric reads of a finished conversation. protocol.messages.Trajectory and EvalRecord
    both have these attributes, so a metric scores either one as it is."""

    messages: Sequence[ChatMessage]
    reference: str  # Task.reference: what the user had in mind (the hidden state)
    assistant_tokens: int


@dataclass(frozen=True)
class Conversation:
    """A Finished built by hand: a trajectory joined with one of its sampled futures, or a test's."""

    messages: Sequence[ChatMessage]
    reference: str = ""
    assistant_tokens: int = 0
    # index of the first message the policy's sample added (the dataset prefix and system prompt come
    # before it); a metric that counts only what the sample added reads it (0 on a Finished without it)
    new_from: int = 0


# ---- task source -----------------------------------------------------------------------------


class TaskBuilder(Protocol):
    """item -> the Task asking for n samples of it; the signature of tasks.data.task_from_item.
    `rollout` is the [rollout] section (a config.learner.RolloutConfig or anything with its fields)."""

    def __call__(
        self, item: Any, *, run: str, task_id: str, n: int, rollout: Any, seed: int, version: int, split: str = "train"
    ) -> Task: ...


@dataclass(frozen=True)
class TaskSource:
    """Where the tasks come from. Items are the environment's own type; all parley needs of one
    is `item_id` (the dataset identity in ledgers) and what the functions below make of it."""

    # the [data] section (path, eval_fraction, split_seed, eval_path) -> (train items, eval items)
    train_eval: Callable[[Any], tuple[Sequence[Any], Sequence[Any]]]
    task: TaskBuilder
    # item -> {kind: key}: a key present on both sides of the split is an overlap of that kind
    leakage_keys: Callable[[Any], Mapping[str, str]]
    # the kinds whose overlap is label leakage (the leakage guard refuses it); other kinds are only reported
    leaks: tuple[str, ...] = ()
    # (the [data] section, an items file's path) -> (training items, the file's items): the benchmark's
    # `--items FILE`; None: the held-out items come from train_eval only
    items_file: Callable[[Any, str], tuple[Sequence[Any], Sequence[Any]]] | None = None


def split_by_key(
    items: Sequence[Any], key: Callable[[Any], str], eval_fraction: float, seed: int = 0
) -> tuple[list[Any], list[Any]]:
    """Split by a leakage key, so no key is on both sides: a seeded shuffle of the distinct keys,
    the first round(len x eval_fraction) of them (at least one when eval_fraction > 0) held out."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in [0, 1); set [data] eval_fraction")
    keys = sorted({key(it) for it in items})
    random.Random(seed).shuffle(keys)
    n_eval = round(len(keys) * eval_fraction)
    if eval_fraction > 0 and n_eval == 0 and len(keys) > 1:
        n_eval = 1
    held_keys = set(keys[:n_eval])
    return [it for it in items if key(it) not in held_keys], [it for it in items if key(it) in held_keys]


def find_overlap(source: TaskSource, train: Sequence[Any], held: Sequence[Any]) -> dict[str, list[tuple[str, str]]]:
    """kind -> (train item_id, eval item_id) pairs sharing that kind's key, for every kind either
    side names; empty lists where nothing is shared."""
    index: dict[tuple[str, str], list[str]] = {}
    kinds: set[str] = set(source.leaks)
    for it in train:
        for kind, key in source.leakage_keys(it).items():
            kinds.add(kind)
            index.setdefault((kind, key), []).append(it.item_id)
    out: dict[str, list[tuple[str, str]]] = {k: [] for k in sorted(kinds)}
    for it in held:
        for kind, key in source.leakage_keys(it).items():
            out.setdefault(kind, []).extend((a, it.item_id) for a in index.get((kind, key), []))
    return out


def leaking(source: TaskSource, train: Sequence[Any], held: Sequence[Any]) -> dict[str, list[tuple[str, str]]]:
    """The overlaps that are label leakage (kinds in source.leaks) and not empty."""
    return {k: v for k, v in find_overlap(source, train, held).items() if k in source.leaks and v}


# ---- user side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulatorUser:
    """The user is the LLM simulator service (`parley sim`), run under this named prompt
    (services/sim/prompts/<prompt>.txt) unless [rollout].sim_prompt names another."""

    prompt: str


@dataclass(frozen=True)
class UserTurn:
    """A programmatic user's next message; done=True ends the conversation (its message is dropped,
    as the simulator's closing words are)."""

    message: str
    done: bool = False


@dataclass(frozen=True)
class ProgrammaticUser:
    """A user that is a pure function, run by the actor in-process (no service): (the conversation
    so far from the assistant's side, system prompt left out; the hidden state Task.reference) ->
    the next user turn. Pure: the same conversation and state always give the same turn, so a
    redelivered task replays exactly."""

    name: str  # recorded as Task.sim_prompt / Trajectory.sim_prompt
    respond: Callable[[Sequence[ChatMessage], str], UserTurn]


UserSide = SimulatorUser | ProgrammaticUser


class LocalUser:
    """A ProgrammaticUser behind the simulator client's interface (`await ask(SimRequest) -> SimReply`),
    so the conversation loop that asks services.sim.client.SimClient can ask this instead, unchanged."""

    def __init__(self, user: ProgrammaticUser):
        self.user = user

    async def ask(self, req: SimRequest) -> SimReply:
        turn = self.user.respond(list(req.messages), req.reference)
        return SimReply(message=turn.message, done=turn.done, model=f"programmatic:{self.user.name}")


# ---- reward ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PureMetric:
    """A metric computed from the finished conversation alone."""

    name: str
    compute: Callable[[Finished], float]
    weight: float | None = None  # default weight in the total; None: reported, never rewarded


@dataclass(frozen=True)
class JudgeMetric:
    """A metric read from the reply of one judge operation (`parley.svc.judge.<op>`) on the
    conversation. `value` raises ValueError when the reply is unusable (never a default score)."""

    name: str
    op: str
    value: Callable[[JudgeReply, Finished], float]
    weight: float | None = None


Metric = PureMetric | JudgeMetric


@dataclass(frozen=True)
class Reward:
    """The named metrics of one conversation and the default weights of the total."""

    metrics: tuple[Metric, ...]
    # (conversation, judge replies by op) -> the text the reward judged as the conversation's outcome,
    # recorded as Scored.document (CollabLLM: the final document); None: nothing is recorded
    document: Callable[[Finished, Mapping[str, JudgeReply]], str] | None = None

    def __post_init__(self) -> None:
        names = [m.name for m in self.metrics]
        if not names:
            raise ValueError("a Reward needs at least one metric")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"metric names {dupes} appear more than once; each metric needs its own name")
        if not any(m.weight for m in self.metrics):
            raise ValueError(f"no metric of {names} has a non-zero default weight; the total would always be 0")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.metrics)

    @property
    def judge_ops(self) -> tuple[str, ...]:
        """The judge operations a conversation needs, each once, in metric order; () = no judge."""
        return tuple(dict.fromkeys(m.op for m in self.metrics if isinstance(m, JudgeMetric)))

    def default_weights(self) -> dict[str, float]:
        return {m.name: m.weight for m in self.metrics if m.weight is not None}

    def evaluate(self, conv: Finished, replies: Mapping[str, JudgeReply] | None = None) -> dict[str, float]:
        """Every metric of `conv`, given the judge's reply per operation in judge_ops."""
        replies = replies or {}
        missing = [op for op in self.judge_ops if op not in replies]
        if missing:
            raise ValueError(f"judge replies for {missing} are missing; this reward needs {list(self.judge_ops)}")
        out = {}
        for m in self.metrics:
            value = m.compute(conv) if isinstance(m, PureMetric) else m.value(replies[m.op], conv)
            out[m.name] = float(value)
            if not math.isfinite(out[m.name]):
                raise ValueError(f"metric {m.name!r} is {out[m.name]}; a metric must be a finite number")
        return out


# ---- eval protocol ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalProtocol:
    """What the benchmark table shows and which of it `parley select` uses unless told otherwise.
    A column is a reward metric or one of `derived` (computed from the metrics and the record)."""

    columns: tuple[str, ...]
    select: str
    # the columns `parley select --metric` accepts; the training reward is never one of them
    selectable: tuple[str, ...]
    derived: Mapping[str, Callable[[Mapping[str, float], Finished], float]] = field(default_factory=dict)
    # how a held-out item becomes a benchmark task, when not as in training (TaskSource.task, split "eval")
    task: TaskBuilder | None = None

    def __post_init__(self) -> None:
        if self.select not in self.selectable:
            raise ValueError(f"select={self.select!r} is not one of selectable {list(self.selectable)}")
        stray = [c for c in self.selectable if c not in self.columns]
        if stray:
            raise ValueError(f"selectable {stray} are not table columns {list(self.columns)}")

    def value(self, column: str, metrics: Mapping[str, float], record: Finished) -> float:
        """One record's value of a column."""
        if column in self.derived:
            return float(self.derived[column](metrics, record))
        if column not in metrics:
            raise ValueError(f"column {column!r} is neither derived nor among the record's metrics {sorted(metrics)}")
        return float(metrics[column])


# ---- the environment -------------------------------------------------------------------------


@dataclass(frozen=True)
class Environment:
    """A multi-turn task parley can train on. `name` is the entry-point name every role resolves."""

    name: str
    description: str  # one line, for listings
    tasks: TaskSource
    user: UserSide
    reward: Reward
    eval: EvalProtocol
    # `section.key=value` overrides (the syntax of --set) that `parley up --env NAME` lays over the
    # embedded default when no --config is given, before the user's --set: the settings under which
    # this environment is shown to learn (docs/environments.md). Empty: the embedded default as it is.
    preset: tuple[str, ...] = ()
    # The options of this environment a run sets in [scorer] (names of [scorer] keys, e.g. CollabLLM's
    # bleu_variant): deploy/config.py passes their values in as [env] options, so a run sets them in one
    # place, and a caller holding only a [scorer] section builds the reward it describes (default_scored_as).
    scorer_options: tuple[str, ...] = ()
    # `parley replay --scoring NAME`: named sets of [scorer] settings (of scorer_options) to re-score a log by
    scoring_variants: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [c for c in self.eval.columns if c not in self.reward.names and c not in self.eval.derived]
        if unknown:
            raise ValueError(
                f"environment {self.name!r}: eval columns {unknown} are neither reward metrics "
                f"{list(self.reward.names)} nor derived columns {sorted(self.eval.derived)}"
            )

    def eval_task(self, item: Any, *, run: str, task_id: str, n: int, rollout: Any, seed: int, version: int) -> Task:
        """The benchmark's task for a held-out item: the eval protocol's builder, else the training one."""
        build = self.eval.task or self.tasks.task
        return build(item, run=run, task_id=task_id, n=n, rollout=rollout, seed=seed, version=version, split="eval")

    @property
    def needs_simulator(self) -> bool:
        return isinstance(self.user, SimulatorUser)

    @property
    def needs_judge(self) -> bool:
        return bool(self.reward.judge_ops)
