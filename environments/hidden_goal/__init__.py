"""hidden_goal: an environment with no LLM judge and no simulator, where asking good questions pays.

The user wants something (a pizza, a train ticket, ...) with a hidden value for each of the domain's
slots. It opens vaguely, then answers each assistant message truthfully and tersely, naming only the
slots that message asks about. The assistant ends with one line `FINAL: slot=value, ...`; the reward
is the fraction of slots it got exactly right minus TURN_COST per assistant turn, so guessing loses,
and asking about several slots at once beats asking one at a time.

Goals are drawn from a seed (the domains are domains.toml); the split is by goal. Registered as
`hidden_goal` in pyproject.toml; docs/environments.md walks through this file.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import string
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from environments.base import (
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
from protocol.messages import ChatMessage, Task
from tasks.data import system_prompt_text

NAME = "hidden_goal"
TURN_COST = 0.05  # reward per assistant turn: asking for every slot at once, then answering, costs 0.1


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
    thanks: str


@cache
def world() -> World:
    raw = tomllib.loads((resources.files(__name__) / "domains.toml").read_text())
    domains = {
        d["name"]: Domain(d["name"], d["opening"], tuple(
            Slot(s["name"], tuple(s["values"]), tuple(s.get("cues", ()))) for s in d["slots"]))
        for d in raw["domain"]
    }
    return World(domains=domains, nudge=raw["nudge"], thanks=raw["thanks"])


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
        raise ValueError(f"hidden state {hidden[:120]!r} is not a {NAME} goal ({type(e).__name__}: {e}); "
                         f"tasks of {NAME} carry Goal.hidden() as their reference") from None
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


def asks_about(text: str, slot: Slot) -> bool:
    words = f" {_norm(text)} "
    return any(f" {_norm(w)} " in words for w in (slot.name, *slot.cues, *slot.values))


def respond(messages: Sequence[ChatMessage], hidden: str) -> UserTurn:
    """The user: the opening line, then a terse truthful answer naming exactly the slots the
    assistant's last message asks about, until the assistant gives a final answer."""
    domain, goal = parse_hidden(hidden)
    said = last_assistant(messages)
    if said is None:
        return UserTurn(domain.opening)
    if final_answer(said) is not None:
        return UserTurn(world().thanks, done=True)
    asked = [s for s in domain.slots if asks_about(said, s)]
    if not asked:
        return UserTurn(world().nudge)
    return UserTurn(", ".join(f"{s.name}: {goal[s.name]}" for s in asked) + ".")


# ---- the reward ------------------------------------------------------------------------------


def goal_match(conv: Finished) -> float:
    """The fraction of the goal's slots the assistant's last message states exactly; 0 without a final line."""
    _, goal = parse_hidden(conv.reference)
    answer = final_answer(last_assistant(conv.messages) or "")
    if answer is None:
        return 0.0
    right = sum(answer.get(_norm(slot), set()) == {_norm(value)} for slot, value in goal.items())
    return right / len(goal)


def exact(conv: Finished) -> float:
    return 1.0 if goal_match(conv) == 1.0 else 0.0


def assistant_turns(conv: Finished) -> float:
    return float(sum(m.role == "assistant" for m in conv.messages))


# ---- tasks -----------------------------------------------------------------------------------


def system_prompt(domain: Domain) -> str:
    template = string.Template((resources.files(__name__) / "system.txt").read_text())
    names = [s.name for s in domain.slots]
    return template.substitute(
        domain=domain.name,
        slots=", ".join(names[:-1]) + f" and {names[-1]}",
        example=", ".join(f"{n}=<{n}>" for n in names),
    ).strip()


def _task(item: Goal, *, run: str, task_id: str, n: int, rollout, seed: int, version: int,
          split: str = "train") -> Task:
    """The Task for a goal: the user's opening line as the prefix, the goal as the hidden reference.
    [rollout].system_prompt replaces the domain's system prompt when set."""
    domain = world().domains[item.domain]
    return Task(
        task_id=task_id, run=run, item_id=item.item_id, n=n, mode=rollout.mode,
        prefix=[ChatMessage("user", domain.opening)],
        reference=item.hidden(), title=domain.name,
        system_prompt=system_prompt_text(rollout.system_prompt) if rollout.system_prompt else system_prompt(domain),
        sim_prompt=NAME,
        max_new_turns=rollout.max_new_turns, max_tokens=rollout.max_tokens,
        futures=rollout.futures if rollout.mode == "next_turn" else 0, future_turns=rollout.future_turns,
        seed=seed, admitted_version=version, split=split, created=time.time(),
    )


def _leakage_keys(item: Goal) -> Mapping[str, str]:
    return {"goal": item.item_id}


def environment(n_items: int = 120, seed: int = 0) -> Environment:
    """hidden_goal with `n_items` goals drawn with `seed`; [data] eval_fraction and split_seed split them."""
    goals = generate(n_items, seed)

    def train_eval(data) -> tuple[list[Goal], list[Goal]]:
        if str(data.path) not in ("bundled", "") or data.eval_path:
            raise ValueError(f"{NAME} draws its goals from a seed; leave [data] path = 'bundled' and eval_path "
                             f"empty (got path={data.path!r}, eval_path={data.eval_path!r}), set [env] options instead")
        return split_by_key(goals, lambda g: g.item_id, data.eval_fraction, data.split_seed)

    return Environment(
        name=NAME,
        description="hidden_goal: find out the user's hidden order by asking (programmatic user, exact reward)",
        tasks=TaskSource(train_eval=train_eval, task=_task, leakage_keys=_leakage_keys, leaks=("goal",)),
        user=ProgrammaticUser(name=NAME, respond=respond),
        reward=Reward(metrics=(
            PureMetric("goal_match", compute=goal_match, weight=1.0),
            PureMetric("exact", compute=exact),
            PureMetric("assistant_turns", compute=assistant_turns, weight=-TURN_COST),
        )),
        eval=EvalProtocol(columns=("goal_match", "exact", "assistant_turns"), select="goal_match",
                          selectable=("goal_match", "exact")),
    )
