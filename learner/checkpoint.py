"""The learner's durable state: the ledger (step, feeder position, finished tasks, buffered
groups) in run_dir/learner/state.msgpack, the DeepSpeed checkpoint it points to, the resume
truncation of the step logs, the archive of every group that left the learner (run_dir/learner/
archive, read by `parley replay`), and `export_version` (any kept version as an HF checkpoint).
Written and read by learner.service; export is the `parley export` command. Design: docs/learner.md.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import msgspec

from protocol.messages import Scored

STATE_FILE = "state.msgpack"
WEIGHT_FILES = ("model.safetensors", "config.json")


class GroupState(msgspec.Struct, kw_only=True):
    """A buffered (not yet trained or dropped) group, with every sample received so far."""

    task_id: str
    first_seen: float
    completed: float = 0.0
    samples: list[Scored] = []


class IssuedTask(msgspec.Struct, kw_only=True):
    """When an in-flight task was issued and the announced version it was admitted at."""

    task_id: str
    at: float  # unix seconds: the task deadline counts from here, across resumes
    version: int  # Task.admitted_version


class LearnerState(msgspec.Struct, kw_only=True):
    """Everything a resumed learner needs besides the model: the ledger of a consistent moment.

    Consistent means: the model is the one after `step` optimizer steps (DeepSpeed checkpoint
    `tag`), `done` holds exactly the tasks finished by then, and every other sample the learner
    has received (and acknowledged) is in `groups`.
    """

    step: int = 0
    tag: str = ""  # DeepSpeed checkpoint tag holding the model after `step`; "" = the initial weights
    next_index: int = 0  # feeder: next task index to issue
    in_flight: list[str] = []  # feeder: issued task ids not yet consumed
    consumed: int = 0  # feeder: issued groups trained
    done: dict[str, str] = {}  # task_id -> "trained" | "timeout" | "stale" | "zero_advantage" | "dead" | "deadline"
    groups: list[GroupState] = []
    counters: dict[str, int] = {}
    saved: float = 0.0
    # New fields go last (older ledgers decode with the defaults):
    issued: list[IssuedTask] = []  # feeder: issue time and admitted version of each in_flight task
    dead_seq: int = 1  # next DEAD stream sequence to read; the letters before it are reflected above
    reasons: dict[str, str] = {}  # task_id -> why it was not trained (every done kind but "trained")


def learner_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "learner"


def ckpt_dir(run_dir: str | Path) -> Path:
    return learner_dir(run_dir) / "ckpt"


def weights_dir(run_dir: str | Path, version: int) -> Path:
    """Where the weights of `version` are written before publication (kept for export)."""
    return learner_dir(run_dir) / "weights" / f"v{version:06d}"


def step_tag(step: int) -> str:
    return f"step{step:06d}"


def write_state(run_dir: str | Path, state: LearnerState) -> Path:
    """Replace the ledger atomically (write beside, fsync, rename): a crash leaves the old or the new one."""
    d = learner_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    state.saved = time.time()
    path = d / STATE_FILE
    tmp = d / f".{STATE_FILE}.tmp"
    with tmp.open("wb") as f:
        f.write(msgspec.msgpack.encode(state))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_state(run_dir: str | Path) -> LearnerState | None:
    path = learner_dir(run_dir) / STATE_FILE
    if not path.is_file():
        return None
    return msgspec.msgpack.decode(path.read_bytes(), type=LearnerState)


def archive_dir(run_dir: str | Path) -> Path:
    return learner_dir(run_dir) / "archive"


def write_archive(run_dir: str | Path, step: int, trained: list[Scored], dropped: list[Scored]) -> list[Path]:
    """Keep the samples of a step's trained groups, and of the groups dropped or given up since the
    previous step, as Parquet logs: the streams forget old messages (max_bytes, max_age), the archive
    does not. A step trained again after a resume replaces its files."""
    from evaluation.evallog import write_parquet

    root = archive_dir(run_dir)
    out = []
    for kind, samples in (("trained", trained), ("dropped", dropped)):
        path = root / f"{step_tag(step)}-{kind}.parquet"
        if samples:
            out.append(write_parquet(samples, path))
        else:
            path.unlink(missing_ok=True)
    return out


def truncate_archive(run_dir: str | Path, max_step: int) -> int:
    """On resume: remove the archive of steps after the ledger's (they are trained again); returns files removed."""
    root = archive_dir(run_dir)
    if not root.is_dir():
        return 0
    gone = 0
    for p in root.glob("step*.parquet"):
        if p.name[4:10].isdigit() and int(p.name[4:10]) > max_step:
            p.unlink()
            gone += 1
    return gone


def prune_checkpoints(run_dir: str | Path, keep: int, current: str) -> None:
    """Delete DeepSpeed checkpoints beyond the newest `keep` (0 = keep all); never `current`."""
    if keep == 0:
        return
    root = ckpt_dir(run_dir)
    if not root.is_dir():
        return
    tags = sorted((p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step")), reverse=True)
    for tag in tags[keep:]:
        if tag != current:
            shutil.rmtree(root / tag, ignore_errors=True)


def prune_weights(run_dir: str | Path, keep: int) -> None:
    root = learner_dir(run_dir) / "weights"
    if not root.is_dir():
        return
    versions = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("v")), reverse=True)
    for p in versions[keep:]:
        shutil.rmtree(p, ignore_errors=True)


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Keep the lines of steps <= max_step (a resumed run rewrites the later ones); returns lines dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:  # a line torn by a kill
            dropped += 1
            continue
        if step <= max_step:
            kept.append(line)
        else:
            dropped += 1
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return dropped


# ---------------------------------------------------------------------------------------------
# export


def record_base_model(run_dir: str | Path, model_dir: str | Path) -> None:
    d = learner_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "base_model").write_text(str(Path(model_dir).resolve()) + "\n")


def base_model(run_dir: str | Path) -> Path:
    path = learner_dir(run_dir) / "base_model"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: is {run_dir} the run directory of a learner?")
    return Path(path.read_text().strip())


def available_versions(run_dir: str | Path) -> list[int]:
    found = {0}
    wroot = learner_dir(run_dir) / "weights"
    if wroot.is_dir():
        found |= {int(p.name[1:]) for p in wroot.iterdir() if p.name[1:].isdigit() and (p / WEIGHT_FILES[0]).is_file()}
    croot = ckpt_dir(run_dir)
    if croot.is_dir():
        found |= {int(p.name[4:]) for p in croot.iterdir() if p.name[4:].isdigit()}
    return sorted(found)


def export_version(run_dir: str | Path, version: int, out: str | Path) -> Path:
    """Write version `version` of a run as a standalone HF checkpoint (weights, config, tokenizer).

    Sources, first found: the kept weights directory of that version, the DeepSpeed checkpoint
    of that step (consolidated to full weights), or for version 0 the base model itself.
    """
    run_dir, out = Path(run_dir), Path(out)
    base = base_model(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    wdir = weights_dir(run_dir, version)
    tag = step_tag(version)
    if (wdir / WEIGHT_FILES[0]).is_file():
        for name in WEIGHT_FILES:
            shutil.copyfile(wdir / name, out / name)
    elif (ckpt_dir(run_dir) / tag).is_dir():
        _consolidate(ckpt_dir(run_dir), tag, base, out)
    elif version == 0:
        for p in base.glob("*.safetensors"):
            shutil.copyfile(p, out / p.name)
        shutil.copyfile(base / "config.json", out / "config.json")
    else:
        raise FileNotFoundError(
            f"version {version} of {run_dir} is not kept; available: {available_versions(run_dir)} "
            "(raise [learner] keep_checkpoints / keep_versions to keep more)"
        )
    # Tokenizer, chat template and generation config come from the base model: training never changes them.
    for p in base.iterdir():
        if p.is_file() and p.suffix not in (".safetensors", ".bin") and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(p, out / p.name)
    return out


def _consolidate(root: Path, tag: str, base: Path, out: Path) -> None:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    if list((root / tag).glob("*optim_states.pt")) and any((root / tag).glob("zero_pp_rank_*")):
        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    else:  # ZeRO stage 0: the module's own state dict is in the model-states file
        state = torch.load(root / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    # DeepSpeed wraps the HF model as PackedPolicy.model: drop that prefix to get checkpoint names.
    state = {k.removeprefix("model."): v for k, v in state.items()}
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(base / "config.json", out / "config.json")
