"""random_words: a synthetic environment for throughput runs, with no simulator, no judge and no data.

The user opens with, and answers every assistant message with, `user_words` random words "t<id>"
(seeded by the item and the turn), until the assistant has spoken `turns` times. The reward is the
share of the assistant's words (whitespace-split, over all its messages) that are "low": whose CRC-32
is below `threshold` x 2^32. It is a fixed function of the text, so any tokenizer works; about
`threshold` of any vocabulary's words are low, so random text scores about `threshold` and its samples
spread around it; a policy raises it by preferring low words. With bench.common.random_qwen3's
word-level tokenizer a word is one token, in the user's messages and in the assistant's: conversations
are then `turns` x (user_words + the rollout's max_tokens) tokens long, CollabLLM-medium-like lengths
from random weights (docs/environments.md).

Registered as `random_words` in pyproject.toml.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from parley.environments.base import (
    Environment,
    EvalProtocol,
    Finished,
    ProgrammaticUser,
    PureMetric,
    Reward,
    TaskSource,
    UserTurn,
    split_by_key,
)
from parley.protocol.messages import ChatMessage, Task
from parley.tasks.data import rollout_fields, system_prompt_text

NAME = "random_words"
# The user's words are "t0".."t151642": one token each of bench.common.random_qwen3's tokenizer (its
# ids from 151643 on are Qwen3's chat tokens and the role names). Other tokenizers split them further.
USER_VOCAB = 151643
THANKS = "Thanks."  # the user's closing line; a closing turn is dropped from the conversation

# `parley up --env random_words` (no --config): a short CPU run of the embedded default (SmolLM2), three
# assistant turns of 64 tokens after user messages of 32 words. Not measured to learn: it shows the
# whole loop with a reward that varies within every group.
PRESET = (
    "env.options={n_items = 200, seed = 0, turns = 3, user_words = 32, threshold = 0.5}",
    "data.eval_fraction=0.1",
    "rollout.n=8",
    "rollout.max_tokens=64",
    "rollout.max_new_turns=5",  # the opening is the task's prefix: then assistant, user, assistant, user, assistant
    "learner.steps=10",
    "learner.groups_per_step=1",
    "learner.lr=1e-4",
    "learner.kl_coef=0.0",
    "learner.eval_every=5",
    "learner.eval_items=8",
)


@dataclass(frozen=True)
class Item:
    """One task: its id is its identity, and the seed of everything the user says in it."""

    item_id: str


def generate(n_items: int, seed: int) -> list[Item]:
    """n_items items of `seed`: the same seed always gives the same ones, another seed others."""
    if n_items < 1:
        raise ValueError(f"{NAME}: [env] options.n_items={n_items} must be >= 1")
    return [Item(f"s{seed}-{i:05d}") for i in range(n_items)]


# ---- the user --------------------------------------------------------------------------------


def user_message(hidden: str, turn: int, user_words: int) -> str:
    """The user's message before assistant turn `turn` (0: the opening) of the item `hidden`."""
    rng = random.Random(f"{NAME}/{hidden}/{turn}")
    return " ".join(f"t{rng.randrange(USER_VOCAB)}" for _ in range(user_words))


def respond(messages: Sequence[ChatMessage], hidden: str, *, turns: int, user_words: int) -> UserTurn:
    """The opening, then a new random message after each assistant message until there were `turns`."""
    said = sum(m.role == "assistant" for m in messages)
    if said >= turns:
        return UserTurn(THANKS, done=True)
    return UserTurn(user_message(hidden, said, user_words))


# ---- the reward ------------------------------------------------------------------------------


def assistant_words(conv: Finished) -> list[str]:
    return [w for m in conv.messages if m.role == "assistant" for w in m.content.split()]


def is_low(word: str, threshold: float) -> bool:
    return zlib.crc32(word.encode()) < threshold * 2**32


def low_share(conv: Finished, threshold: float) -> float:
    """The share of the assistant's words that are low (no words: 0)."""
    words = assistant_words(conv)
    return sum(is_low(w, threshold) for w in words) / len(words) if words else 0.0


def word_count(conv: Finished) -> float:
    return float(len(assistant_words(conv)))


# ---- tasks -----------------------------------------------------------------------------------


def _task(
    item: Item,
    *,
    run: str,
    task_id: str,
    n: int,
    rollout,
    seed: int,
    version: int,
    split: str = "train",
    user_words: int,
) -> Task:
    """The Task of an item: the user's opening as the prefix, the item id as the hidden reference, no
    system prompt unless [rollout].system_prompt names one."""
    return Task(
        task_id=task_id,
        run=run,
        item_id=item.item_id,
        n=n,
        prefix=[ChatMessage("user", user_message(item.item_id, 0, user_words))],
        reference=item.item_id,
        title=NAME,
        system_prompt=system_prompt_text(rollout.system_prompt) if rollout.system_prompt else "",
        sim_prompt=NAME,
        seed=seed,
        admitted_version=version,
        split=split,
        **rollout_fields(rollout),
    )


def _leakage_keys(item: Item) -> Mapping[str, str]:
    # Reported, never refused (leaks is empty): the reward does not depend on the item, so sharing one
    # across the split leaks no label; split_by_key shares none anyway.
    return {"item": item.item_id}


def environment(
    n_items: int = 200, seed: int = 0, turns: int = 3, user_words: int = 64, threshold: float = 0.5
) -> Environment:
    """random_words with `n_items` items of `seed`, `turns` assistant turns after user messages of
    `user_words` words, and `threshold` the share of words that are low; [data] eval_fraction and
    split_seed split the items."""
    if turns < 1 or user_words < 1:
        raise ValueError(f"{NAME}: [env] options.turns={turns} and user_words={user_words} must both be >= 1")
    if not 0.0 < threshold < 1.0:
        raise ValueError(
            f"{NAME}: [env] options.threshold={threshold} must be in (0, 1): the share of words that are low"
        )
    items = generate(n_items, seed)

    def train_eval(data) -> tuple[list[Item], list[Item]]:
        if str(data.path) not in ("bundled", "") or data.eval_path:
            raise ValueError(
                f"{NAME} draws its items from a seed; leave [data] path = 'bundled' and eval_path "
                f"empty (got path={data.path!r}, eval_path={data.eval_path!r}), set [env] options instead"
            )
        return split_by_key(items, lambda it: it.item_id, data.eval_fraction, data.split_seed)

    return Environment(
        name=NAME,
        description="random_words: random user words, reward = share of low-hashing assistant words (throughput runs)",
        tasks=TaskSource(
            train_eval=train_eval, task=partial(_task, user_words=user_words), leakage_keys=_leakage_keys, leaks=()
        ),
        user=ProgrammaticUser(name=NAME, respond=partial(respond, turns=turns, user_words=user_words)),
        reward=Reward(
            metrics=(
                PureMetric("low_share", compute=partial(low_share, threshold=threshold), weight=1.0),
                PureMetric("assistant_words", compute=word_count),
            )
        ),
        eval=EvalProtocol(columns=("low_share", "assistant_words"), select="low_share", selectable=("low_share",)),
        preset=PRESET,
    )
