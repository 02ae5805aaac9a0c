"""hidden_goal: an environment with no LLM judge and no simulator, where asking good questions pays.

The user wants something (a pizza, a train ticket, ...) with a hidden value for each of the domain's
slots. It opens vaguely, then answers each assistant message truthfully and tersely, naming only the
slots that message asks about. The assistant ends with one line `FINAL: slot=value, ...`; the reward
is the fraction of slots it got exactly right minus TURN_COST per assistant turn, so guessing loses,
and asking about several slots at once beats asking one at a time.

Two options make the world easier for a small policy without changing what is rewarded (the final
answer's match with the goal, minus the turn cost): `nudge = "slots"` (the user's answer to a message
that asks nothing names the slots still unknown) and `answer = "mentions"` (the final answer is the
last message's plain words: a slot is right when that message names the goal's value and no other
value of the slot; a FINAL line is not needed). The defaults ("fixed", "final") are the world above.

Goals are drawn from a seed (the domains are domains.toml); the split is by goal. Registered as
`hidden_goal` in pyproject.toml; docs/environments.md walks through this file.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import string
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from importlib import resources

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

NAME = "hidden_goal"
TURN_COST = 0.05  # reward per assistant turn: asking for every slot at once, then answering, costs 0.1
NUDGES = ("fixed", "slots")  # [env] options.nudge: world().nudge, or world().nudge_slots naming the unknown slots
ANSWERS = ("final", "mentions")  # [env] options.answer: the FINAL line, or the last message's words

# `parley up --env hidden_goal` (no --config): the run bench/env_learning.py measured learning with on
# 2 CPU cores (docs/benchmarks.md, "Learning on hidden_goal"): SmolLM2 sampled at 0.7 (at 1.0 it writes
# mostly noise), the easier world, 15 steps of one group of 8, held-out goal_match at versions 0, 5,
# 10 and 15 on the 24 held-out goals.
PRESET = (
    'env.options={n_items = 120, seed = 0, nudge = "slots", answer = "mentions"}',
    "data.eval_fraction=0.2",
    "rollout.n=8",
    "rollout.max_tokens=32",
    "rollout.max_new_turns=6",
    "actor.sampling.temperature=0.7",
    "learner.steps=15",
    "learner.groups_per_step=1",
    "learner.lr=1e-4",
    "learner.kl_coef=0.0",
    "learner.checkpoint_every=5",
    "learner.eval_every=5",
    "learner.eval_items=24",
)


# ---- the world: domains and goals --------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    name: str
    values: tuple[str, ...]
    cues: tuple[str, ...]  # besides its name and values, words that ask about it


@dataclass(frozen=True)
class Domain:
    name: str
    opening: str
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class World:
    domains: dict[str, Domain]
    nudge: str
    nudge_slots: str  # a string.Template: $slots are the slots the user has not been asked about yet
    thanks: str


@cache
def world() -> World:
    raw = tomllib.loads((resources.files(__name__) / "domains.toml").read_text())
    domains = {
        d["name"]: Domain(
            d["name"],
            d["opening"],
            tuple(Slot(s["name"], tuple(s["values"]), tuple(s.get("cues", ()))) for s in d["slots"]),
        )
        for d in raw["domain"]
    }
    return World(domains=domains, nudge=raw["nudge"], nudge_slots=raw["nudge_slots"], thanks=raw["thanks"])


def _slug(text: str) -> str:
    return "-".join(text.split())


@dataclass(frozen=True)
class Goal:
    """One item: a domain and the value the user wants for each of its slots (in slot order)."""

    domain: str
    values: tuple[tuple[str, str], ...]

    @property
    def item_id(self) -> str:
        # the goal itself (values in slot order, no spaces): the same goal has the same id under every seed
        return f"{_slug(self.domain)}/" + ".".join(_slug(v) for _, v in self.values)

    def hidden(self) -> str:
        """The hidden state, carried as Task.reference to the user and the reward."""
        return json.dumps({"domain": self.domain, "goal": dict(self.values)})


def all_goals() -> list[Goal]:
    out = []
    for d in world().domains.values():
        for combo in itertools.product(*(s.values for s in d.slots)):
            out.append(Goal(d.name, tuple(zip((s.name for s in d.slots), combo))))
    return out


def generate(n_items: int, seed: int) -> list[Goal]:
    """n_items distinct goals drawn with `seed`: the same seed always draws the same list."""
    goals = all_goals()
    if not 1 <= n_items <= len(goals):
        raise ValueError(f"n_items={n_items} must be in 1..{len(goals)} (the distinct goals domains.toml allows)")
    return random.Random(seed).sample(goals, n_items)


def parse_hidden(hidden: str) -> tuple[Domain, dict[str, str]]:
    try:
        raw = json.loads(hidden)
        domain = world().domains[raw["domain"]]
        goal = {s.name: str(raw["goal"][s.name]) for s in domain.slots}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"hidden state {hidden[:120]!r} is not a {NAME} goal ({type(e).__name__}: {e}); "
            f"tasks of {NAME} carry Goal.hidden() as their reference"
        ) from None
    return domain, goal


# ---- the conversation: what the assistant said, the user's reply ------------------------------

_FINAL = re.compile(r"\bfinal\s*:(.*)", re.IGNORECASE | re.DOTALL)
_PAIR = re.compile(r"^\s*([^=:]+?)\s*[=:]\s*(.+?)\s*$")


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s-]", " ", text.lower()).split())


def last_assistant(messages: Sequence[ChatMessage]) -> str | None:
    return next((m.content for m in reversed(messages) if m.role == "assistant"), None)


def final_answer(text: str) -> dict[str, set[str]] | None:
    """The slots and values after `FINAL:` (slot -> every value given for it), or None if there is
    no final line. A slot given two values is a hedge, and is scored wrong."""
    m = _FINAL.search(text)
    if m is None:
        return None
    out: dict[str, set[str]] = {}
    for part in re.split(r"[,;\n]", m.group(1)):
        pair = _PAIR.match(part)
        if pair:
            out.setdefault(_norm(pair.group(1)), set()).add(_norm(pair.group(2)))
    return out


def stated_values(text: str, slot: Slot) -> set[str]:
    """The slot's values `text` names as words (normalized). A value inside a longer one that is
    named ('large' in 'extra large') is not counted on its own."""
    words = _norm(text)
    found = set()
    for value in sorted((_norm(v) for v in slot.values), key=len, reverse=True):
        word = re.compile(rf"(?<!\S){re.escape(value)}(?!\S)")
        if word.search(words):
            found.add(value)
            words = word.sub("|", words)
    return found


def mentioned_answer(text: str, domain: Domain) -> dict[str, set[str]]:
    """`answer = "mentions"`: slot -> the values the message names (a slot named with two values is wrong)."""
    return {_norm(s.name): stated_values(text, s) for s in domain.slots}


def is_final(text: str, domain: Domain, answer: str) -> bool:
    """Whether the message is the assistant's final answer: a FINAL line, or under "mentions" also
    a message naming exactly one value for every slot."""
    if final_answer(text) is not None:
        return True
    return answer == "mentions" and all(len(v) == 1 for v in mentioned_answer(text, domain).values())


def asks_about(text: str, slot: Slot) -> bool:
    words = f" {_norm(text)} "
    return any(f" {_norm(w)} " in words for w in (slot.name, *slot.cues, *slot.values))


def _join(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def respond(messages: Sequence[ChatMessage], hidden: str, *, nudge: str = "fixed", answer: str = "final") -> UserTurn:
    """The user: the opening line, then a terse truthful answer naming exactly the slots the
    assistant's last message asks about, until the assistant gives a final answer. A message that
    asks about nothing gets the nudge: world().nudge, or with nudge="slots" world().nudge_slots
    naming the slots no earlier assistant message asked about (world().nudge once none is left)."""
    domain, goal = parse_hidden(hidden)
    said = last_assistant(messages)
    if said is None:
        return UserTurn(domain.opening)
    if is_final(said, domain, answer):
        return UserTurn(world().thanks, done=True)
    asked = [s for s in domain.slots if asks_about(said, s)]
    if asked:
        return UserTurn(", ".join(f"{s.name}: {goal[s.name]}" for s in asked) + ".")
    if nudge == "slots":
        earlier = [m.content for m in messages if m.role == "assistant"][:-1]  # each was answered
        unknown = [s.name for s in domain.slots if not any(asks_about(t, s) for t in earlier)]
        if unknown:
            return UserTurn(string.Template(world().nudge_slots).substitute(slots=_join(unknown)))
    return UserTurn(world().nudge)


# ---- the reward ------------------------------------------------------------------------------


def goal_match(conv: Finished, answer: str = "final") -> float:
    """The fraction of the goal's slots the assistant's last message states exactly: in its final
    line (none: 0), or with answer="mentions" in its words (one value of the slot named, the goal's)."""
    domain, goal = parse_hidden(conv.reference)
    text = last_assistant(conv.messages) or ""
    stated = final_answer(text) if answer == "final" else mentioned_answer(text, domain)
    if stated is None:
        return 0.0
    right = sum(stated.get(_norm(slot), set()) == {_norm(value)} for slot, value in goal.items())
    return right / len(goal)


def exact(conv: Finished, answer: str = "final") -> float:
    return 1.0 if goal_match(conv, answer) == 1.0 else 0.0


def assistant_turns(conv: Finished) -> float:
    return float(sum(m.role == "assistant" for m in conv.messages))


# ---- tasks -----------------------------------------------------------------------------------


def system_prompt(domain: Domain) -> str:
    template = string.Template((resources.files(__name__) / "system.txt").read_text())
    names = [s.name for s in domain.slots]
    return template.substitute(
        domain=domain.name,
        slots=_join(names),
        example=", ".join(f"{n}=<{n}>" for n in names),
    ).strip()


def _task(
    item: Goal, *, run: str, task_id: str, n: int, rollout, seed: int, version: int, split: str = "train"
) -> Task:
    """The Task for a goal: the user's opening line as the prefix, the goal as the hidden reference.
    [rollout].system_prompt replaces the domain's system prompt when set."""
    domain = world().domains[item.domain]
    return Task(
        task_id=task_id,
        run=run,
        item_id=item.item_id,
        n=n,
        prefix=[ChatMessage("user", domain.opening)],
        reference=item.hidden(),
        title=domain.name,
        system_prompt=system_prompt_text(rollout.system_prompt) if rollout.system_prompt else system_prompt(domain),
        sim_prompt=NAME,
        seed=seed,
        admitted_version=version,
        split=split,
        **rollout_fields(rollout),
    )


def _leakage_keys(item: Goal) -> Mapping[str, str]:
    return {"goal": item.item_id}


def environment(n_items: int = 120, seed: int = 0, nudge: str = "fixed", answer: str = "final") -> Environment:
    """hidden_goal with `n_items` goals drawn with `seed`; [data] eval_fraction and split_seed split them.
    `nudge` (NUDGES) and `answer` (ANSWERS): the module docstring; the defaults are the plain world."""
    for key, value, allowed in (("nudge", nudge, NUDGES), ("answer", answer, ANSWERS)):
        if value not in allowed:
            raise ValueError(f"{NAME}: [env] options.{key}={value!r} is not one of {allowed}; set one of those")
    goals = generate(n_items, seed)

    def train_eval(data) -> tuple[list[Goal], list[Goal]]:
        if str(data.path) not in ("bundled", "") or data.eval_path:
            raise ValueError(
                f"{NAME} draws its goals from a seed; leave [data] path = 'bundled' and eval_path "
                f"empty (got path={data.path!r}, eval_path={data.eval_path!r}), set [env] options instead"
            )
        return split_by_key(goals, lambda g: g.item_id, data.eval_fraction, data.split_seed)

    return Environment(
        name=NAME,
        description="hidden_goal: find out the user's hidden order by asking (programmatic user, exact reward)",
        tasks=TaskSource(train_eval=train_eval, task=_task, leakage_keys=_leakage_keys, leaks=("goal",)),
        user=ProgrammaticUser(name=NAME, respond=partial(respond, nudge=nudge, answer=answer)),
        reward=Reward(
            metrics=(
                PureMetric("goal_match", compute=partial(goal_match, answer=answer), weight=1.0),
                PureMetric("exact", compute=partial(exact, answer=answer)),
                PureMetric("assistant_turns", compute=assistant_turns, weight=-TURN_COST),
            )
        ),
        eval=EvalProtocol(
            columns=("goal_match", "exact", "assistant_turns"), select="goal_match", selectable=("goal_match", "exact")
        ),
        preset=PRESET,
    )
