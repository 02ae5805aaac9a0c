"""The CollabLLM medium task data: loading, per-reference splits, leakage checks, tasks.

Reads the public `collabllm-multiturn-medium(-large)` parquet schema (prompt, single_turn_prompt,
single_turn_completion, single_turn_metadata, conv_id, turn_id) from a local file, the same records as
JSONL, or a Hub dataset by id ("ORG/NAME[@REV][#SPLIT]": its Parquet files, the local HF cache
first); the bundled file `tasks/datasets/medium.jsonl` is ours. Rows that repeat a reference
document are dropped on load (dedupe_by_reference says which is kept). Used by the learner's feeder, eval and
`parley data check`; `task_from_item` turns an item into the Task the actors play.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
import re
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from parley.errors import ConfigError
from parley.protocol.messages import ChatMessage, Task
from parley.tasks.hub import HUB_ID, first_line, offline, unreachable

log = logging.getLogger(__name__)

# The simulator prompt CollabLLM tasks are played under when [rollout].sim_prompt is "" (the
# environment's own: environments/collabllm.py).
SIM_PROMPT = "lazy_full"

BUNDLED = "bundled"


@dataclass(frozen=True)
class Item:
    """One dataset row: a conversation prefix and the document the user has in mind."""

    item_id: str  # f"{conv_id}/{turn_id}"
    prefix: tuple[ChatMessage, ...]
    reference: str
    single_turn_prompt: str = ""
    title: str = ""
    summary: str = ""
    metadata: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def reference_key(self) -> str:
        return text_key(self.reference)

    @property
    def prompt_key(self) -> str:
        return text_key(self.single_turn_prompt or " ".join(m.content for m in self.prefix))


@functools.lru_cache(maxsize=16384)
def text_key(text: str) -> str:
    """Hash of normalized text (case, whitespace and punctuation folded): the unit of overlap. Cached:
    Item.reference_key is asked for several times per item (dedupe, split, leakage check), and with
    documents of megabytes each normalization takes a fifth of a second; the learner built its split on
    its event loop for a minute."""
    norm = re.sub(r"[^\w]+", " ", text.lower()).strip()
    return hashlib.sha256(norm.encode()).hexdigest()[:24]


def bundled_path() -> Path:
    return Path(str(resources.files("parley.tasks") / "datasets" / "medium.jsonl"))


DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class DataNotFound(ConfigError):
    """A data value naming no file and no Hub dataset this machine has or can fetch; one line naming
    the value and the fix."""


def hub_dataset(value: str) -> tuple[str, str | None, str] | None:
    """(repo, revision, split) when `value` reads as a Hub dataset id, "ORG/NAME[@REV][#SPLIT]" (split
    default "train"), and no local path of that spelling exists; a value ending in a data file's
    suffix is always a path (a missing file is told as one, not looked for on the Hub)."""
    spec, _, split = str(value).partition("#")
    m = HUB_ID.match(spec)
    if m is None or Path(value).expanduser().exists() or Path(spec).suffix in DATA_SUFFIXES:
        return None
    return m.group("repo"), m.group("rev"), split or "train"


def _fetch_hint(repo: str, rev: str | None) -> str:
    cmd = f"huggingface-cli download --repo-type dataset {repo}" + (f" --revision {rev}" if rev else "")
    return (
        f"fetch it with `{cmd}` on a machine with a network (or point HF_HOME at a cache that holds it), "
        "or give a local .parquet/.jsonl file"
    )


def _dataset_snapshot(repo: str, rev: str | None) -> Path:
    """The local snapshot directory of a Hub dataset's Parquet files: the local HF cache first (no
    network), else downloaded. Raises DataNotFound, one line."""
    from huggingface_hub import snapshot_download

    label = repo + (f"@{rev}" if rev else "")
    kw = dict(repo_type="dataset", revision=rev, allow_patterns=["*.parquet", "*.md", "*.json"])
    try:
        return Path(snapshot_download(repo, local_files_only=True, **kw))
    except Exception:  # noqa: BLE001 - not in the cache: fetch it below
        pass
    why = "HF_HUB_OFFLINE is set" if offline() else unreachable()
    if not why:
        hub_log = logging.getLogger("huggingface_hub")
        level = hub_log.level
        hub_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
        try:
            log.info("downloading dataset %s from the Hugging Face Hub", label)
            return Path(snapshot_download(repo, **kw))
        except Exception as e:  # noqa: BLE001 - no such repository or revision, no access, network gone
            why = f"could not be downloaded ({first_line(e)})"
        finally:
            hub_log.setLevel(level)
    elif not offline():
        why = f"could not be downloaded ({why})"
    raise DataNotFound(f"dataset {label!r} is not in the local Hugging Face cache and {why}; {_fetch_hint(repo, rev)}")


def dataset_files(value: str) -> list[Path]:
    """The Parquet files of a Hub dataset id's split (see hub_dataset), in name order: files named
    SPLIT.parquet or SPLIT-*.parquet, or under a folder named SPLIT (the Hub's layouts). Raises
    DataNotFound when the id does not resolve or has no such split."""
    repo, rev, split = hub_dataset(value) or (None, None, "")
    if repo is None:
        raise DataNotFound(f"{value!r} is not a Hub dataset id (ORG/NAME, ORG/NAME@REVISION, optional #SPLIT)")
    snap = _dataset_snapshot(repo, rev)
    files = sorted(p for p in snap.rglob("*.parquet"))

    def split_of(p: Path) -> str:
        rel = p.relative_to(snap).parts
        folder = next((part for part in rel[:-1] if part not in ("data", "default")), "")
        return folder or re.split(r"[-.]", p.name, maxsplit=1)[0]

    chosen = [p for p in files if split_of(p) == split]
    if not chosen:
        splits = sorted({split_of(p) for p in files})
        raise DataNotFound(
            f"dataset {value!r} has no Parquet files of split {split!r} (its splits: {splits or 'none'}); "
            f"name one as {repo}#SPLIT"
        )
    return chosen


def _records(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"data file {path} has suffix {path.suffix!r}; use .parquet or .jsonl")


def _messages(prompt) -> tuple[ChatMessage, ...]:
    if isinstance(prompt, str):  # some exports store the prompt as JSON text
        try:
            prompt = json.loads(prompt)
        except json.JSONDecodeError:
            return (ChatMessage("user", prompt),)
    return tuple(ChatMessage(str(m["role"]), str(m["content"])) for m in prompt or [])


def _metadata(raw) -> dict:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return {}
    return dict(raw or {})


def load_items(path: str | Path = BUNDLED, dedupe: bool = True) -> list[Item]:
    """Read CollabLLM medium data: "bundled", a .parquet/.jsonl file or a Hub dataset id (hub_dataset).
    Rows without a reference document are skipped; with `dedupe`, one row per reference document is
    kept (dedupe_by_reference) and the number dropped is logged."""
    hub = hub_dataset(str(path)) if str(path) != BUNDLED else None
    if hub is not None:
        sources = dataset_files(str(path))
        label = str(path)
    else:
        p = bundled_path() if str(path) == BUNDLED else Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"data file {p} does not exist; use 'bundled', a CollabLLM .parquet/.jsonl path or a Hub dataset id"
            )
        sources, label = [p], str(p)
    records = [r for src in sources for r in _records(src)]
    items = []
    for i, r in enumerate(records):
        missing = [k for k in ("prompt", "single_turn_completion") if k not in r]
        if missing:
            raise ValueError(f"{label}: record {i} lacks {missing}; is this the collabllm-multiturn-medium schema?")
        reference = (r.get("single_turn_completion") or "").strip()
        if not reference:
            continue
        meta = _metadata(r.get("single_turn_metadata"))
        title = str(meta.get("title") or reference.splitlines()[0][:120])
        items.append(
            Item(
                item_id=f"{r.get('conv_id', i)}/{r.get('turn_id', 0)}",
                prefix=_messages(r.get("prompt")),
                reference=reference,
                single_turn_prompt=str(r.get("single_turn_prompt") or ""),
                title=title,
                summary=str(meta.get("summary") or r.get("single_turn_prompt") or title),
                metadata=meta,
            )
        )
    if not dedupe:
        return items
    kept = dedupe_by_reference(items)
    if len(kept) < len(items):
        log.info(
            "data %s: %d rows, %d reference documents: dropped %d rows that repeat a document "
            "(kept each document's shortest prefix)",
            label,
            len(items),
            len(kept),
            len(items) - len(kept),
        )
    return kept


def dedupe_by_reference(items: list[Item]) -> list[Item]:
    """One item per reference document, in the order documents first appear: the one with the shortest
    prefix (fewest messages; then the lowest item_id). The public multiturn data has a row per turn of a
    conversation, all with the conversation's document; the shortest prefix is the conversation's
    opening, the start a whole-conversation rollout and the card's eval play from, and choosing by
    content rather than row order gives the same item whatever order the files list the rows in."""
    best: dict[str, Item] = {}
    for it in items:
        cur = best.get(it.reference_key)
        if cur is None or (len(it.prefix), it.item_id) < (len(cur.prefix), cur.item_id):
            best[it.reference_key] = it
    return list(best.values())


def split_items(items: list[Item], eval_fraction: float, seed: int = 0) -> tuple[list[Item], list[Item]]:
    """Split by reference document, so no reference appears on both sides."""
    keys = sorted({it.reference_key for it in items})
    random.Random(seed).shuffle(keys)
    n_eval = round(len(keys) * eval_fraction)
    if eval_fraction > 0 and n_eval == 0 and len(keys) > 1:
        n_eval = 1
    eval_keys = set(keys[:n_eval])
    train = [it for it in items if it.reference_key not in eval_keys]
    held = [it for it in items if it.reference_key in eval_keys]
    return train, held


@dataclass
class Overlap:
    """What train and eval share: identical reference targets (label leakage) and prompts."""

    references: list[tuple[str, str]]  # (train item_id, eval item_id)
    prompts: list[tuple[str, str]]

    @property
    def leaks(self) -> bool:
        return bool(self.references)

    def summary(self) -> str:
        return f"{len(self.references)} shared reference targets, {len(self.prompts)} shared prompts"


def find_overlap(train: list[Item], held: list[Item]) -> Overlap:
    def pairs(key):
        index: dict[str, list[str]] = {}
        for it in train:
            index.setdefault(key(it), []).append(it.item_id)
        return [(a, it.item_id) for it in held for a in index.get(key(it), [])]

    return Overlap(references=pairs(lambda it: it.reference_key), prompts=pairs(lambda it: it.prompt_key))


def system_prompt_path(spec: str) -> Path:
    """A file path, or the name of a bundled system prompt (tasks/prompts/system/<name>.txt:
    default, proactive; "proactive.txt" works too)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    bundled = Path(str(resources.files("parley.tasks") / "prompts" / "system"))
    name = spec[:-4] if spec.endswith(".txt") else spec
    if re.fullmatch(r"[A-Za-z0-9_-]+", name) and (bundled / f"{name}.txt").is_file():
        return bundled / f"{name}.txt"
    names = sorted(p.stem for p in bundled.glob("*.txt"))
    raise ValueError(f"system_prompt={spec!r} is neither a file nor a bundled prompt; bundled: {names}")


def system_prompt_text(spec: str) -> str:
    """The assistant's system prompt named by [rollout].system_prompt: "" = none, else as system_prompt_path."""
    return system_prompt_path(spec).read_text().strip() if spec else ""


def task_from_item(
    item: Item, *, run: str, task_id: str, n: int, rollout, seed: int, version: int, split: str = "train"
) -> Task:
    """The Task asking for n samples of `item` under the [rollout] settings (a RolloutConfig).

    conversation mode starts from the item's opening request only (the policy then plays every
    assistant turn); next_turn mode continues the item's whole prefix with one trained turn.
    """
    prefix = list(item.prefix)
    if rollout.mode == "conversation":
        first_user = next((i for i, m in enumerate(prefix) if m.role == "user"), None)
        prefix = prefix[: first_user + 1] if first_user is not None else []
    return Task(
        task_id=task_id,
        run=run,
        item_id=item.item_id,
        n=n,
        prefix=prefix,
        reference=item.reference,
        title=item.title,
        summary=item.summary,
        system_prompt=system_prompt_text(rollout.system_prompt),
        sim_prompt=rollout.sim_prompt or SIM_PROMPT,
        seed=seed,
        admitted_version=version,
        split=split,
        **rollout_fields(rollout),
    )


def rollout_fields(rollout) -> dict:
    """The Task fields every environment's task builder takes from [rollout] as they are: the mode,
    the turn and token limits, the sampled futures (next_turn mode only), and the creation time."""
    return dict(
        mode=rollout.mode,
        max_new_turns=rollout.max_new_turns,
        max_tokens=rollout.max_tokens,
        futures=rollout.futures if rollout.mode == "next_turn" else 0,
        future_turns=rollout.future_turns,
        created=time.time(),
    )


def train_eval_items(data) -> tuple[list[Item], list[Item]]:
    """The run's train and held-out items from a [data] section: a separate eval file, or a split."""
    items = load_items(data.path)
    if data.eval_path:
        return items, load_items(data.eval_path)
    return split_items(items, data.eval_fraction, data.split_seed)
