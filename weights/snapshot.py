"""The trained model's weights under their checkpoint (HF) names, as actors and vLLM load them:
gathered to CPU without tied duplicates (a WeightSnapshot, taken right after a step), written as
one model.safetensors + config.json. The GPU transports pack hf_tensors into rank 0's buffers
themselves (weights.cuda_ipc.IpcPublisher)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from parley.runtime.durable import fsync_dir, fsync_file, write_durable_text

if TYPE_CHECKING:
    from torch import Tensor


def version_dir(root: Path, version: int) -> Path:
    """Where the learner writes `version`'s files under `root` (kept for export until pruned)."""
    return Path(root) / f"v{version:06d}"


def prune_versions(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` version directories under `root`."""
    root = Path(root)
    if not root.is_dir():
        return
    versions = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("v")), reverse=True)
    for p in versions[keep:]:
        shutil.rmtree(p, ignore_errors=True)


def hf_tensors(model) -> list[tuple[str, Tensor]]:
    """A transformers model's full state dict under its checkpoint names, where the tensors are
    (no copy), with tied duplicates (lm_head sharing the embedding) left out as save_pretrained does."""
    out, seen = [], set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            continue  # a tied weight already written under its first name
        seen.add(key)
        out.append((name, t.detach()))
    return out


def hf_weights(model) -> dict[str, Tensor]:
    """hf_tensors copied to CPU in their dtype."""
    return {name: t.to("cpu", copy=True).contiguous() for name, t in hf_tensors(model)}


@dataclass
class WeightSnapshot:
    """The trained weights after one step: CPU copies under HF names (hf_weights) and the model's
    config.json text. Taken synchronously on rank 0 (Trainer.weights_snapshot), so the next step
    cannot change what a version announces; written and uploaded later, beside training."""

    state: dict[str, Tensor]
    config_json: str
    written: Path | None = None

    def write(self, out_dir: str | Path) -> Path:
        """Write it once (a second call returns the first file's directory); the CPU copies are freed
        after, since what follows (upload, hashing) reads the file."""
        if self.written is None:
            self.written = _write(self.state, self.config_json, out_dir)
            self.state = {}
        return self.written


def write_weights(state: dict[str, Tensor], config, out_dir: str | Path) -> Path:
    """model.safetensors (one file, HF names) + config.json into out_dir, written beside and renamed."""
    return _write(state, config.to_json_string(), out_dir)


def _write(state: dict[str, Tensor], config_json: str, out_dir: str | Path) -> Path:
    return write_version_files(out_dir, "model.safetensors", state, {"config.json": config_json})


def write_version_files(
    out_dir: str | Path, tensors_name: str, state: dict[str, Tensor], texts: dict[str, str]
) -> Path:
    """A version's files in out_dir, durable when this returns: each written beside, fsynced and
    renamed, the text files (configs) first and the tensors file last, then the directory and its
    parent fsynced. The learner keeps these directories for `parley export`, which lists a version by
    its tensors file (learner.checkpoint.available_versions): after a power cut that file is whole, with
    its configs beside it, or absent; without the fsyncs the renames could reach the disk before the
    data and leave an empty file listed as a version."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        write_durable_text(out / name, text)
    tmp = out / f"{tensors_name}.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    fsync_file(tmp)
    os.replace(tmp, out / tensors_name)
    fsync_dir(out)  # the rename
    fsync_dir(out.parent)  # the version directory's own entry
    return out


@dataclass
class PackedSnapshot:
    """[weights] delta_format = "packed": a version the learner packed on its GPU
    (weights.gpu_delta.PendingVersion) instead of copying it to the host on the step; its full file is
    written from one host copy of the packed buffer when the publication gets to it, beside the next
    step. `write` as WeightSnapshot's."""

    pending: object
    config_json: str
    written: Path | None = None

    def write(self, out_dir: str | Path) -> Path:
        if self.written is None:
            self.written = _write(self.pending.host_state(), self.config_json, out_dir)
        return self.written
