"""parrot: the user says a phrase and the assistant should repeat it, word for word.

A complete parley environment in one file, built only from environments.base: a seeded task
source split by phrase, a programmatic user, one exact metric, and its eval protocol.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from environments.base import (
    Environment,
    EvalProtocol,
    ProgrammaticUser,
    PureMetric,
    Reward,
    TaskSource,
    UserTurn,
    split_by_key,
)
from protocol.messages import ChatMessage, Task

ADJECTIVES = ("red", "quiet", "brave", "small", "golden", "early")
NOUNS = ("kite", "river", "lantern", "harbour", "violin", "orchard")


@dataclass(frozen=True)
class Phrase:
    item_id: str  # the phrase itself


def phrases(seed: int = 0) -> list[Phrase]:
    every = [Phrase(f"{a} {n}") for a in ADJECTIVES for n in NOUNS]
    random.Random(seed).shuffle(every)
    return every


def respond(messages, phrase: str) -> UserTurn:
    # the phrase once; whatever the assistant answers, that was its one chance
    if any(m.role == "assistant" for m in messages):
        return UserTurn("Thanks.", done=True)
    return UserTurn(f"Repeat after me: {phrase}")


def echo(conv) -> float:
    said = next((m.content for m in reversed(conv.messages) if m.role == "assistant"), "")
    return 1.0 if said.strip().strip(".!").lower() == conv.reference else 0.0


def task(item: Phrase, *, run, task_id, n, rollout, seed, version, split="train") -> Task:
    phrase = item.item_id
    return Task(task_id=task_id, run=run, item_id=phrase, n=n, prefix=[ChatMessage("user", respond([], phrase).message)],
                reference=phrase, sim_prompt="parrot", max_new_turns=rollout.max_new_turns,
                max_tokens=rollout.max_tokens, seed=seed, admitted_version=version, split=split, created=time.time())


ENVIRONMENT = Environment(
    name="parrot",
    description="parrot: repeat the user's phrase (programmatic user, exact reward)",
    tasks=TaskSource(
        train_eval=lambda data: split_by_key(phrases(), lambda p: p.item_id, data.eval_fraction, data.split_seed),
        task=task, leakage_keys=lambda p: {"phrase": p.item_id}, leaks=("phrase",),
    ),
    user=ProgrammaticUser(name="parrot", respond=respond),
    reward=Reward(metrics=(PureMetric("echo", compute=echo, weight=1.0),)),
    eval=EvalProtocol(columns=("echo",), select="echo", selectable=("echo",)),
)
