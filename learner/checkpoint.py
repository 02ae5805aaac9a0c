"""The learner's durable state: the ledger (step, feeder position, finished tasks, buffered
groups) in run_dir/learner/state.msgpack with the buffered samples themselves in an append-only
sample log beside it (`Ledger`), the DeepSpeed checkpoint it points to, the resume
truncation of the step logs, the archive of every group that left the learner (run_dir/learner/
archive, read by `parley replay`), and `export_version` (any kept version as an HF checkpoint).
Written by learner.intake (the ledger) and learner.stepper (checkpoints, archive), read back by
learner.resume; export is the `parley export` command. Design: docs/learner.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import time
import zlib
from pathlib import Path

import msgspec

from parley.errors import BadMessage, StateError
from parley.learner.groups import Finished
from parley.protocol.messages import Scored
from parley.runtime.durable import fsync_dir, fsync_file, write_durable_text
from parley.weights.lora import ADAPTER_CONFIG, ADAPTER_FILE
from parley.weights.safetensors_header import check_safetensors
from parley.weights.snapshot import prune_versions, version_dir

STATE_FILE = "state.msgpack"
REASONS_FILE = "reasons.jsonl"  # why each task was not trained, one JSON line each, append-only
WEIGHT_FILES = ("model.safetensors", "config.json")
# The sample log's generations: samples-000001.log, ... (a compaction starts the next one).
SAMPLE_LOG_PREFIX, SAMPLE_LOG_SUFFIX = "samples-", ".log"
_RECORD = struct.Struct("<II")  # a sample log record: payload length, crc32 of the payload; then the payload
# Compact the sample log once its dead records (samples of groups that left) exceed both its live
# ones and this many bytes: each sample is then written about twice at most, amortised.
COMPACT_MIN_BYTES = 64 * 1024 * 1024

log = logging.getLogger(__name__)


class GroupState(msgspec.Struct, kw_only=True):
    """A buffered (not yet trained or dropped) group, with every sample received so far."""

    task_id: str
    first_seen: float
    completed: float = 0.0
    samples: list[Scored] = []  # inline (ledgers before the sample log; read_state fills it from `refs`)
    refs: list[int] = []  # offsets of the samples' records in LearnerState.sample_log, in sample order


class IssuedTask(msgspec.Struct, kw_only=True):
    """When an in-flight task was issued and the announced version it was admitted at."""

    task_id: str
    at: float  # unix seconds (against LearnerState.saved): the task deadline counts from here, across resumes
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
    # The wall-clock moment the times above were read against (learner.intake.snapshot): a resume
    # takes `saved - first_seen` as a group's age, and so on; write_state sets it when it is 0.
    saved: float = 0.0
    # New fields go last (older ledgers decode with the defaults):
    issued: list[IssuedTask] = []  # feeder: issue time and admitted version of each in_flight task
    dead_seq: int = 1  # next DEAD stream sequence to read; the letters before it are reflected above
    reasons: dict[str, str] = {}  # task_id -> why it was not trained (every done kind but "trained")
    sample_log: str = ""  # the sample log file (in learner_dir) that GroupState.refs point into
    # The archive's dropped-NNNNNNNN.parquet files below this number hold the samples of groups the
    # ledger records as finished untrained; those from it on were written before a write that never came.
    archive_seq: int = 0
    # `done` holds only the finished tasks above this watermark (and tasks not issued by the feeder):
    # every feeder task of a lower index is finished (learner.groups.Finished)
    done_below: int = 0
    done_prefix: str = ""  # the feeder's task ids are this + a 6-digit index (learner.feeder.task_id)
    # The reasons log (REASONS_FILE, append-only) holds `reasons` of this many bytes; `reasons` itself
    # is written only by ledgers from before it (read_state fills it, and `done`'s kinds, from the log)
    reasons_bytes: int = 0
    # Training steps begun over each buffered task's group whose training failed or never returned
    # (learner.stepper counts one before the training and takes it back with a ledger write as soon as
    # the training returns; it rejects the groups at [learner] max_step_attempts); only buffered tasks.
    attempts: dict[str, int] = {}
    step_error: str = ""  # the last failed step's error, for the reason its groups are rejected with


def learner_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "learner"


def ckpt_dir(run_dir: str | Path) -> Path:
    return learner_dir(run_dir) / "ckpt"


def versions_dir(run_dir: str | Path) -> Path:
    """Where the publication writes each version's weights (weights.snapshot.version_dir)."""
    return learner_dir(run_dir) / "weights"


def weights_dir(run_dir: str | Path, version: int) -> Path:
    """Where the weights of `version` are written before publication (kept for export)."""
    return version_dir(versions_dir(run_dir), version)


def step_tag(step: int) -> str:
    return f"step{step:06d}"


def write_state(run_dir: str | Path, state: LearnerState) -> Path:
    """Replace the ledger atomically (write beside, fsync, rename, fsync the directory): a crash
    leaves the old or the new one, and once this returns the new one is the one that stays."""
    d = learner_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    state.saved = state.saved or time.time()
    path = d / STATE_FILE
    tmp = d / f".{STATE_FILE}.tmp"
    with tmp.open("wb") as f:
        f.write(msgspec.msgpack.encode(state))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)  # the rename (and a new sample log's entry) must be durable before an old log is unlinked
    return path


def has_state(run_dir: str | Path) -> bool:
    return (learner_dir(run_dir) / STATE_FILE).is_file()


def read_state(run_dir: str | Path) -> LearnerState | None:
    """The ledger with every buffered group's samples in GroupState.samples (read from the sample
    log), or None when there is none. Safe beside a running learner: a compaction that removed the
    log named by the state just read means a newer state names the new log, so it is read again."""
    path = learner_dir(run_dir) / STATE_FILE
    for attempt in range(5):
        if not path.is_file():
            return None
        state = msgspec.msgpack.decode(path.read_bytes(), type=LearnerState)
        try:
            _resolve_samples(learner_dir(run_dir), state)
            _read_reasons(learner_dir(run_dir), state)
            _watermark(state)
        except FileNotFoundError as e:
            if attempt == 4:
                raise LedgerError(
                    f"{e}; restore learner/ from a copy, or start a fresh run (another run name)"
                ) from None
            continue
        return state
    return None


class LedgerError(StateError):
    """The ledger names a sample that its sample log does not hold intact."""


def _read_reasons(d: Path, state: LearnerState) -> None:
    """Fill state.reasons, and state.done's kinds of those tasks, from the reasons log's vouched bytes."""
    if not state.reasons_bytes:
        return
    path = d / REASONS_FILE
    with path.open("rb") as f:
        data = f.read(state.reasons_bytes)
    if len(data) < state.reasons_bytes:
        raise LedgerError(
            f"{path} holds {len(data)} bytes, the ledger names {state.reasons_bytes}; the run directory was "
            "changed or damaged: restore learner/ from a copy, or start a fresh run (another run name)"
        )
    for line in data.splitlines():
        entry = json.loads(line)
        state.reasons[entry["task"]] = entry["reason"]
        state.done.setdefault(entry["task"], entry["kind"])


def _watermark(state: LearnerState) -> None:
    """state.done as a learner.groups.Finished: `in` also answers for the tasks under the watermark."""
    state.done = Finished(state.done_prefix, state.done_below, state.done)


def _resolve_samples(d: Path, state: LearnerState) -> None:
    if not any(g.refs for g in state.groups):
        return
    path = d / state.sample_log
    if not state.sample_log or not path.is_file():
        raise FileNotFoundError(f"{path}: the ledger's sample log is missing")
    with path.open("rb") as f:
        for g in state.groups:
            if g.refs:
                g.samples = [_read_record(f, path, off, g.task_id) for off in g.refs]


def _read_record(f, path: Path, offset: int, task_id: str) -> Scored:
    f.seek(offset)
    head = f.read(_RECORD.size)
    problem = ""
    if len(head) < _RECORD.size:
        problem = "the file ends there"
    else:
        size, crc = _RECORD.unpack(head)
        data = f.read(size)
        if len(data) < size:
            problem = f"the record of {size} bytes is cut at {len(data)}"
        elif zlib.crc32(data) != crc:
            problem = "its checksum does not match"
    if problem:
        raise LedgerError(
            f"{path}: the ledger names a sample of {task_id} at offset {offset}, but {problem}; the run directory "
            "was changed or damaged: restore learner/ from a copy, or start a fresh run (another run name)"
        )
    return msgspec.msgpack.decode(data, type=Scored)


class Ledger:
    """Writes the ledger so that each write costs what changed: every buffered sample is appended
    once to the sample log (`samples-NNNNNN.log`, records of length + crc32 + msgpack Scored), and
    state.msgpack refers to it by offset. A write appends the samples new since the last one, fsyncs
    the log, then replaces state.msgpack atomically (write_state): a kill at any point leaves a
    state whose every offset names a complete record (records after it are never referenced, and
    their messages were never acked). When the log's dead records (samples of groups that left the
    learner) outgrow its live ones and COMPACT_MIN_BYTES, the live ones are copied into the next
    generation, the state names it, and the older generations are removed after the state is in place.
    Called by learner.intake (one write at a time); `bytes_written` counts every byte it wrote."""

    def __init__(self, run_dir: str | Path, compact_min_bytes: int = COMPACT_MIN_BYTES):
        self.run_dir, self.dir = Path(run_dir), learner_dir(run_dir)
        self.compact_min_bytes = compact_min_bytes
        self.log_name = ""
        self._f = None
        # (task_id, sample) -> (offset, record bytes, the Scored written there): reused for that very object
        self.refs: dict[tuple[str, int], tuple[int, int, Scored]] = {}
        self.dead_bytes = 0  # records in the current log no state refers to any more
        self.bytes_written = 0
        self.reasons_bytes = 0  # the reasons log's length as the last write vouched for it
        self.compactions = 0

    def _generations(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(
            p for p in self.dir.iterdir() if p.name.startswith(SAMPLE_LOG_PREFIX) and p.name.endswith(SAMPLE_LOG_SUFFIX)
        )

    def _start_generation(self) -> None:
        gens = [
            int(p.name[len(SAMPLE_LOG_PREFIX) : -len(SAMPLE_LOG_SUFFIX)])
            for p in self._generations()
            if p.name[len(SAMPLE_LOG_PREFIX) : -len(SAMPLE_LOG_SUFFIX)].isdigit()
        ]
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._f is not None:
            self._f.close()
        self.log_name = f"{SAMPLE_LOG_PREFIX}{max(gens, default=0) + 1:06d}{SAMPLE_LOG_SUFFIX}"
        self._f = (self.dir / self.log_name).open("ab")
        self.dead_bytes = 0

    def open(self) -> LearnerState | None:
        """On resume: the ledger (samples resolved), with its log adopted for the next writes, so the
        restored samples are not written again. Generations the state does not name are removed."""
        state = read_state(self.run_dir)
        if state is None:
            return None
        self.reasons_bytes = state.reasons_bytes
        reasons = self.dir / REASONS_FILE
        if reasons.is_file() and reasons.stat().st_size > self.reasons_bytes:
            with reasons.open("r+b") as f:  # lines after the ledger's: its tasks are not finished for it
                f.truncate(self.reasons_bytes)
                os.fsync(f.fileno())
        if state.sample_log and (self.dir / state.sample_log).is_file():
            self.log_name = state.sample_log
            self._f = (self.dir / self.log_name).open("ab")
            for g in state.groups:
                for off, s in zip(g.refs, g.samples):
                    size = _RECORD.size + len(msgspec.msgpack.encode(s))
                    self.refs[(g.task_id, s.sample)] = (off, size, s)
            self.dead_bytes = max(0, self._f.tell() - sum(r[1] for r in self.refs.values()))
        for p in self._generations():
            if p.name != self.log_name:
                p.unlink(missing_ok=True)  # left by a kill during a compaction, or unreferenced
        return state

    def _append(self, s: Scored) -> tuple[int, int, Scored]:
        data = msgspec.msgpack.encode(s)
        off = self._f.tell()
        self._f.write(_RECORD.pack(len(data), zlib.crc32(data)))
        self._f.write(data)
        size = _RECORD.size + len(data)
        self.bytes_written += size
        return off, size, s

    def write(self, state: LearnerState, reasons: list[tuple[str, str, str]] = ()) -> Path:
        """Record `state` (its groups' samples given inline, as the service builds it): new samples
        go to the log, state.msgpack gets their offsets; `reasons` ((task, kind, reason) of the tasks
        finished untrained since the last write) are appended to the reasons log, durable first."""
        if reasons:
            path = self.dir / REASONS_FILE
            self.dir.mkdir(parents=True, exist_ok=True)
            new = not path.exists()
            data = "".join(json.dumps({"task": t, "kind": k, "reason": r}) + "\n" for t, k, r in reasons).encode()
            with path.open("ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if new:
                fsync_dir(self.dir)
            self.reasons_bytes += len(data)
            self.bytes_written += len(data)
        state = msgspec.structs.replace(state, reasons={}, reasons_bytes=self.reasons_bytes)
        if self._f is None:
            self._start_generation()
        live: dict[tuple[str, int], tuple[int, int, Scored]] = {}
        for g in state.groups:
            for s in g.samples:
                old = self.refs.get((g.task_id, s.sample))
                live[(g.task_id, s.sample)] = old if old is not None and old[2] is s else None
        self.dead_bytes += sum(r[1] for k, r in self.refs.items() if live.get(k) is not r)
        live_bytes = sum(r[1] for r in live.values() if r is not None)
        old_logs = []
        if self.dead_bytes > max(live_bytes, self.compact_min_bytes):
            old_logs = [self.dir / self.log_name]
            self._start_generation()  # every live sample is written again, into the new generation
            live = dict.fromkeys(live)
            self.compactions += 1
        groups = []
        for g in state.groups:
            refs = []
            for s in g.samples:
                key = (g.task_id, s.sample)
                if live[key] is None:
                    live[key] = self._append(s)
                refs.append(live[key][0])
            groups.append(msgspec.structs.replace(g, samples=[], refs=refs))
        self._f.flush()
        os.fsync(self._f.fileno())
        self.refs = live
        path = write_state(self.run_dir, msgspec.structs.replace(state, groups=groups, sample_log=self.log_name))
        self.bytes_written += path.stat().st_size
        for p in old_logs:
            p.unlink(missing_ok=True)  # only now: the state in place names the new generation
        return path

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def archive_dir(run_dir: str | Path) -> Path:
    return learner_dir(run_dir) / "archive"


def write_archive(run_dir: str | Path, step: int, trained: list[Scored]) -> Path | None:
    """Keep the samples of a step's trained groups as a Parquet log (the streams forget old messages,
    max_bytes and max_age; the archive does not), durable before the ledger write that vouches for the
    step. A step trained again after a resume replaces its file."""
    return _write_durable(archive_dir(run_dir) / f"{step_tag(step)}-trained.parquet", trained)


def write_dropped(run_dir: str | Path, seq: int, dropped: list[Scored]) -> Path | None:
    """Keep the samples of groups that left the learner untrained (dropped, skipped, rejected) as
    archive/dropped-{seq}.parquet, durable before the ledger write that records them finished (and
    names archive_seq = seq + 1): a resume removes the files of later numbers (truncate_archive), so
    each group is archived once whatever the kill."""
    return _write_durable(archive_dir(run_dir) / f"dropped-{seq:08d}.parquet", dropped)


def _write_durable(path: Path, samples: list[Scored]) -> Path | None:
    from parley.evaluation.evallog import write_parquet

    if not samples:
        path.unlink(missing_ok=True)
        return None
    write_parquet(samples, path)  # written beside and renamed
    fsync_file(path)
    fsync_dir(path.parent)
    return path


def truncate_archive(run_dir: str | Path, max_step: int, archive_seq: int | None = None) -> int:
    """On resume: remove the archive of steps after the ledger's (they are trained again), and the
    dropped groups' files from `archive_seq` on (the ledger never recorded those groups finished:
    they come back buffered and leave again); returns files removed."""
    root = archive_dir(run_dir)
    if not root.is_dir():
        return 0
    gone = 0
    for p in root.glob("step*.parquet"):
        if p.name[4:10].isdigit() and int(p.name[4:10]) > max_step:
            p.unlink()
            gone += 1
    for p in root.glob("dropped-*.parquet"):
        if archive_seq is not None and p.name[8:16].isdigit() and int(p.name[8:16]) >= archive_seq:
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
    prune_versions(versions_dir(run_dir), keep)


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
    with tmp.open("w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return dropped


# ---------------------------------------------------------------------------------------------
# export


def record_base_model(run_dir: str | Path, model_dir: str | Path) -> None:
    # durable: after a power cut, --resume and export read it
    write_durable_text(learner_dir(run_dir) / "base_model", str(Path(model_dir).resolve()) + "\n")


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


def export_version(run_dir: str | Path, version: int, out: str | Path, merge: bool = False) -> Path:
    """Write version `version` of a run as a standalone HF checkpoint (weights, config, tokenizer).

    A LoRA run's version ([learner.lora] serve = "adapter": its weights directory holds an adapter)
    is written as the adapter (adapter_model.safetensors + adapter_config.json, peft's layout), or
    with `merge` as the base with the adapter merged in (learner.lora.export_merged). With serve =
    "merged" the directory holds whole weights, written as full fine-tuning's are.

    Sources, first found: the kept weights directory of that version, the DeepSpeed checkpoint
    of that step (consolidated to full weights), or for version 0 the base model itself. Every
    safetensors source is checked (check_safetensors) before anything is written: a damaged file
    raises CorruptWeights and `out` is left as it was.
    """
    run_dir, out = Path(run_dir), Path(out)
    base = base_model(run_dir)
    wdir = weights_dir(run_dir, version)
    tag = step_tag(version)
    adapter = (wdir / ADAPTER_CONFIG).is_file()
    if merge and not adapter:
        raise FileNotFoundError(
            f"version {version} of {run_dir} is no LoRA adapter (no {wdir / ADAPTER_CONFIG}); export it without --merge"
        )
    if adapter or (wdir / WEIGHT_FILES[0]).is_file():
        tensors = [wdir / WEIGHT_FILES[0]] + (sorted(base.glob("*.safetensors")) if merge else [])
    elif (ckpt_dir(run_dir) / tag).is_dir():
        tensors = []  # DeepSpeed's files: safe_load refuses what they must not hold
    elif version == 0:
        tensors = sorted(base.glob("*.safetensors"))
    else:
        raise FileNotFoundError(
            f"version {version} of {run_dir} is not kept; available: {available_versions(run_dir)} "
            "(raise [learner] keep_checkpoints / keep_versions to keep more)"
        )
    for path in tensors:
        problem = check_safetensors(path)
        if problem:
            raise CorruptWeights(
                f"{path} is damaged ({problem}); nothing was written to {out}. Restore the file from a copy, "
                f"or export another version (kept: {available_versions(run_dir)})"
            )
    out.mkdir(parents=True, exist_ok=True)
    if adapter and merge:
        from parley.learner.lora import export_merged

        export_merged(base, wdir, out)
    elif adapter:
        shutil.copyfile(wdir / WEIGHT_FILES[0], out / ADAPTER_FILE)
        shutil.copyfile(wdir / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
        return out
    elif (wdir / WEIGHT_FILES[0]).is_file():
        for name in WEIGHT_FILES:
            shutil.copyfile(wdir / name, out / name)
    elif (ckpt_dir(run_dir) / tag).is_dir():
        _consolidate(ckpt_dir(run_dir), tag, base, out)
    else:
        for p in base.glob("*.safetensors"):
            shutil.copyfile(p, out / p.name)
        shutil.copyfile(base / "config.json", out / "config.json")
    # Tokenizer, chat template and generation config come from the base model: training never changes them.
    for p in base.iterdir():
        if (
            p.is_file()
            and p.suffix not in (".safetensors", ".bin")
            and p.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copyfile(p, out / p.name)
    return out


class CorruptWeights(BadMessage, ValueError):
    """A safetensors file that its own header does not describe (cut short, overwritten): export
    refuses it before writing anything, instead of copying it on for a loader to fail on later."""


class UnsafeCheckpoint(BadMessage, ValueError):
    """A DeepSpeed checkpoint file that holds more than tensors, containers and DeepSpeed's own few
    records: it is refused, never unpickled (a pickle can run any code as it loads)."""


def _deepspeed_records() -> list:
    # What DeepSpeed pickles into a ZeRO optimizer-state file besides tensors and containers (read by
    # zero_to_fp32): the only classes safe_load builds. Plain data classes: building one runs no code.
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def safe_load(path, map_location="cpu", weights_only=None, **kwargs):
    """torch.load of a DeepSpeed checkpoint file with weights_only=True (whatever the caller asked):
    tensors, containers and _deepspeed_records only; anything else raises UnsafeCheckpoint."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(_deepspeed_records()):
            return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        # torch's message is a page of advice to load it anyway; its WeightsUnpickler line says what was refused
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
        first = why.split(" was not an allowed global", 1)[0] or type(e).__name__
        raise UnsafeCheckpoint(
            f"{path} holds more than tensors and DeepSpeed's records ({first}); refused without loading it. "
            "Use a checkpoint this run's learner wrote: restore the file from a trusted copy"
        ) from None


class _SafeTorch:
    """torch as DeepSpeed's zero_to_fp32 sees it during an export: its torch.load is safe_load."""

    def __init__(self, torch) -> None:
        self._torch = torch

    def __getattr__(self, name: str):
        return safe_load if name == "load" else getattr(self._torch, name)


def _consolidate(root: Path, tag: str, base: Path, out: Path) -> None:
    import torch
    from deepspeed.utils import zero_to_fp32
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    if list((root / tag).glob("*optim_states.pt")) and any((root / tag).glob("zero_pp_rank_*")):
        # zero_to_fp32 calls torch.load(..., weights_only=False): its own module-level name is pointed
        # at safe_load for the call, nothing else in the process changes
        zero_to_fp32.torch = _SafeTorch(torch)
        try:
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
        finally:
            zero_to_fp32.torch = torch
    else:  # ZeRO stage 0: the module's own state dict is in the model-states file
        state = safe_load(root / tag / "mp_rank_00_model_states.pt")["module"]
    # DeepSpeed wraps the HF model as PackedPolicy.model: drop that prefix to get checkpoint names.
    state = {k.removeprefix("model."): v for k, v in state.items()}
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(base / "config.json", out / "config.json")
