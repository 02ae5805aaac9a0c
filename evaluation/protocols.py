"""Named benchmark protocols for `parley eval --protocol NAME`: a protocol fixes the settings a published
result was measured under (simulator prompt, messages, tokens, thinking, items, the arms), so a user
runs that benchmark by one name instead of a line of flags. deploy/cli_eval.py calls `apply` before
any work starts; docs/benchmark.md gives the table that tests/unit/test_eval_protocol.py binds to CARD.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from parley.evaluation.runner import Condition
from parley.tasks.data import system_prompt_text


@dataclass(frozen=True)
class Protocol:
    """A benchmark's fixed settings. The arms: `baseline` (the base model, named so by the user),
    any number of trained versions, and `prompted` (the baseline's model with `prompted_system_prompt`,
    added by the protocol)."""

    name: str
    environment: str  # the environment whose benchmark it is (its items, user and reward)
    sim_prompt: str  # the simulator's prompt variant (actors/prompts/sim/<name>.txt)
    max_new_turns: int  # messages per conversation, user and assistant; the simulator opens
    assistant_max_tokens: int
    enable_thinking: bool
    seeds: int  # simulator seeds per item
    n_items: int  # held-out items, one per reference document
    baseline: str
    prompted: str
    prompted_system_prompt: str  # a bundled name under tasks/prompts/system/


# The CollabLLM model card's benchmark: `--user_sim_prompt sim_gap_paper_lazy_full
# --assistant_max_tokens 4096 --max_new_turns 14`, n = 100, thinking off, against the base model and
# the base model prompted with CollabLLM's proact instruction (ours: tasks/prompts/system/proact.txt).
CARD = Protocol(
    name="card",
    environment="collabllm_medium",
    sim_prompt="lazy_full",
    max_new_turns=14,
    assistant_max_tokens=4096,
    enable_thinking=False,
    seeds=1,
    n_items=100,
    baseline="base",
    prompted="proact",
    prompted_system_prompt="proact",
)

PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (CARD,)}

# the `parley eval` option that sets each fixed field, for the errors
FLAGS = {
    "sim_prompt": "--user-sim-prompt",
    "max_new_turns": "--max-new-turns",
    "assistant_max_tokens": "--assistant-max-tokens",
    "enable_thinking": "--thinking/--no-thinking",
    "seeds": "--seeds",
}


def protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"--protocol {name!r} not known; use one of {', '.join(PROTOCOLS)} (or leave it out)")
    return PROTOCOLS[name]


@dataclass(frozen=True)
class Applied:
    """What a protocol makes of the command line: the settings, the arms in table order, the baseline."""

    settings: dict[str, object]  # EvalSettings fields
    conditions: list[Condition]
    baseline: str
    n_items: int


def apply(
    p: Protocol, given: Mapping[str, object], conditions: Sequence[Condition], baseline: str | None, n_items: int | None
) -> Applied:
    """Check the command line against `p` and build the run. `given` holds the fixed fields the user set
    (a None value: not set); one that differs from the protocol's is refused rather than silently
    overridden. The user names the baseline arm and any versions; the protocol adds the prompted arm on
    the baseline's model. Raises ValueError with a one-line message naming the value and the fix."""
    for key, value in given.items():
        if value is not None and value != getattr(p, key):
            if isinstance(value, bool):  # a switch: name the one given, "--thinking", not "on"
                given_text = ("--" if value else "--no-") + FLAGS[key].split("/")[0].removeprefix("--")
                own = f"{FLAGS[key].split('/')[0].removeprefix('--')} {_shown(getattr(p, key))}"
            else:
                given_text, own = f"{FLAGS[key]} {_shown(value)}", _shown(getattr(p, key))
            raise ValueError(
                f"{given_text} conflicts with --protocol {p.name} ({own}); "
                f"leave it out, or drop --protocol to run other settings"
            )
    if baseline is not None and baseline != p.baseline:
        raise ValueError(
            f"--baseline {baseline!r}: --protocol {p.name} compares with the arm {p.baseline!r}; leave --baseline out"
        )
    names = [c.name for c in conditions]
    if p.baseline not in names:
        raise ValueError(
            f"--protocol {p.name} needs the base model as -C {p.baseline}=MODEL (conditions given: {names or 'none'})"
        )
    if p.prompted in names:
        raise ValueError(
            f"-C {p.prompted}=...: --protocol {p.name} adds the {p.prompted!r} arm itself (the {p.baseline!r} model "
            f"with tasks/prompts/system/{p.prompted_system_prompt}.txt); leave it out or give that arm another name"
        )
    base = next(c for c in conditions if c.name == p.baseline)
    if base.system_prompt:
        raise ValueError(
            f"-C {p.baseline}=...,system_prompt={base.system_prompt_file}: the {p.baseline!r} arm of --protocol "
            f"{p.name} runs without a system prompt; drop the option"
        )
    if n_items is not None and n_items < 1:
        raise ValueError(f"--n-items {n_items}: --protocol {p.name} needs n >= 1 (its own n is {p.n_items})")
    prompted = Condition(
        name=p.prompted,
        model=base.model,
        system_prompt=system_prompt_text(p.prompted_system_prompt),
        system_prompt_file=p.prompted_system_prompt,
    )
    versions = [c for c in conditions if c.name != p.baseline]
    settings = {key: getattr(p, key) for key in FLAGS}
    return Applied(
        settings=settings,
        conditions=[base, *versions, prompted],
        baseline=p.baseline,
        n_items=p.n_items if n_items is None else n_items,
    )


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value) if isinstance(value, str) else str(value)


def describe(p: Protocol, conditions: Sequence[Condition], baseline: str, n_items: int) -> str:
    """One line for the operator: what the protocol runs."""
    arms = ", ".join(c.name for c in conditions)
    return (
        f"protocol {p.name}: the simulator ({p.sim_prompt}) opens, {p.max_new_turns} messages, "
        f"{p.assistant_max_tokens} tokens per assistant turn, thinking {_shown(p.enable_thinking)}, "
        f"{n_items} items (one per reference document) x {p.seeds} seed(s); arms {arms}; baseline {baseline}"
    )


PROTOCOL_FILE = "protocol.json"


def write_record(p: Protocol, conditions: Sequence[Condition], baseline: str, n_items: int, out) -> Path:
    """OUT/protocol.json beside the table: the protocol a table was measured under, so a reader of the
    directory (or of a table copied out of it) can tell the card's benchmark from another setting."""
    path = Path(out) / PROTOCOL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **dataclasses.asdict(p),
        "n_items": n_items,
        "baseline": baseline,
        "arms": [{"name": c.name, "model": c.model, "system_prompt": c.system_prompt_file} for c in conditions],
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def check_n(n: int, available: int, source: str, asked: str = "") -> None:
    """n held-out items asked for (`asked` says by whom: "--n-items N" unless given), `available` after
    deduplication by reference document: refuse a shortfall before anything is played (a smaller table
    than asked for is another benchmark)."""
    if n > available:
        raise ValueError(
            f"{asked or f'--n-items {n}'}: {source} holds {available} eval items (one per reference document); pass "
            f"--n-items {available} or fewer, or --items a larger set (e.g. the public "
            "collabllm/collabllm-multiturn-medium Hub dataset)"
        )
