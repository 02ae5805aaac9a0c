"""The leakage guard: training and evaluation must not share their labels (CollabLLM: the reference
documents BLEU compares with). `guard_environment` is any environment's, called at start by the
learner: overlap by environments.base.find_overlap on the environment's leakage keys, refused on the
kinds it calls leaks. `guard_overlap` is CollabLLM's (tasks.data.find_overlap on normalized-text
hashes of references and prompts), called by `parley eval`; `parley data check` reports.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from parley.environments.base import TaskSource
from parley.environments.base import find_overlap as find_environment_overlap
from parley.errors import ConfigError
from parley.tasks.data import Item, Overlap, find_overlap

log = logging.getLogger(__name__)

OVERLAP_FILE = "overlap.json"
_EXAMPLES = 3  # pairs named in an error message


class LeakageError(ConfigError):
    """Train and eval share reference targets and overlap was not allowed."""


def _examples(pairs: list[tuple[str, str]]) -> str:
    shown = ", ".join(f"train {a} = eval {b}" for a, b in pairs[:_EXAMPLES])
    return shown + (f" (+{len(pairs) - _EXAMPLES} more)" if len(pairs) > _EXAMPLES else "")


def describe(overlap: Overlap, n_train: int, n_eval: int) -> str:
    """Human-readable report, one line per kind of overlap."""
    lines = [f"train {n_train} items, eval {n_eval} items: {overlap.summary()}"]
    if overlap.references:
        lines.append(f"shared reference targets: {_examples(overlap.references)}")
    if overlap.prompts:
        lines.append(f"shared prompts: {_examples(overlap.prompts)}")
    return "\n".join(lines)


def overlap_json(overlap: Overlap, n_train: int, n_eval: int) -> dict:
    return {
        "train_items": n_train,
        "eval_items": n_eval,
        "references": [list(p) for p in overlap.references],
        "prompts": [list(p) for p in overlap.prompts],
        "created": time.time(),
    }


def guard_overlap(train_items: list[Item], eval_items: list[Item], allow: bool, run_dir: str | Path | None) -> Overlap:
    """Stop a run whose eval items share reference targets with its training items, unless allowed.

    Shared prompts alone are logged, not fatal: a prompt asked again with a different target does not
    leak the answer. When the run goes ahead despite any overlap, it is written to run_dir/overlap.json
    so the result tables can be read knowing it.
    """
    overlap = find_overlap(train_items, eval_items)
    if overlap.leaks and not allow:
        raise LeakageError(
            f"train and eval share {len(overlap.references)} reference targets and {len(overlap.prompts)} prompts "
            f"({_examples(overlap.references)}); eval scores on them measure memorization. Use a per-reference split "
            f"or another eval file, or pass --allow-overlap ([data] allow_overlap = true) to run anyway"
        )
    if overlap.references or overlap.prompts:
        log.warning("%s", describe(overlap, len(train_items), len(eval_items)).replace("\n", "; "))
        if run_dir is not None:
            path = Path(run_dir) / OVERLAP_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(overlap_json(overlap, len(train_items), len(eval_items)), indent=1) + "\n")
            log.warning("overlap recorded in %s", path)
    return overlap


def guard_environment(
    source: TaskSource, train_items, eval_items, allow: bool, run_dir: str | Path | None
) -> dict[str, list[tuple[str, str]]]:
    """guard_overlap for any environment: stop a run whose split shares a key of a leaking kind
    (`source.leaks`), unless allowed; the other kinds are only logged. When the run goes ahead with
    any overlap, every kind's pairs are written to run_dir/overlap.json. Returns kind -> pairs."""
    overlap = find_environment_overlap(source, train_items, eval_items)
    leaks = {k: v for k, v in overlap.items() if k in source.leaks and v}
    counts = " and ".join(
        [f"{len(v)} {k} targets" for k, v in overlap.items() if k in source.leaks]
        + [f"{len(v)} {k} keys" for k, v in overlap.items() if k not in source.leaks]
    )
    if leaks and not allow:
        raise LeakageError(
            f"train and eval share {counts} ({_examples([p for v in leaks.values() for p in v])}); eval scores on "
            f"them measure memorization. Split by {'/'.join(source.leaks)}, or use another eval set, or pass "
            "--allow-overlap ([data] allow_overlap = true) to run anyway"
        )
    if any(overlap.values()):
        log.warning("train %d items, eval %d items share %s", len(train_items), len(eval_items), counts)
        if run_dir is not None:
            path = Path(run_dir) / OVERLAP_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            saved = {
                "train_items": len(train_items),
                "eval_items": len(eval_items),
                "leaking_kinds": list(source.leaks),
                "overlap": {k: [list(p) for p in v] for k, v in overlap.items()},
                "created": time.time(),
            }
            path.write_text(json.dumps(saved, indent=1) + "\n")
            log.warning("overlap recorded in %s", path)
    return overlap
