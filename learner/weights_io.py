"""The trained model's weights under their checkpoint (HF) names, as actors and vLLM load them:
gathered to CPU without tied duplicates (a WeightSnapshot, taken right after a step), written as
one model.safetensors + config.json; or, for transport cuda_ipc, packed into a shared GPU buffer
on rank 0 (IpcPublisher)."""

from __future__ import annotations

import logging
import os
import threading
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
        with self._lock:
            buf = self._free_buffer(named[0][1].device)
            buf.version = None  # being written: not to be sent
            cuda_ipc.pack(named, buf.data, self.layout)
            sums = cuda_ipc.checksums(buf.data, self.layout)  # returns after the copies are done (one sync)
            now = time.monotonic()
            for b in self.buffers:
                if b.version is not None and b.superseded_at is None and b is not buf:
                    b.superseded_at = now
            buf.version, buf.superseded_at = version, None
        return buf.data, cuda_ipc.with_checksums(self.layout, sums)


class NcclSender:
    """Rank 0's side of transport nccl (protocol.nccl): a TCPStore at `address`, a thread that
    accepts actors as they join, and one thread per actor that answers its requests from the
    publisher's held buffers over that actor's own two-rank group. The training loop only fills
    buffers (pack); sends happen beside it and never wait on it. An actor whose send fails or
    times out is dropped (it joins again for its next version); one silent for `idle_s` too.
    The threads block in store waits (no polling); close() wakes each with a stop marker."""

    def __init__(self, publisher: IpcPublisher, address: str, backend: str, timeout_s: float, idle_s: float = 3600.0):
        import torch.distributed as dist

        from protocol.nccl import parse_address

        host, port = parse_address(address)
        self.pub, self.address, self.backend = publisher, address, backend
        self.timeout_s, self.idle_s = timeout_s, idle_s
        self.device = torch.cuda.current_device() if backend == "nccl" else None
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta_s(timeout_s))
        # A blocked wait holds its store connection: each thread waits on a connection of its own.
        self._connect = lambda: dist.TCPStore(host, port, is_master=False, timeout=timedelta_s(timeout_s))
        self.actors: dict[int, str] = {}  # joined actor number -> its name, while served
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_join = 1  # the join key the accept thread waits for
        self._next_req: dict[int, int] = {}  # actor number -> the request key its thread waits for
        self._threads = [threading.Thread(target=self._accept, name="nccl-accept", daemon=True)]
        self._threads[0].start()

    def pack(self, named: list[tuple[str, Tensor]], version: int):
        """Fill a held buffer with `version`: the protocol.messages.NcclSource to announce."""
        from protocol.messages import NcclSource

        _, tensors = self.pub.fill(named, version)
        return NcclSource(address=self.address, backend=self.backend, nbytes=self.pub.total, hold_s=self.pub.hold_s,
                          tensors=tensors)

    def close(self) -> None:
        """Stop accepting and serving: every waiting thread is woken by its stop marker and joined."""
        self._stop.set()
        with self._lock:
            self.store.set(f"join{self._next_join}", "")
            for k, n in self._next_req.items():
                self.store.set(f"actor{k}/req{n}", "stop")
        for t in self._threads:
            t.join(timeout=self.timeout_s)

    def _accept(self) -> None:
        store = self._connect()
        k = 1
        while True:
            store.wait([f"join{k}"], timedelta_s(1e6))  # close() sets a stop marker
            name = store.get(f"join{k}").decode()
            with self._lock:
                if self._stop.is_set():
                    return
                self._next_join = k + 1
                t = threading.Thread(target=self._serve, args=(k, name), name=f"nccl-actor{k}", daemon=True)
                self._threads.append(t)
            t.start()
            k += 1

    def _serve(self, k: int, name: str) -> None:
        import torch.distributed as dist

        from protocol.nccl import JOIN_TIMEOUT_S, pair_group, store_wait

        if self.device is not None:
            torch.cuda.set_device(self.device)  # per thread
        store = dist.PrefixStore(f"actor{k}", self._connect())  # keys "actor<k>/<key>"
        try:
            group = pair_group(store, 0, self.backend, JOIN_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - that actor never completed its join; the others go on
            log.warning("weights: actor %d (%s) did not complete its join: %s", k, name, e)
            return
        self.actors[k] = name
        log.info("weights: actor %d (%s) joined the nccl sender", k, name)
        n = 0
        try:
            while True:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._next_req[k] = n
                # Blocks until the actor asks (or close() marks stop); an actor silent for idle_s
                # is dropped and joins again when it next asks.
                if not store_wait(store, f"req{n}", self.idle_s):
                    raise TimeoutError(f"no request for {self.idle_s:.0f} s")
                req = store.get(f"req{n}").decode()
                if req == "stop":
                    return
                version = int(req)
                buf = self.pub.take(version)
                if buf is None:
                    store.set(f"ack{n}", f"version {version} is no longer held (superseded over "
                                         f"{self.pub.hold_s:.0f} s ago or overwritten); the next one will be")
                else:
                    try:
                        store.set(f"ack{n}", "ok")
                        group.send([buf.data], 1, n).wait(timedelta_s(self.timeout_s))
                    finally:
                        self.pub.release(buf)
                n += 1
        except Exception as e:  # noqa: BLE001 - that actor is dropped; it joins again for its next version
            log.warning("weights: actor %d (%s) dropped from the nccl sender: %s", k, name, e)
        finally:
            self.actors.pop(k, None)
            with self._lock:
                self._next_req.pop(k, None)


def timedelta_s(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


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
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(config_json)
    return out
