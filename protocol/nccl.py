"""The `nccl` weight transport between the learner's rank 0 and actors on other GPUs or hosts.

Rank 0 runs a TCPStore at `learner.nccl_address`. An actor's vLLM worker joins it once: it takes a
number k from the store and both sides build a two-rank process group of their own (rank 0 =
the learner, rank 1 = this worker) under the store prefix `actor<k>`; no global process group,
so actors join and leave without touching the learner's training group. Per version the worker
asks (`req<n>` = version), rank 0 answers (`ack<n>` = "ok" or why not) and sends the packed buffer
(protocol.cuda_ipc's layout, the same per-tensor checksums) which the worker receives into its
own memory, checks, and only then loads. Every wait has a timeout: a store wait, a send or a
receive that exceeds it drops that actor's group (the actor joins again for its next version).
The backend is NCCL on GPUs and gloo where the learner has none (CPU runs and the tests).

Used by learner.weights_io.NcclSender (rank 0) and engines.engine's WorkerExtension (Receiver).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING

from protocol.cuda_ipc import checksums, mismatch, view
from protocol.messages import NcclSource

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger("parley.nccl")

JOIN_TIMEOUT_S = 60.0  # building a group: both sides connect within this


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"nccl address {address!r} is not host:port; set learner.nccl_address (e.g. 10.0.0.1:29600)")
    return host, int(port)


def store_wait(store, key: str, timeout_s: float) -> bool:
    """Wait for `key` in the store: True when it is there, False after timeout_s."""
    import torch.distributed as dist

    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except (dist.DistStoreError, RuntimeError) as e:  # the store's timeout; anything else propagates
        if "timeout" not in str(e).lower() and not isinstance(e, dist.DistStoreError):
            raise
        return False


def pair_group(store, rank: int, backend: str, timeout_s: float):
    """A two-rank process group (0 = learner, 1 = actor worker) on `store`, outside any global group."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    if backend != "nccl":
        raise ValueError(f"nccl backend {backend!r} not known; use nccl or gloo")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


class Receiver:
    """The actor worker's side: joined lazily on the first version, kept while it works."""

    def __init__(self, name: str):
        self.name = name
        self.address = ""
        self.store = None  # this actor's PrefixStore
        self.group = None
        self.n = 0  # the next request number

    def _join(self, source: NcclSource) -> None:
        import torch.distributed as dist

        host, port = parse_address(source.address)
        root = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        k = root.add("joins", 1)
        root.set(f"join{k}", self.name)
        self.store = dist.PrefixStore(f"actor{k}", root)  # keys "actor<k>/<key>"
        self.group = pair_group(self.store, 1, source.backend, JOIN_TIMEOUT_S)
        self.address, self.n = source.address, 0
        log.info("joined the learner's weight sender at %s as actor %d", source.address, k)

    def fetch(self, source: NcclSource, version: int, device) -> tuple[list[tuple[str, "Tensor"]], str | None]:
        """(name, tensor) views into a received and checked copy of `version`, or ([], reason).
        Raises (and forgets the group, so the next call joins again) when the transfer breaks."""
        import torch

        if self.group is None or self.address != source.address:
            self._join(source)
        n, self.n = self.n, self.n + 1
        try:
            self.store.set(f"req{n}", str(version))
            if not store_wait(self.store, f"ack{n}", source.hold_s):
                raise TimeoutError(f"the learner did not answer the request for version {version} in {source.hold_s:.0f} s")
            ack = self.store.get(f"ack{n}").decode()
            if ack != "ok":
                return [], ack
            staged = torch.empty(source.nbytes, dtype=torch.uint8, device=device)
            self.group.recv([staged], 0, n).wait(timedelta(seconds=source.hold_s))
        except BaseException:
            self.group = None
            raise
        reason = mismatch(source.tensors, checksums(staged, source.tensors))
        if reason:
            return [], reason
        return [(e.name, view(staged, e)) for e in source.tensors], None
