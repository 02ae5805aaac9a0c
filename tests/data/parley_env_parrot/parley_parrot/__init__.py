"""parrot: the user says a phrase and the assistant should repeat it, word for word.

A complete parley environment in one file, built only from environments.base: a seeded task
source split by phrase, a programmatic user, an exact metric and a graded one, and its eval protocol.
The graded one gives even an untrained policy rewards that differ within a group, so GRPO has
something to learn from at the first step (tests/e2e/test_env_plugin_train.py trains one).
"""

from __future__ import annotations

import difflib
import random
import time
from dataclasses import dataclass

from parley.environments.base import (
    Environment,
    EvalProtocol,
    ProgrammaticUser,
    PureMetric,
    Reward,
    TaskSource,
    UserTurn,
    split_by_key,
)
from parley.protocol.messages import ChatMessage, Task

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


def said(conv) -> str:
    last = next((m.content for m in reversed(conv.messages) if m.role == "assistant"), "")
    return last.strip().strip(".!").lower()


def echo(conv) -> float:
    return 1.0 if said(conv) == conv.reference else 0.0


def similarity(conv) -> float:
    # partial credit: how much of the answer lines up with the phrase, character by character (0..1)
    return difflib.SequenceMatcher(None, said(conv), conv.reference).ratio()


def task(item: Phrase, *, run, task_id, n, rollout, seed, version, split="train") -> Task:
    phrase = item.item_id
    return Task(
        task_id=task_id,
        run=run,
        item_id=phrase,
        n=n,
        prefix=[ChatMessage("user", respond([], phrase).message)],
        reference=phrase,
        sim_prompt="parrot",
        max_new_turns=rollout.max_new_turns,
        max_tokens=rollout.max_tokens,
        seed=seed,
        admitted_version=version,
        split=split,
        created=time.time(),
    )


ENVIRONMENT = Environment(
    name="parrot",
    description="parrot: repeat the user's phrase (programmatic user, exact reward)",
    tasks=TaskSource(
        train_eval=lambda data: split_by_key(phrases(), lambda p: p.item_id, data.eval_fraction, data.split_seed),
        task=task,
        leakage_keys=lambda p: {"phrase": p.item_id},
        leaks=("phrase",),
    ),
    user=ProgrammaticUser(name="parrot", respond=respond),
    reward=Reward(
        metrics=(PureMetric("echo", compute=echo, weight=1.0), PureMetric("similarity", compute=similarity, weight=0.5))
    ),
    eval=EvalProtocol(columns=("echo", "similarity"), select="echo", selectable=("echo", "similarity")),
)
