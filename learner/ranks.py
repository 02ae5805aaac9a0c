"""Several ranks: rank 0 runs the learner service and drives the Trainer through `Driver`; the
other ranks run `follow()` and replay its calls, so every collective is made by every rank. At the
end every rank calls `leave_together()`, and a launched rank ends its process with `leave_process()`."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import torch

from parley.learner.trainer import Trainer

if TYPE_CHECKING:
    from parley.learner.packing import Sample
    from parley.weights.snapshot import WeightSnapshot

# Every rank has just replayed "stop" when it reaches the last barrier: one still missing after this is
# gone or stuck (and would otherwise hold the others until DeepSpeed's process-group timeout, 10 minutes).
LEAVE_TIMEOUT_S = 120
STOP = "stop"  # what Driver.stop broadcasts: no Trainer method has this name
R = TypeVar("R")


class Driver:
    """Rank 0 calls the Trainer through this, one typed method per Trainer call. With several ranks
    each call is broadcast first (the Trainer method's name and its arguments), so the ranks running
    `follow()` make the same (collective) call with the same arguments. The weight path reaches the
    trainer only through its weights.publish.WeightSource methods."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.world = torch.distributed.get_world_size()

    def _run(self, method: Callable[..., R], *args) -> R:
        """`method` (a Trainer method) on this rank's trainer, after every other rank was told to make it."""
        self._tell(method.__name__, args)
        return getattr(self.trainer, method.__name__)(*args)  # as follow() replays it

    def _tell(self, name: str, args: tuple) -> None:
        if torch.cuda.is_available():
            # the current GPU is per thread, and rank 0 calls from asyncio's worker threads
            torch.cuda.set_device(self.trainer.device)
        if self.world > 1:
            torch.distributed.broadcast_object_list([(name, args)], src=0)

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        return self._run(Trainer.train_step, samples)

    def warm_up(self) -> float:
        return self._run(Trainer.warm_up)

    def save_checkpoint(self, ckpt_dir: str | Path, tag: str) -> None:
        return self._run(Trainer.save_checkpoint, ckpt_dir, tag)

    def load_checkpoint(self, ckpt_dir: str | Path, tag: str) -> None:
        return self._run(Trainer.load_checkpoint, ckpt_dir, tag)

    def weights_snapshot(self) -> WeightSnapshot | None:
        return self._run(Trainer.weights_snapshot)

    def adapter_snapshot(self) -> tuple[dict, dict] | None:
        return self._run(Trainer.adapter_snapshot)

    def pack_adapter(self, version: int):
        return self._run(Trainer.pack_adapter, version)

    def pack_weights(self, version: int):
        return self._run(Trainer.pack_weights, version)

    def pack_versions(self, version: int, max_share: float | None):
        return self._run(Trainer.pack_versions, version, max_share)

    def weights_writable_in(self) -> float:
        return self._run(Trainer.weights_writable_in)

    def stop(self) -> None:
        """The last call: every rank leaves together (the ranks in `follow()` return)."""
        self._tell(STOP, ())
        leave_together()


def follow(trainer: Trainer) -> None:
    """The loop of ranks > 0: replay rank 0's calls until it says stop."""
    while True:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == STOP:
            leave_together()
            return
        getattr(trainer, name)(*args)


def leave_together() -> None:
    """Every rank's last collective: wait for the others (at most LEAVE_TIMEOUT_S), then close the
    process group, so no rank leaves while another still needs it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            try:
                torch.distributed.barrier(async_op=True).wait(timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
            except RuntimeError as e:
                raise RuntimeError(
                    f"rank {torch.distributed.get_rank()}: the other ranks did not reach the "
                    f"learner's last barrier within {LEAVE_TIMEOUT_S} s ({e}); one of them "
                    "crashed or hangs, its own log says why"
                ) from e
        torch.distributed.destroy_process_group()


def leave_process(code: int) -> NoReturn:
    """A launched rank's exit, after `leave_together`: flush and end the process at once, skipping the
    interpreter's teardown. gloo's worker threads outlive destroy_process_group (DeepSpeed's engine,
    optimizer and ZeRO-3 parameters keep the groups alive), and a worker that lets go of a finished
    collective whose tensor Python had dropped takes the GIL to free it. If the interpreter is
    finalizing by then, CPython ends that thread with pthread_exit inside the C++ destructor, and the
    process aborts with all its work done: "terminate called without an active exception", SIGABRT."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
