"""The `cuda_ipc` weight transport's GPU side: the learner's rank 0 packs its weights (checkpoint
names) into one GPU buffer, checksums every tensor on the GPU and exports the buffer as a CUDA IPC
handle (torch's own export, as plain values in protocol.messages.CudaIpcBuffer); an actor's vLLM
worker on the same host opens the handle, copies the buffer into its own GPU memory, checksums the
copy and refuses it unless every tensor matches, and only then hands the tensors to load_weights.

Rank 0's buffers are held by IpcPublisher (learner.trainer builds it through weights.registry);
the nccl transport reuses its layout, checksums and buffers. engines.engine's WorkerExtension
receives through `CudaIpc.receive`. torch is imported inside the functions: the module imports
without it.

The checksum is against partial or mismatched transfers (a buffer overwritten while read, a wrong
handle), not against an adversary: both processes trust the same GPU.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from protocol.messages import CudaIpcBuffer, IpcTensor, WeightVersion
from weights.common import Transport

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger("parley.weights")

ALIGN = 256  # bytes; every tensor starts on this boundary and its checksummed region is padded to it
_ROW = ALIGN // 4  # int32 words per checksum row
_CHUNK_ROWS = 1 << 22  # rows reduced per kernel (1 GiB of buffer, a 1 GiB int32 temporary)
_REBUILD_ARGS = 15  # torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments (torch 2.x)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan(named: Iterable[tuple[str, "Tensor"]]) -> tuple[list[IpcTensor], int]:
    """The buffer layout for these tensors, in order: entries without checksums, total bytes."""
    out, offset = [], 0
    for name, t in named:
        out.append(IpcTensor(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                             offset=offset, checksum=[]))
        offset += _padded(t.numel() * t.element_size())
    return out, offset


def view(buffer: "Tensor", entry: IpcTensor) -> "Tensor":
    """The tensor `entry` names, as a view into the uint8 `buffer`."""
    import torch

    return buffer[entry.offset: entry.offset + _nbytes(entry)].view(getattr(torch, entry.dtype)).view(entry.shape)


def pack(named: Iterable[tuple[str, "Tensor"]], buffer: "Tensor", layout: list[IpcTensor]) -> None:
    """Copy each tensor into its place in `buffer` (the padding stays as it was: zeros)."""
    named = list(named)
    if [n for n, _ in named] != [e.name for e in layout]:
        raise ValueError("the tensors to pack are not the ones the buffer was planned for (names or order differ)")
    for (name, t), e in zip(named, layout):
        dst = view(buffer, e)
        if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
            raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype} does not fit the planned {e.shape} {e.dtype}")
        dst.copy_(t.detach())


def checksums(buffer: "Tensor", layout: list[IpcTensor]) -> list[list[int]]:
    """Per tensor, three int64 sums over its padded region read as int32 words in rows of 64:
    all words, rows weighted by their index in the tensor, words weighted by their column. The
    integer sums (wrapping) are exact, so any device and kernel order give the same numbers; the
    weights make a moved row or word count, not only a changed value.

    The whole buffer is reduced row by row in a few large kernels, then cut into tensors with
    cumulative sums at their row boundaries: about 4 ms of an H200 for 8 GB, where per-tensor
    kernels would be launch-bound (~400 tensors x several kernels). One device sync in all."""
    import torch

    if not layout:
        return []
    dev = buffer.device
    rows = buffer.view(torch.int32).view(-1, _ROW)  # the buffer is a whole number of rows (plan pads)
    col_w = torch.arange(1, _ROW + 1, dtype=torch.int32, device=dev)
    row_sum, col_weighted = [], []
    for i in range(0, rows.shape[0], _CHUNK_ROWS):  # chunks bound the int32 temporary of the products
        part = rows[i: i + _CHUNK_ROWS]
        row_sum.append(part.sum(1, dtype=torch.int64))
        col_weighted.append((part * col_w).sum(1, dtype=torch.int64))
    rs = torch.cat(row_sum)  # (R,)
    idx = torch.arange(1, rs.numel() + 1, dtype=torch.int64, device=dev)

    def prefix(x):  # prefix[k] = sum of x[:k]
        return torch.cat([x.new_zeros(1), x.cumsum(0)])

    p1, p2, p3 = prefix(rs), prefix(rs * idx), prefix(torch.cat(col_weighted))
    starts = torch.tensor([e.offset // ALIGN for e in layout], dtype=torch.int64, device=dev)
    ends = starts + torch.tensor([_padded(_nbytes(e)) // ALIGN for e in layout], dtype=torch.int64, device=dev)
    s1 = p1[ends] - p1[starts]
    s2 = (p2[ends] - p2[starts]) - starts * s1  # weights idx - start: 1, 2, ... within the tensor
    s3 = p3[ends] - p3[starts]
    return torch.stack([s1, s2, s3], 1).cpu().tolist()


def _nbytes(entry: IpcTensor) -> int:
    import torch

    n = 1
    for d in entry.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, entry.dtype)).element_size()


def with_checksums(layout: list[IpcTensor], sums: list[list[int]]) -> list[IpcTensor]:
    return [IpcTensor(name=e.name, dtype=e.dtype, shape=e.shape, offset=e.offset, checksum=list(s))
            for e, s in zip(layout, sums, strict=True)]


def mismatch(announced: list[IpcTensor], sums: list[list[int]]) -> str | None:
    """None when every announced checksum equals the received one; else a one-line reason
    naming the first bad tensor and how many are bad."""
    if len(announced) != len(sums):
        return f"{len(sums)} checksums for {len(announced)} announced tensors"
    bad = [e.name for e, s in zip(announced, sums) if list(e.checksum) != list(s)]
    if bad:
        return f"checksum mismatch in {len(bad)} of {len(announced)} tensors (first: {bad[0]})"
    return None


def table_digest(tensors: list[IpcTensor]) -> str:
    """sha256 of the tensor table with its checksums: the version's identity (WeightVersion.sha256)."""
    import msgspec

    return hashlib.sha256(msgspec.msgpack.encode(tensors)).hexdigest()


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def local_device(uuid: str) -> int:
    """This process's index of the GPU with that UUID (indices depend on CUDA_VISIBLE_DEVICES)."""
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise LookupError(
        f"the learner's GPU {uuid} is not visible to this process; make it visible (CUDA_VISIBLE_DEVICES) "
        "or use [weights] kind nccl or objstore for actors on other GPUs"
    )


def export(buffer: "Tensor", tensors: list[IpcTensor], hold_s: float) -> CudaIpcBuffer:
    """A CUDA IPC handle for `buffer` (1-D uint8 on a GPU) with its tensor table. The caller keeps
    `buffer` alive and unchanged for as long as readers may open it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.dim() != 1 or not buffer.is_cuda or buffer.storage_offset() != 0:
        raise ValueError("export needs a whole 1-D CUDA buffer (storage offset 0)")
    fn, args = reduce_tensor(buffer)
    if getattr(fn, "__name__", "") != "rebuild_cuda_tensor" or len(args) != _REBUILD_ARGS:
        raise RuntimeError(f"this torch exports CUDA tensors as {getattr(fn, '__name__', fn)} with {len(args)} "
                           f"arguments; cuda_ipc knows rebuild_cuda_tensor with {_REBUILD_ARGS}")
    (_cls, _size, _stride, _offset, _storage_cls, _dtype, device, handle, storage_size, storage_offset,
     _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaIpcBuffer(
        device_uuid=device_uuid(device), storage_handle=bytes(handle), storage_size=int(storage_size),
        storage_offset=int(storage_offset), ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync), nbytes=buffer.numel(),
        hold_s=float(hold_s), tensors=tensors,
    )


def receive(ipc: CudaIpcBuffer, device) -> tuple[list[tuple[str, "Tensor"]], str | None]:
    """Open the learner's buffer, copy it to `device` and check it: ((name, tensor) views into the
    local copy, None) when every checksum matches, ([], reason) when not. The learner's memory is
    released before returning; nothing of the model is touched here."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    src_dev = local_device(ipc.device_uuid)
    src = rebuild_cuda_tensor(
        torch.Tensor, (ipc.nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, src_dev, ipc.storage_handle,
        ipc.storage_size, ipc.storage_offset, False, ipc.ref_counter_handle, ipc.ref_counter_offset,
        ipc.event_handle or None, ipc.event_sync_required,
    )
    staged = torch.empty(ipc.nbytes, dtype=torch.uint8, device=device)
    staged.copy_(src)
    torch.cuda.synchronize(device)
    del src  # closes our mapping and releases the learner's reference counter
    reason = mismatch(ipc.tensors, checksums(staged, ipc.tensors))
    if reason:
        return [], reason
    return [(e.name, view(staged, e)) for e in ipc.tensors], None


@dataclass
class _Buffer:
    data: "Tensor"  # (bytes,) uint8 on the GPU, exported by CUDA IPC
    version: int | None = None
    superseded_at: float | None = None  # monotonic time the next version replaced it
    readers: int = 0  # nccl sends under way from it


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
        self._lock = threading.Lock()  # nccl sender threads take buffers while the learner fills one

    def _new_buffer(self, device) -> _Buffer:
        import torch

        # zeros: the padding between tensors is part of the checksummed regions
        self.buffers.append(_Buffer(torch.zeros(self.total, dtype=torch.uint8, device=device)))
        return self.buffers[-1]

    def _free_buffer(self, device) -> _Buffer:
        now = time.monotonic()
        free = [b for b in self.buffers if not b.readers]
        idle = [b for b in free if b.version is None
                or (b.superseded_at is not None and now - b.superseded_at >= self.hold_s)]
        if idle:
            return idle[0]
        if len(self.buffers) < self.max_buffers:
            return self._new_buffer(device)
        superseded = [b for b in free if b.superseded_at is not None]
        if not superseded:  # every old buffer is being sent from: never write under a reader
            log.warning("weights: every buffer is being sent; allocating buffer %d", len(self.buffers) + 1)
            return self._new_buffer(device)
        oldest = min(superseded, key=lambda b: b.superseded_at)
        log.warning("weights: all %d buffers were superseded less than %.0f s ago; overwriting version %d's "
                    "(an actor still copying it refuses it and takes the next)", len(self.buffers), self.hold_s,
                    oldest.version)
        return oldest

    def take(self, version: int) -> _Buffer | None:
        """The buffer holding `version` for a send (release() it after), or None when that version
        is gone: overwritten, or superseded longer ago than the hold time."""
        with self._lock:
            for b in self.buffers:
                if b.version == version and (b.superseded_at is None or time.monotonic() - b.superseded_at < self.hold_s):
                    b.readers += 1
                    return b
        return None

    def release(self, buf: _Buffer) -> None:
        with self._lock:
            buf.readers -= 1

    def close(self) -> None:
        """Nothing to stop: the buffers live as long as the learner."""

    def pack(self, named: list[tuple[str, "Tensor"]], version: int):
        """Copy `named` (GPU tensors) into a free buffer, checksum it on the GPU and export it:
        the protocol.messages.CudaIpcBuffer to announce."""
        buf, tensors = self.fill(named, version)
        return export(buf, tensors, self.hold_s)

    def fill(self, named: list[tuple[str, "Tensor"]], version: int):
        """pack without the export: (the buffer now holding `version`, its tensor table with checksums)."""
        layout, total = plan(named)
        if self.layout is None:
            self.layout, self.total = layout, total
        elif layout != self.layout:
            raise RuntimeError("the model's tensors changed between versions; cuda_ipc buffers are planned once")
        with self._lock:
            buf = self._free_buffer(named[0][1].device)
            buf.version = None  # being written: not to be sent
            pack(named, buf.data, self.layout)
            sums = checksums(buf.data, self.layout)  # returns after the copies are done (one sync)
            now = time.monotonic()
            for b in self.buffers:
                if b.version is not None and b.superseded_at is None and b is not buf:
                    b.superseded_at = now
            buf.version, buf.superseded_at = version, None
        return buf.data, with_checksums(self.layout, sums)


class CudaIpc(Transport):
    kind = "cuda_ipc"
    gpu = needs_cuda = True  # actors must also see rank 0's GPU (local_device)
    shares_device = True
    source_type = CudaIpcBuffer

    def sender(self, settings, device) -> IpcPublisher:
        return IpcPublisher(settings.hold_s, settings.max_buffers)

    def announcement(self, source: CudaIpcBuffer, **common) -> WeightVersion:
        return WeightVersion(transport=self.kind, location=f"cuda:{source.device_uuid}", ipc=source, **common)

    def source(self, wv: WeightVersion) -> CudaIpcBuffer | None:
        return wv.ipc

    def receive(self, wv: WeightVersion, state: dict):
        import torch

        if not torch.cuda.is_available():
            return [], "this engine runs without CUDA; cuda_ipc needs actors on the learner's GPUs"
        try:
            return receive(wv.ipc, torch.device("cuda", torch.cuda.current_device()))
        except (LookupError, RuntimeError) as e:  # the GPU is not visible, or the handle no longer opens
            return [], f"cannot open the learner's buffer: {e}"
