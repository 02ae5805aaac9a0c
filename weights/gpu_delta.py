"""Delta versions built and applied where the weights already are (the learner's and the actor's
GPUs), without a compressor and without a pass over the model on the host: the changed 16-bit words
between two packed buffers of one layout (weights.cuda_ipc.plan: every tensor at a 256-byte
boundary, bf16 words), and the target rebuilt in place from its base.

Format (`b"PARLEYG1"` | u64 header length | header JSON | counts | offsets | diffs | exceptions):
the buffer's words are cut into blocks of BLOCK = 255 words; per block the number of changed words
(uint8, at most 255 by construction); per changed word, in order, its offset in its block (uint8)
and the difference new - old of the two words as 16-bit integers, wrapped, when it lies in
-127..127 (int8), else -128 and its new bits in `exceptions` (int16, in the same order). With Adam at
the learning rates our users train with, a bf16 weight that changes moves by one or two steps of its
last bit, so nearly every difference fits: about 2 bytes a changed word plus one byte per 255 words,
close to zlib level 1 over gaps and values (weights.delta) and built with a `nonzero`, a `bincount`
and a gather, applied with a `repeat_interleave` and a scatter (bench/gpu_delta.py measures both).

The result is checked against the target's per-tensor checksums (weights.cuda_ipc.checksums, the
digest the cuda_ipc transport already announces): on a mismatch or a malformed delta the words
written are put back, so the buffer still holds its base, and WeightVerifyError says why.

torch is imported inside the functions: the module imports without it.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from parley.protocol.messages import IpcTensor
from parley.weights.common import WeightVerifyError

if TYPE_CHECKING:
    from torch import Tensor

MAGIC = b"PARLEYG1"
BLOCK = 255  # words a count covers: a count never exceeds what a uint8 holds
SENTINEL = -128  # a diff of this value: the new word is the next one in `exceptions`


class GpuDeltaHeader(msgspec.Struct, kw_only=True):
    base: str  # weights.cuda_ipc.table_digest of the buffer this delta applies to
    target: str  # table_digest of the buffer it rebuilds
    words: int  # 16-bit words in either buffer
    changed: int
    exceptions: int


def _words(buffer: Tensor) -> Tensor:
    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() % 2:
        raise ValueError(
            f"a packed buffer is a 1-D uint8 tensor of whole 16-bit words, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    return buffer.view(torch.int16)


def encode(base: Tensor, target: Tensor, base_name: str, target_name: str, max_share: float = 1.0) -> bytes | None:
    """The delta turning packed buffer `base` into `target` (same size, same device), named by their
    table_digest (weights.cuda_ipc); None when it would be larger than `max_share` of the target's bytes (send the full
    version then). Built CHUNK_BLOCKS blocks at a time (_chunk_words), each chunk's sections copied to
    the host as it is done: the bytes do not depend on the chunk size."""
    import torch

    x, y = _words(base), _words(target)
    if x.shape != y.shape:
        raise ValueError(f"base has {x.numel()} words, target {y.numel()}: not one layout")
    n = x.numel()
    n_blocks = -(-n // BLOCK)
    limit = max_share * 2 * n
    changed = n_exc = 0
    sections: list[list] = [[], [], [], []]  # counts, offsets, diffs, exceptions: host arrays in order
    for w0, w1 in _chunk_words(n):
        xs, ys = x[w0:w1], y[w0:w1]
        pos = torch.nonzero(xs != ys).flatten()  # int64, ascending, within the chunk
        changed += pos.numel()
        # what the format takes, before building it: counts + offsets + diffs (+ exceptions, bounded below)
        if n_blocks + 2 * changed > limit:
            return None
        blk = torch.div(pos, BLOCK, rounding_mode="floor")
        counts = torch.bincount(blk, minlength=-(-(w1 - w0) // BLOCK)).to(torch.uint8)
        offsets = (pos - blk * BLOCK).to(torch.uint8)
        del blk
        new = ys[pos]
        d = (new.to(torch.int32) - xs[pos].to(torch.int32) + 32768).remainder(65536) - 32768  # wrapped to int16
        del pos
        exc = (d < -127) | (d > 127)
        diffs = torch.where(exc, torch.full_like(d, SENTINEL), d).to(torch.int8)
        exceptions = new[exc]
        n_exc += exceptions.numel()
        if n_blocks + 2 * changed + 2 * n_exc > limit:
            return None
        for out, t in zip(sections, (counts, offsets, diffs, exceptions)):
            out.append(t.cpu().numpy().tobytes())
    header = msgspec.json.encode(
        GpuDeltaHeader(base=base_name, target=target_name, words=n, changed=changed, exceptions=n_exc)
    )
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *(b"".join(part) for part in sections)])


# Blocks encoded and applied at a time: the temporaries (int64 positions of the changed words, their
# int32 differences) are bounded by a chunk's 67M words (about 1.5 GB at most) instead of growing with
# the delta: a delta of the 4B shape at lr 1e-5 ran the actor's GPU out of memory when applied in
# one piece beside a learner (docs/benchmarks.md, "Weight path").
CHUNK_BLOCKS = 1 << 18


def _chunk_words(n: int) -> list[tuple[int, int]]:
    """(first word, end word) of each chunk of n words, each a whole number of blocks but the last."""
    step = CHUNK_BLOCKS * BLOCK
    return [(w, min(n, w + step)) for w in range(0, n, step)]


def read_header(blob: bytes | memoryview) -> tuple[GpuDeltaHeader, int]:
    """The header of a delta and the byte offset its sections start at; WeightVerifyError when it
    is not one or its sections do not add up to its length."""
    try:
        if bytes(blob[:8]) != MAGIC:
            raise WeightVerifyError("not a parley GPU delta (bad magic)")
        (hn,) = struct.unpack("<Q", bytes(blob[8:16]))
        header = msgspec.json.decode(bytes(blob[16 : 16 + hn]), type=GpuDeltaHeader)
    except (struct.error, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WeightVerifyError(f"a malformed GPU delta: {type(e).__name__}: {e}") from None
    start = 16 + hn
    want = -(-header.words // BLOCK) + 2 * header.changed + 2 * header.exceptions
    if len(blob) - start != want:
        raise WeightVerifyError(
            f"a GPU delta of {header.words} words, {header.changed} changed, "
            f"{header.exceptions} exceptions has {len(blob) - start} bytes of sections, "
            f"not {want}"
        )
    return header, start


def apply(buffer: Tensor, blob: bytes | memoryview, base_name: str, layout: list[IpcTensor]):
    """Rebuild in `buffer` (holding the version named `base_name`) the version whose layout with
    checksums is `layout`, from `blob` (encode's bytes). Checks the result's checksums against
    `layout` (weights.cuda_ipc.checksums); raises WeightVerifyError with `buffer` holding its base
    again when the delta is for another base or another target, malformed, or the result does not
    match. Returns a callable that puts the base back (a later load from the buffer failed)."""
    import numpy as np
    import torch

    from parley.weights.cuda_ipc import checksums, mismatch, table_digest

    header, start = read_header(blob)
    target_name = table_digest(layout)
    if header.base != base_name or header.target != target_name:
        raise WeightVerifyError(
            f"the delta turns {header.base[:16]}.. into {header.target[:16]}..; this buffer "
            f"holds {base_name[:16]}.. and the version is {target_name[:16]}.."
        )
    x = _words(buffer)
    if header.words != x.numel():
        raise WeightVerifyError(f"the delta is for {header.words} words, the buffer has {x.numel()}")
    n_blocks = -(-header.words // BLOCK)
    dev = buffer.device
    mv = memoryview(blob)[start:]

    def section(nbytes: int, dtype) -> Tensor:
        nonlocal mv
        part, mv = mv[:nbytes], mv[nbytes:]
        return torch.from_numpy(np.frombuffer(part, dtype=dtype).copy()).to(dev)

    counts = section(n_blocks, np.uint8)
    offsets = section(header.changed, np.uint8)
    diffs = section(header.changed, np.int8)
    exceptions = section(2 * header.exceptions, np.int16)
    sentinel = diffs == SENTINEL
    total = int(counts.sum(dtype=torch.int64))
    if total != header.changed or int(sentinel.sum()) != header.exceptions:
        raise WeightVerifyError(
            f"a malformed GPU delta: its counts add up to {total} and it has "
            f"{int(sentinel.sum())} exceptions, the header says {header.changed} and "
            f"{header.exceptions}"
        )
    if header.changed:  # every offset inside its block, the last block's inside the buffer
        last = int(counts[-1])
        tail = header.words - (n_blocks - 1) * BLOCK
        if int(offsets.max()) >= BLOCK or (last and int(offsets[header.changed - last :].max()) >= tail):
            raise WeightVerifyError("a malformed GPU delta: a changed word lies outside its block or the buffer")
    # chunk by chunk (CHUNK_BLOCKS blocks): (first block, end block, first changed word, end changed word)
    edges = list(range(0, n_blocks, CHUNK_BLOCKS)) + [n_blocks]
    ends = torch.cumsum(counts.to(torch.int64), 0)[torch.tensor(edges[1:], device=dev) - 1].tolist()
    chunks = list(zip(edges[:-1], edges[1:], [0] + ends[:-1], ends))

    def positions(b0: int, b1: int, c0: int, c1: int) -> Tensor:
        starts = torch.repeat_interleave(
            torch.arange(b0, b1, device=dev, dtype=torch.int64) * BLOCK,
            counts[b0:b1].to(torch.int64),
            output_size=c1 - c0,
        )
        return starts + offsets[c0:c1].to(torch.int64)

    olds: list = []  # per chunk, the words it overwrote: what goes back on a mismatch or an undo

    def put_back() -> None:
        for chunk, old in zip(chunks, olds):
            if old is not None:
                x[positions(*chunk)] = old

    try:
        e0 = 0
        for b0, b1, c0, c1 in chunks:
            if c1 == c0:
                olds.append(None)
                continue
            pos = positions(b0, b1, c0, c1)
            old = x[pos]  # a copy
            olds.append(old)
            new = ((old.to(torch.int32) + diffs[c0:c1].to(torch.int32) + 32768).remainder(65536) - 32768).to(
                torch.int16
            )
            s = sentinel[c0:c1]
            k = int(s.sum())
            new[s] = exceptions[e0 : e0 + k]
            e0 += k
            x[pos] = new
            del pos, new
        bad = mismatch(layout, checksums(buffer, layout))
    except BaseException:  # out of memory midway or in the check, say: the buffer must not stay half-patched
        put_back()
        raise
    if bad:
        put_back()
        raise WeightVerifyError(
            f"base + GPU delta does not give the announced version: {bad}; the buffer holds its base again"
        )
    return put_back


class PackedVersions:
    """The learner's side ([weights] delta_format = "packed"): each version packed into one of two
    buffers of the cuda_ipc layout on the device its tensors are on (2 x the model's bytes there) and
    checksummed, on the training thread (a copy and one fused pass: 0.02 s at the 4B shape). The
    rest is the publication's, beside the next step (PendingVersion): the delta against the version
    packed before, and one device-to-host copy of the version for its full file. The next pack
    overwrites a buffer those read, so it waits until both are done (an encode takes 0.3-0.4 s at
    the 4B shape, the copy about a second; a step takes seconds)."""

    def __init__(self) -> None:
        self.layout: list[IpcTensor] | None = None
        self.buffers: list = []
        self.tables: list[list[IpcTensor] | None] = [None, None]
        self.last = -1  # index of the buffer holding the version packed last
        self.version: int | None = None  # ... and its number
        self.pending: PendingVersion | None = None  # the version whose publication may still read a buffer

    def pack(self, named, version: int, max_share: float | None, finish=None) -> tuple[list[IpcTensor], PendingVersion]:
        """Pack `named` ((checkpoint name, tensor), the same names every version) as `version`;
        returns its table with checksums and what its publication reads from the buffers (a delta
        against the version packed before unless this is the first one or `max_share` is None).
        `finish`: called with the buffer's views by name after the copy, before the checksums
        (weights.cuda_ipc.IpcPublisher.fill's)."""
        import torch

        from parley.weights.cuda_ipc import checksums, pack, plan, views, with_checksums

        named = list(named)
        if self.layout is None:
            self.layout, size = plan(named)
            self.buffers = [torch.zeros(size, dtype=torch.uint8, device=named[0][1].device) for _ in range(2)]
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.done.wait()
        waited = time.perf_counter() - t0
        cur = 1 - self.last if self.last >= 0 else 0
        pack(named, self.buffers[cur], self.layout)
        if finish is not None:
            finish({e.name: v for e, v in zip(self.layout, views(self.buffers[cur], self.layout))})
        table = with_checksums(self.layout, checksums(self.buffers[cur], self.layout))
        self.tables[cur] = table
        base = (
            (self.buffers[self.last], self.tables[self.last], self.version)
            if (self.last >= 0 and max_share is not None)
            else None
        )
        self.pending = PendingVersion(self.buffers[cur], table, base, max_share)
        self.pending.pack_waited_s = waited
        self.last, self.version = cur, version
        return table, self.pending


class PendingVersion:
    """What a packed version's publication reads from the learner's buffers: its delta (`encode`,
    when it has a base) and one host copy of it for its full file (`host_state`). Each releases its
    hold when done; `discard` releases what is left (a superseded version, a failed publication).
    `done` is set once nothing reads the buffers any more; every method is safe from any thread."""

    def __init__(self, target, table: list[IpcTensor], base, max_share: float | None) -> None:
        self._target, self._table, self._base, self.max_share = target, table, base, max_share
        self.base_version = base[2] if base is not None else None
        self.pack_waited_s = 0.0  # how long its pack waited for the version before it (PackedVersions.pack)
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._holds = {"delta": base is not None, "host": True}  # still to be read
        self._busy = 0  # reads under way
        self._check_done()

    def _take(self, what: str) -> bool:
        with self._lock:
            if not self._holds[what]:
                return False
            self._holds[what] = False
            self._busy += 1
            return True

    def _put(self) -> None:
        with self._lock:
            self._busy -= 1
        self._check_done()

    def _check_done(self) -> None:
        with self._lock:
            finished = self._busy == 0 and not any(self._holds.values())
            if finished:
                self._target = self._base = None
        if finished:
            self.done.set()

    def encode(self) -> tuple[bytes | None, int | None, str | None]:
        """(the delta or None: no base, over max_share, or discarded; the base's version; the base's
        table digest): what weights.registry.publish_version takes after the table as `packed`."""
        import torch

        from parley.weights.cuda_ipc import table_digest

        if not self._take("delta"):
            return None, None, None
        try:
            (base, base_table, _), target = self._base, self._target
            on = torch.cuda.device(base.device) if base.is_cuda else contextlib.nullcontext()
            with on:  # a worker thread's current GPU is not the learner's
                name = table_digest(base_table)
                blob = encode(base, target, name, table_digest(self._table), self.max_share)
                if base.is_cuda:
                    torch.cuda.synchronize(base.device)
            return (blob, self.base_version, name) if blob is not None else (None, None, None)
        finally:
            self._put()

    def host_state(self) -> dict:
        """The version's tensors on the host under their checkpoint names, for its full file: one
        device-to-host copy of the whole buffer (its hold is released right after), then a tensor of
        its own for each (a file's tensors may not share storage)."""
        from parley.weights.cuda_ipc import views

        if not self._take("host"):
            raise RuntimeError("this packed version was discarded; its buffer may hold another version now")
        try:
            host = self._target.to("cpu")
        finally:
            self._put()
        return {e.name: t.clone() for e, t in zip(self._table, views(host, self._table))}

    def discard(self) -> None:
        """Release every hold not taken yet (a no-op for reads under way: they release their own)."""
        with self._lock:
            self._holds = {k: False for k in self._holds}
        self._check_done()


class Mirror:
    """The actor's side: a copy of the weights it serves in the learner's packed layout (the model's
    bytes on its device), which packed deltas are applied to and the engine loads from."""

    def __init__(self) -> None:
        self.buffer = None
        self.table: list[IpcTensor] | None = None
        self.name: str | None = None  # table_digest of what it holds, None: nothing
        self._undo = None

    def fill(self, tensors: dict, table: list[IpcTensor], device) -> None:
        """Hold the version whose packed table (with checksums) is `table`, from its tensors by
        checkpoint name; WeightVerifyError (and nothing held) when they do not give its checksums."""
        import torch

        from parley.weights.cuda_ipc import _nbytes, _padded, checksums, mismatch, pack, table_digest

        size = max(e.offset + _padded(_nbytes(e)) for e in table)
        if self.buffer is None or self.buffer.numel() != size or self.buffer.device != torch.device(device):
            self.buffer = None
            self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.name = self.table = None
        missing = [e.name for e in table if e.name not in tensors]
        if missing:
            raise WeightVerifyError(f"the weights lack {len(missing)} packed tensors (first: {missing[0]})")
        try:  # the learner's own packing: every shape and dtype checked, then one multi-tensor copy
            pack([(e.name, tensors[e.name]) for e in table], self.buffer, table)
        except ValueError as e:
            raise WeightVerifyError(f"the served weights do not fit the announced packed table: {e}") from None
        bad = mismatch(table, checksums(self.buffer, table))
        if bad:
            raise WeightVerifyError(f"the served weights are not the announced packed version: {bad}")
        self.table, self.name, self._undo = table, table_digest(table), None

    def apply(self, blob: bytes | memoryview, table: list[IpcTensor]) -> None:
        """Turn the held version into the one of `table` with a packed delta (apply); `revert` puts
        the held one back until `settle`."""
        from parley.weights.cuda_ipc import table_digest

        if self.name is None:
            raise WeightVerifyError("no packed copy of the served weights is held here")
        self._undo = (apply(self.buffer, blob, self.name, table), self.table, self.name)
        self.table, self.name = table, table_digest(table)

    def revert(self) -> None:
        if self._undo is not None:
            undo, self.table, self.name = self._undo
            undo()
            self._undo = None

    def settle(self) -> None:
        self._undo = None

    def named(self) -> list:
        """(checkpoint name, view into the buffer) of every tensor held, for load_weights."""
        from parley.weights.cuda_ipc import views

        return list(zip([e.name for e in self.table], views(self.buffer, self.table)))

    def drop(self) -> None:
        self.buffer = self.table = self.name = self._undo = None
