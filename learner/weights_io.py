"""The trained model's weights under their checkpoint (HF) names, as actors and vLLM load them:
gathered to CPU without tied duplicates, written as one model.safetensors + config.json; or, for
transport cuda_ipc, packed into a shared GPU buffer on rank 0 (IpcPublisher)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("parley.learner")


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
class _Buffer:
    data: Tensor  # (bytes,) uint8 on the GPU, exported by CUDA IPC
    version: int | None = None
    superseded_at: float | None = None  # monotonic time the next version replaced it


class IpcPublisher:
    """Rank 0's shared GPU buffers for transport cuda_ipc. Each version is packed into a buffer
    that no reader may be holding: one that never served, or was superseded at least `hold_s`
    ago (readers give up after hold_s, the announcement says so). When none is free, another is
    allocated, up to `max_buffers`; past that the longest-superseded one is overwritten and a
    reader still copying it refuses the version on its checksums (and takes the next one).
    The learner never waits for actors. Buffers live as long as the learner, so torch's IPC
    reference counting never has to free one under a reader."""

    def __init__(self, hold_s: float, max_buffers: int = 2):
        self.hold_s, self.max_buffers = hold_s, max_buffers
        self.buffers: list[_Buffer] = []
        self.layout = None
        self.total = 0

    def _free_buffer(self, device) -> _Buffer:
        now = time.monotonic()
        idle = [b for b in self.buffers if b.version is None
                or (b.superseded_at is not None and now - b.superseded_at >= self.hold_s)]
        if idle:
            return idle[0]
        if len(self.buffers) < self.max_buffers:
            # zeros: the padding between tensors is part of the checksummed regions
            self.buffers.append(_Buffer(torch.zeros(self.total, dtype=torch.uint8, device=device)))
            return self.buffers[-1]
        superseded = [b for b in self.buffers if b.superseded_at is not None]
        oldest = min(superseded, key=lambda b: b.superseded_at)
        log.warning("cuda_ipc: all %d buffers were superseded less than %.0f s ago; overwriting version %d's "
                    "(an actor still copying it refuses it and takes the next)", len(self.buffers), self.hold_s,
                    oldest.version)
        return oldest

    def pack(self, named: list[tuple[str, Tensor]], version: int):
        """Copy `named` (GPU tensors) into a free buffer, checksum it on the GPU and export it:
        the protocol.messages.CudaIpcBuffer to announce."""
        from protocol import cuda_ipc

        buf, tensors = self.fill(named, version)
        return cuda_ipc.export(buf, tensors, self.hold_s)

    def fill(self, named: list[tuple[str, Tensor]], version: int):
        """pack without the export: (the buffer now holding `version`, its tensor table with checksums)."""
        from protocol import cuda_ipc

        layout, total = cuda_ipc.plan(named)
        if self.layout is None:
            self.layout, self.total = layout, total
        elif layout != self.layout:
            raise RuntimeError("the model's tensors changed between versions; cuda_ipc buffers are planned once")
        device = named[0][1].device
        buf = self._free_buffer(device)
        cuda_ipc.pack(named, buf.data, self.layout)
        sums = cuda_ipc.checksums(buf.data, self.layout)  # returns after the copies are done (one sync)
        now = time.monotonic()
        for b in self.buffers:
            if b.version is not None and b.superseded_at is None and b is not buf:
                b.superseded_at = now
        buf.version, buf.superseded_at = version, None
        return buf.data, cuda_ipc.with_checksums(self.layout, sums)


def write_weights(state: dict[str, Tensor], config, out_dir: str | Path) -> Path:
    """model.safetensors (one file, HF names) + config.json into out_dir, written beside and renamed."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    config.to_json_file(str(out / "config.json"))
    return out
