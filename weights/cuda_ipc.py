"""The `cuda_ipc` weight transport's GPU side: the learner's rank 0 packs its weights (checkpoint
names) into one GPU buffer, checksums every tensor on the GPU and exports the buffer as a CUDA IPC
handle (torch's own export, as plain values in protocol.messages.CudaIpcBuffer); an actor's vLLM
worker on the same host opens the handle, checksums the buffer and refuses it unless every tensor
matches, and only then hands the tensors to load_weights.

The hold promise: rank 0 leaves a filled buffer untouched for `hold_s` after `filled_at` (it skips
publishing a version rather than write into a buffer still held: IpcPublisher). A reader with at
least half the hold time left loads straight from the learner's buffer (no copy: the 4B shape's
7.5 GiB stay free on a shared GPU) and, if its load ran past the deadline, checks the buffer again
afterwards; a later reader copies the buffer into its own memory first and checks the copy.

Rank 0's buffers are held by IpcPublisher (learner.trainer builds it through weights.registry);
the nccl transport reuses its layout, checksums and buffers. engines.engine's WorkerExtension
receives through `CudaIpc.receive` and `CudaIpc.loaded`. torch is imported inside the functions:
the module imports without it.

The checksum is against partial or mismatched transfers (a buffer overwritten while read, a wrong
handle), not against an adversary: both processes trust the same GPU.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parley.protocol.messages import CudaIpcBuffer, IpcTensor, WeightVersion
from parley.weights.common import Transport, WeightUnavailable

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

ALIGN = 256  # bytes; every tensor starts on this boundary and its checksummed region is padded to it
_ROW = ALIGN // 4  # int32 words per checksum row
_CHUNK_ROWS = 1 << 22  # rows reduced per kernel (1 GiB of buffer, a 1 GiB int32 temporary)
_REBUILD_ARGS = 15  # torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments (torch 2.x)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan(named: Iterable[tuple[str, Tensor]]) -> tuple[list[IpcTensor], int]:
    """The buffer layout for these tensors, in order: entries without checksums, total bytes."""
    out, offset = [], 0
    for name, t in named:
        out.append(
            IpcTensor(
                name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=offset, checksum=[]
            )
        )
        offset += _padded(t.numel() * t.element_size())
    return out, offset


def view(buffer: Tensor, entry: IpcTensor) -> Tensor:
    """The tensor `entry` names, as a view into the uint8 `buffer`."""
    import torch

    return buffer[entry.offset : entry.offset + _nbytes(entry)].view(getattr(torch, entry.dtype)).view(entry.shape)


def one_run(named: list[tuple[str, Tensor]]) -> list[int] | None:
    """The order in which `named`'s tensors lie end to end in one storage, nothing between them, each
    contiguous and of one dtype; None when they do not. DeepSpeed's ZeRO-1/2 optimizer keeps the trained
    parameters so (views into one flat buffer per group: the LoRA adapter's, whose peft names sort in
    another order). Packed in this order into a layout without padding, they are one copy
    (IpcPublisher.fill), not one per tensor."""
    if not named:
        return None
    first = named[0][1]
    dtype, storage = first.dtype, first.untyped_storage().data_ptr()
    keyed = []
    for i, (_, t) in enumerate(named):
        if t.dtype != dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage:
            return None
        keyed.append((t.storage_offset(), t.numel(), i))
    keyed.sort()
    for (offset, n, _), (following, _, _) in zip(keyed, keyed[1:]):
        if offset + n != following:
            return None
    return [i for _, _, i in keyed]


def gapless(layout: list[IpcTensor]) -> bool:
    """Whether each tensor of `layout` starts where the one before it ends (no padding between them:
    every tensor but the last is a whole number of ALIGN bytes)."""
    return all(b.offset == a.offset + _nbytes(a) for a, b in zip(layout, layout[1:]))


def views(buffer: Tensor, entries: Iterable[IpcTensor]) -> list[Tensor]:
    """view() of each entry, in one pass: one typed view of the whole buffer per dtype, then one
    as_strided per tensor instead of a slice and two views (each a Python call into torch). A
    version's tensors are viewed on every pack and receive: for the 504 tensors of the 4B shape's
    rank-16 adapter this is a few times faster than view() (docs/benchmarks.md, "Weight path"), and it
    counts against an adapter's 0.05 s goal from step end to added. An entry outside the buffer raises
    ValueError."""
    import torch

    size, base = buffer.numel(), buffer.storage_offset()
    typed: dict[str, Tensor] = {}
    out = []
    for e in entries:
        item = _itemsize(e.dtype)
        n = 1
        for d in e.shape:
            n *= d
        if e.offset < 0 or e.offset + n * item > size:
            raise ValueError(f"{e.name}: bytes {e.offset}..{e.offset + n * item} are outside the {size}-byte buffer")
        if e.offset % item or base % item:  # not on the dtype's boundary (plan never does this): as view() does
            out.append(view(buffer, e))
            continue
        t = typed.get(e.dtype)
        if t is None:
            t = typed[e.dtype] = buffer[: size - size % item].view(getattr(torch, e.dtype))
        strides, step = [], 1
        for d in reversed(e.shape):
            strides.append(step)
            step *= d
        out.append(t.as_strided(e.shape, strides[::-1], t.storage_offset() + e.offset // item))
    return out


def pack(
    named: Iterable[tuple[str, Tensor]], buffer: Tensor, layout: list[IpcTensor], dsts: list[Tensor] | None = None
) -> None:
    """Copy each tensor into its place in `buffer` (the padding stays as it was: zeros).

    Every shape and dtype is checked first, then all tensors go in one multi-tensor copy
    (torch._foreach_copy_): one call, not a Python call and kernel launch per tensor (~400 for the
    4B shape, ~500 for its rank-16 adapter). The copy of the 4B shape takes as long either way
    (docs/benchmarks.md, "Weight path"), so this saves launches, not bandwidth.

    `dsts`: views(buffer, layout) made earlier, by a caller that has itself checked that `named`
    has the layout's names, shapes and dtypes in order (IpcPublisher.fill, which keeps both per
    buffer): then nothing is checked or viewed here again."""
    import torch

    named = list(named)
    if dsts is None:
        if [n for n, _ in named] != [e.name for e in layout]:
            raise ValueError("the tensors to pack are not the ones the buffer was planned for (names or order differ)")
        dsts = []
        for (name, t), e, dst in zip(named, layout, views(buffer, layout)):
            if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
                raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype} does not fit the planned {e.shape} {e.dtype}")
            dsts.append(dst)
    elif len(dsts) != len(named):
        raise ValueError(f"{len(named)} tensors to pack into {len(dsts)} views")
    if dsts:
        torch._foreach_copy_(dsts, [t.detach() for _, t in named])


def checksums(buffer: Tensor, layout: list[IpcTensor], impl: str | None = None) -> list[list[int]]:
    """Per tensor, three int64 sums over its padded region read as int32 words in rows of 64:
    all words, rows weighted by their index in the tensor, words weighted by their column (the
    product taken in int32, wrapping). The integer sums (wrapping) are exact, so any device, kernel
    and order give the same numbers; the weights make a moved row or word count, not only a
    changed value.

    The whole buffer is reduced row by row (`row_sums`), then cut into tensors with cumulative sums
    at their row boundaries; per-tensor kernels would be launch-bound (~400 tensors x several
    kernels). One device sync in all. `impl`: "triton" (one fused pass over the buffer: the default
    on CUDA where Triton runs and agrees with torch), "torch" (a few large kernels a GiB), None: the
    default."""
    import torch

    if not layout:
        return []
    dev = buffer.device
    rs, cw = row_sums(buffer.view(torch.int32).view(-1, _ROW), impl)  # the buffer is a whole number of rows (plan pads)
    idx = torch.arange(1, rs.numel() + 1, dtype=torch.int64, device=dev)

    def prefix(x):  # prefix[k] = sum of x[:k]
        return torch.cat([x.new_zeros(1), x.cumsum(0)])

    p1, p2, p3 = prefix(rs), prefix(rs * idx), prefix(cw)
    starts = torch.tensor([e.offset // ALIGN for e in layout], dtype=torch.int64, device=dev)
    ends = starts + torch.tensor([_padded(_nbytes(e)) // ALIGN for e in layout], dtype=torch.int64, device=dev)
    s1 = p1[ends] - p1[starts]
    s2 = (p2[ends] - p2[starts]) - starts * s1  # weights idx - start: 1, 2, ... within the tensor
    s3 = p3[ends] - p3[starts]
    return torch.stack([s1, s2, s3], 1).cpu().tolist()


def row_sums(rows: Tensor, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """For (R, 64) int32 `rows`: each row's sum and its column-weighted sum (word c times c + 1, the
    product wrapping in int32), both int64, (R,) each."""
    if impl is None:
        impl = "triton" if rows.is_cuda and _triton_agrees(rows.device) else "torch"
    if impl == "triton":
        return _row_sums_triton(rows)
    if impl != "torch":
        raise ValueError(f"checksum impl {impl!r}: 'triton' or 'torch'")
    return _row_sums_torch(rows)


def _row_sums_torch(rows: Tensor) -> tuple[Tensor, Tensor]:
    import torch

    col_w = torch.arange(1, _ROW + 1, dtype=torch.int32, device=rows.device)
    row_sum, col_weighted = [], []
    for i in range(0, rows.shape[0], _CHUNK_ROWS):  # chunks bound the int32 temporary of the products
        part = rows[i : i + _CHUNK_ROWS]
        row_sum.append(part.sum(1, dtype=torch.int64))
        col_weighted.append((part * col_w).sum(1, dtype=torch.int64))
    return torch.cat(row_sum), torch.cat(col_weighted)


_TRITON_ROWS = 64  # rows a Triton program reduces (64 x 256 B = 16 KiB read)
_triton_kernel = None
_triton_ok: dict[str, bool] = {}  # per device: the fused kernel gave torch's sums on a test buffer


def _row_sums_triton(rows: Tensor) -> tuple[Tensor, Tensor]:
    """row_sums in one pass: each program reads its rows once and writes both sums (torch's path
    reads the buffer three times and writes an int32 copy of it)."""
    import torch
    import triton

    kernel = _fused_kernel()
    n = rows.shape[0]
    out = torch.empty((n, 2), dtype=torch.int64, device=rows.device)
    if n:
        kernel[(triton.cdiv(n, _TRITON_ROWS),)](rows, out, n, ROW=_ROW, BLOCK=_TRITON_ROWS)
    return out[:, 0], out[:, 1]


def _fused_kernel():
    global _triton_kernel
    if _triton_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def fused_row_sums(x_ptr, out_ptr, n_rows, ROW: tl.constexpr, BLOCK: tl.constexpr):
            r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            c = tl.arange(0, ROW)
            inside = r < n_rows
            x = tl.load(x_ptr + r[:, None] * ROW + c[None, :], mask=inside[:, None], other=0).to(tl.int64)
            prod = x * (c[None, :] + 1).to(tl.int64)
            prod = ((prod + 2147483648) & 4294967295) - 2147483648  # the int32 product torch's path takes
            tl.store(out_ptr + r * 2, tl.sum(x, axis=1), mask=inside)
            tl.store(out_ptr + r * 2 + 1, tl.sum(prod, axis=1), mask=inside)

        _triton_kernel = fused_row_sums
    return _triton_kernel


def prepare_checksums(device) -> str:
    """Pick the checksum implementation for `device` now (compiling and checking the fused kernel on
    CUDA: a second or two the first time), so that no later checksum pays for it; returns its name."""
    import torch

    return "triton" if torch.device(device).type == "cuda" and _triton_agrees(device) else "torch"


def _triton_agrees(device) -> bool:
    """Whether the fused kernel runs on `device` and gives exactly torch's sums on a random 4 MiB
    buffer (extreme words included), checked once per device; else the torch path is used, and
    logged."""
    key = str(device)
    if key not in _triton_ok:
        import torch

        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            probe = torch.randint(-(2**31), 2**31 - 1, (16384 + 37, _ROW), dtype=torch.int32, generator=gen)
            probe[0].fill_(2**31 - 1)
            probe[1].fill_(-(2**31))
            probe = probe.to(device)
            got, want = _row_sums_triton(probe), _row_sums_torch(probe)
            _triton_ok[key] = all(torch.equal(a, b) for a, b in zip(got, want))
            if not _triton_ok[key]:
                log.warning("weights: the fused Triton checksum differs from torch's on %s; using torch's", key)
        except Exception as e:  # noqa: BLE001 - no Triton, no compiler for this GPU: torch's path
            log.warning("weights: the fused Triton checksum does not run on %s (%s); using torch's", key, e)
            _triton_ok[key] = False
    return _triton_ok[key]


_ITEMSIZE: dict[str, int] = {}  # dtype name -> bytes per element


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        import torch

        size = _ITEMSIZE[dtype] = getattr(torch, dtype).itemsize
    return size


def _nbytes(entry: IpcTensor) -> int:
    n = 1
    for d in entry.shape:
        n *= d
    return n * _itemsize(entry.dtype)


def with_checksums(layout: list[IpcTensor], sums: list[list[int]]) -> list[IpcTensor]:
    return [
        IpcTensor(name=e.name, dtype=e.dtype, shape=e.shape, offset=e.offset, checksum=list(s))
        for e, s in zip(layout, sums, strict=True)
    ]


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


def export(buffer: Tensor, tensors: list[IpcTensor], hold_s: float, filled_at: float = 0.0) -> CudaIpcBuffer:
    """A CUDA IPC handle for `buffer` (1-D uint8 on a GPU) with its tensor table. The caller keeps
    `buffer` alive and unchanged for as long as readers may open it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.dim() != 1 or not buffer.is_cuda or buffer.storage_offset() != 0:
        raise ValueError("export needs a whole 1-D CUDA buffer (storage offset 0)")
    fn, args = reduce_tensor(buffer)
    if getattr(fn, "__name__", "") != "rebuild_cuda_tensor" or len(args) != _REBUILD_ARGS:
        raise RuntimeError(
            f"this torch exports CUDA tensors as {getattr(fn, '__name__', fn)} with {len(args)} "
            f"arguments; cuda_ipc knows rebuild_cuda_tensor with {_REBUILD_ARGS}"
        )
    (
        _cls,
        _size,
        _stride,
        _offset,
        _storage_cls,
        _dtype,
        device,
        handle,
        storage_size,
        storage_offset,
        _grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return CudaIpcBuffer(
        device_uuid=device_uuid(device),
        storage_handle=bytes(handle),
        storage_size=int(storage_size),
        storage_offset=int(storage_offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
        nbytes=buffer.numel(),
        hold_s=float(hold_s),
        tensors=tensors,
        filled_at=float(filled_at),
    )


DIRECT_SHARE = 0.5  # a reader loads straight from the learner's buffer with at least this share of hold_s left


def direct_deadline(ipc: CudaIpcBuffer, now: float | None = None) -> float | None:
    """The wall-clock time until which the learner promises the buffer unchanged, when enough of it is
    left to load from the buffer itself (at least DIRECT_SHARE of hold_s); None: copy it first (an
    announcement from a learner without filled_at, or a reader that comes late)."""
    if ipc.filled_at <= 0:
        return None
    deadline = ipc.filled_at + ipc.hold_s
    now = time.time() if now is None else now
    return deadline if deadline - now >= DIRECT_SHARE * ipc.hold_s else None


def _open(ipc: CudaIpcBuffer) -> Tensor:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        (ipc.nbytes,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        local_device(ipc.device_uuid),
        ipc.storage_handle,
        ipc.storage_size,
        ipc.storage_offset,
        False,
        ipc.ref_counter_handle,
        ipc.ref_counter_offset,
        ipc.event_handle or None,
        ipc.event_sync_required,
    )


KEEP_OPEN = 8  # the learner's buffers an adapter reader keeps mapped (receive with own=True)
_kept: dict[tuple[bytes, int], Tensor] = {}  # (storage handle, offset) -> the open buffer, oldest first


def _release_counter(ipc: CudaIpcBuffer) -> None:
    """Give back the reference count this export took for its reader (each export takes one), as
    torch's rebuild_cuda_tensor does when the handle is open already: the learner's torch frees a
    buffer's export records once every reader has."""
    import torch

    torch.UntypedStorage._release_ipc_counter_cuda(ipc.ref_counter_handle, ipc.ref_counter_offset)


def _open_kept(ipc: CudaIpcBuffer) -> tuple[Tensor, bool]:
    """_open, for a reader that copies the buffer out at once (own=True): the mapping stays open for
    the next version that comes in the same buffer (the learner reuses its few buffers for as long as
    it lives), which then opens no handle: (the buffer, whether a kept mapping was reused). No wait on
    the export's CUDA event either: the learner has synchronized its fill before it announces (the
    checksums are read back to its CPU). Holding a mapping costs nothing while the learner lives; after
    a learner restart at most KEEP_OPEN of its old buffers stay mapped until newer ones push them out."""
    key = (ipc.storage_handle, ipc.storage_offset)
    src = _kept.pop(key, None)
    reused = src is not None and src.numel() == ipc.nbytes
    if reused:
        _release_counter(ipc)  # what torch does for a handle it has open: this export's counter back
    else:
        src = _open(ipc)
    _kept[key] = src
    while len(_kept) > KEEP_OPEN:
        _kept.pop(next(iter(_kept)))
    return src, reused


def receive(
    ipc: CudaIpcBuffer, device, state: dict | None = None, own: bool = False
) -> tuple[list[tuple[str, Tensor]], str | None]:
    """Open the learner's buffer and check it: ((name, tensor) views, None) when every checksum
    matches, ([], reason) when not; nothing of the model is touched here.

    Within the hold (direct_deadline) the views are into the learner's buffer itself, and `state`
    keeps what `after_load` needs to tell whether the buffer stayed unchanged until the load
    ended; past it, or with own=True (tensors to keep: an adapter), into a local copy on `device`
    made in one copy of the whole buffer. With own=True the learner's mapping stays open for its next
    fill (_open_kept); otherwise it is closed at once. `state["receive_s"]`: where the time went."""
    import torch

    t0 = time.perf_counter()
    src, reused = _open_kept(ipc) if own else (_open(ipc), False)
    deadline = None if own else direct_deadline(ipc)
    if deadline is not None:
        t_open = time.perf_counter()
        reason = mismatch(ipc.tensors, checksums(src, ipc.tensors))
        if reason:
            return [], reason
        t_check = time.perf_counter()
        named = list(zip([e.name for e in ipc.tensors], views(src, ipc.tensors)))
        if state is not None:  # the load's after_load check, and where a receive's time goes (the worker logs it)
            state["direct"] = (src, ipc, deadline)
            state["receive_s"] = {
                "open": t_open - t0,
                "checksum": t_check - t_open,
                "views": time.perf_counter() - t_check,
            }
        return named, None
    t_open = time.perf_counter()
    staged = torch.empty(ipc.nbytes, dtype=torch.uint8, device=device)
    staged.copy_(src)
    if staged.is_cuda:
        torch.cuda.synchronize(device)
    del src  # without own: closes our mapping and releases the learner's reference counter
    t_copy = time.perf_counter()
    reason = mismatch(ipc.tensors, checksums(staged, ipc.tensors))
    if reason and reused:  # not refused on a kept mapping's word: the next try opens the handle afresh
        _kept.pop((ipc.storage_handle, ipc.storage_offset), None)
        raise WeightUnavailable(
            f"the learner's buffer, read through a mapping kept from an earlier version, "
            f"disagrees with this announcement ({reason}); it is opened afresh at the next try"
        )
    if reason:
        return [], reason
    t_check = time.perf_counter()
    named = list(zip([e.name for e in ipc.tensors], views(staged, ipc.tensors)))
    if state is not None:
        state["receive_s"] = {
            "open": t_open - t0,
            "copy": t_copy - t_open,
            "checksum": t_check - t_copy,
            "views": time.perf_counter() - t_check,
        }
    return named, None


def after_load(state: dict, now: float | None = None) -> str | None:
    """After a direct load: None when the learner's buffer provably stayed unchanged (the load ended
    within the hold, or its checksums still match); else why the loaded weights may be mixed. Closes
    the mapping either way."""
    direct = state.pop("direct", None)
    if direct is None:
        return None
    src, ipc, deadline = direct
    import torch

    if src.is_cuda:
        torch.cuda.synchronize(src.device)  # the load's copies out of the buffer are done
    now = time.time() if now is None else now
    reason = None
    if now > deadline:
        bad = mismatch(ipc.tensors, checksums(src, ipc.tensors))
        if bad:
            reason = (
                f"the learner's buffer changed while it was loaded ({bad}; the load ended "
                f"{now - deadline:.1f} s past the hold)"
            )
    del src
    return reason


@dataclass
class _Buffer:
    data: Tensor  # (bytes,) uint8 on the GPU, exported by CUDA IPC
    version: int | None = None
    filled: float | None = None  # monotonic time it was filled with `version`
    readers: int = 0  # nccl sends under way from it
    views: list | None = None  # views(data, the publisher's layout), made at its first fill
    run: Tensor | None = None  # the layout's whole span as one typed view (IpcPublisher's one-copy fill)


class IpcPublisher:
    """Rank 0's shared GPU buffers for transport cuda_ipc (and nccl). Each version is packed into a
    buffer nobody may be reading: one that never served, or was filled at least `hold_s` ago (the
    announcement promises every buffer unchanged for hold_s after its filled_at), and none being sent
    from. The oldest such buffer is reused; when there is none, another is allocated, up to
    `max_buffers`; past that the version is not published at all (`fill` returns None, counted in
    `skipped`) and the next step's is tried: the learner never waits for actors and never writes into
    a buffer it promised to hold. One buffer is enough when steps are longer than hold_s. Buffers
    live as long as the learner, so torch's IPC reference counting never has to free one under a
    reader."""

    def __init__(self, hold_s: float, max_buffers: int = 2):
        self.hold_s, self.max_buffers = hold_s, max_buffers
        self.buffers: list[_Buffer] = []
        self.layout = None
        self.total = 0
        self._signature = None  # (name, shape, dtype) of each tensor the layout was planned for
        # one_run's order when the first fill's tensors lay end to end in one storage (the layout is
        # planned in it), and their data pointers then: a later fill whose tensors are still there and
        # whose layout has no padding is one copy of the whole span
        self._order: list[int] | None = None
        self._run_ptrs: list[int] | None = None
        self.skipped: list[int] = []  # versions not published: every buffer was still held
        self.fill_s: dict[str, float] = {}  # the last fill's seconds: copying the tensors in, checksumming
        self.fills_one_copy = 0  # fills that copied the tensors' whole span at once (one_run)
        self._lock = threading.Lock()  # nccl sender threads take buffers while the learner fills one

    def _new_buffer(self, device) -> _Buffer:
        import torch

        # zeros: the padding between tensors is part of the checksummed regions
        self.buffers.append(_Buffer(torch.zeros(self.total, dtype=torch.uint8, device=device)))
        return self.buffers[-1]

    def _free_buffer(self, device) -> _Buffer | None:
        now = time.monotonic()
        free = [b for b in self.buffers if not b.readers and (b.filled is None or now - b.filled >= self.hold_s)]
        if free:
            return min(free, key=lambda b: -1.0 if b.filled is None else b.filled)
        if len(self.buffers) < self.max_buffers:
            return self._new_buffer(device)
        return None

    def writable_in(self) -> float:
        """Seconds until a fill would find a buffer to write (0: now): what a publisher that must not
        skip a version (bench/weight_path.py) waits before its step ends. inf while every buffer is
        being sent from."""
        with self._lock:
            if len(self.buffers) < self.max_buffers or any(not b.readers and b.filled is None for b in self.buffers):
                return 0.0
            now = time.monotonic()
            ages = [now - b.filled for b in self.buffers if not b.readers]
            return max(0.0, self.hold_s - max(ages)) if ages else float("inf")

    def take(self, version: int) -> _Buffer | None:
        """The buffer holding `version` for a send (release() it after): no fill writes into it
        meanwhile. None when that version is gone (overwritten, or never published)."""
        with self._lock:
            for b in self.buffers:
                if b.version == version:
                    b.readers += 1
                    return b
        return None

    def release(self, buf: _Buffer) -> None:
        with self._lock:
            buf.readers -= 1

    def close(self) -> None:
        """Nothing to stop: the buffers live as long as the learner."""

    def pack(self, named: list[tuple[str, Tensor]], version: int, finish=None):
        """Copy `named` (GPU tensors) into a free buffer, checksum it on the GPU and export it:
        the protocol.messages.CudaIpcBuffer to announce, or None when every buffer is still held.
        `finish`: as fill's."""
        filled = self.fill(named, version, finish)
        if filled is None:
            return None
        buf, tensors = filled
        t0 = time.perf_counter()
        exported = export(buf, tensors, self.hold_s, filled_at=time.time())
        self.fill_s["export"] = time.perf_counter() - t0  # torch's IPC export: handle, reference counter, event
        return exported

    def fill(self, named: list[tuple[str, Tensor]], version: int, finish=None):
        """pack without the export: (the buffer now holding `version`, its tensor table with
        checksums), or None when no buffer may be written (the version is skipped, and logged).
        `finish`: called with the buffer's views by name after the copy and before the checksums, to
        change the copied tensors in place (learner.lora.merge_into: [learner.lora] serve = "merged"
        merges each adapter into its projection there, with no merged copy of the model beside it)."""
        # planned at the first fill; later ones compare each tensor's name, shape and dtype with
        # that plan's (the layout follows from them) and copy into views kept per buffer: planning and
        # viewing the 4B shape's rank-16 adapter anew each version costs milliseconds, against the
        # adapter's goal of 0.05 s from step end to added (docs/benchmarks.md, "Weight path").
        # Tensors that lie end to end in one storage (the adapter's, under ZeRO-1/2) are planned in that
        # order: with no padding between them the fill is one copy of their span, not one per tensor
        # (one copy per tensor was launch-bound on the GPU: docs/benchmarks.md, "Weight path").
        if self.layout is None:
            self._order = one_run(named)
        if self._order is not None:
            named = [named[i] for i in self._order]
        signature = [(n, tuple(t.shape), t.dtype) for n, t in named]
        if self.layout is None:
            self.layout, self.total = plan(named)
            self._signature = signature
            if self._order is not None and gapless(self.layout):
                self._run_ptrs = [t.data_ptr() for _, t in named]
        elif signature != self._signature:
            raise RuntimeError("the model's tensors changed between versions; cuda_ipc buffers are planned once")
        with self._lock:
            buf = self._free_buffer(named[0][1].device)
            if buf is None:
                self.skipped.append(version)
                log.warning(
                    "weights: version %d not published: all %d buffers were filled less than %.1f s ago "
                    "or are being sent (weights.hold_s, weights.max_buffers); the next step's is tried",
                    version,
                    len(self.buffers),
                    self.hold_s,
                )
                return None
            buf.version = None  # being written: not to be sent
            t0 = time.perf_counter()
            if self._run_ptrs is not None and [t.data_ptr() for _, t in named] == self._run_ptrs:
                # still where the first fill found them (same pointers, shapes and dtypes): one span
                first = named[0][1].detach()
                n = self.layout[-1].offset // first.element_size() + named[-1][1].numel()
                if buf.run is None:
                    buf.run = buf.data[: n * first.element_size()].view(first.dtype)
                buf.run.copy_(first.as_strided((n,), (1,), first.storage_offset()))
                self.fills_one_copy += 1
            else:
                if buf.views is None:
                    buf.views = views(buf.data, self.layout)
                pack(named, buf.data, self.layout, dsts=buf.views)
            if finish is not None:
                if buf.views is None:
                    buf.views = views(buf.data, self.layout)
                finish({e.name: v for e, v in zip(self.layout, buf.views)})
            if (
                buf.data.is_cuda
            ):  # the copies' own time, apart from the checksum's (what a fill costs: bench/weight_path.py)
                import torch

                torch.cuda.synchronize(buf.data.device)
            t_copied = time.perf_counter()
            sums = checksums(buf.data, self.layout)  # returns after the copies are done (one sync)
            self.fill_s = {"copy": t_copied - t0, "checksum": time.perf_counter() - t_copied}
            buf.version, buf.filled = version, time.monotonic()
        return buf.data, with_checksums(self.layout, sums)


class CudaIpc(Transport):
    kind = "cuda_ipc"
    gpu = needs_cuda = True  # actors must also see rank 0's GPU (local_device)
    shares_device = True
    source_type = CudaIpcBuffer

    def sender(self, settings, device) -> IpcPublisher:
        # the checksum chosen (the fused kernel compiled and checked) at start, not in the first
        # version's pack, where it was most of version 1's pack (docs/benchmarks.md, "Weight path")
        prepare_checksums(device)
        return IpcPublisher(settings.hold_s, settings.max_buffers)

    def announcement(self, source: CudaIpcBuffer, **common) -> WeightVersion:
        return WeightVersion(transport=self.kind, location=f"cuda:{source.device_uuid}", ipc=source, **common)

    def source(self, wv: WeightVersion) -> CudaIpcBuffer | None:
        return wv.ipc

    def receive(self, wv: WeightVersion, state: dict, own: bool = False):
        import torch

        if not torch.cuda.is_available():
            return [], "this engine runs without CUDA; cuda_ipc needs actors on the learner's GPUs"
        try:
            return receive(wv.ipc, torch.device("cuda", torch.cuda.current_device()), state, own=own)
        except (LookupError, RuntimeError) as e:  # the GPU is not visible, the handle did not open, out of memory
            raise WeightUnavailable(f"cannot open the learner's buffer: {e}") from e

    def loaded(self, wv: WeightVersion, state: dict) -> str | None:
        return after_load(state)
