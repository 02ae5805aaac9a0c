"""Several ranks: rank 0 runs the learner service and drives the Trainer through `Driver`; the
other ranks run `follow()` and replay its calls, so every collective is made by every rank. At the
end every rank calls `leave_together()`, and a launched rank ends its process with `leave_process()`."""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch

if TYPE_CHECKING:
    from parley.learner.trainer import Trainer

# Every rank has just replayed "stop" when it reaches the last barrier: one still missing after this is
# gone or stuck (and would otherwise hold the others until DeepSpeed's process-group timeout, 10 minutes).
LEAVE_TIMEOUT_S = 120


class Driver:
    """Rank 0 calls the Trainer through this. With several ranks each call is broadcast first, so
    the ranks running `follow()` make the same (collective) call with the same arguments."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.world = torch.distributed.get_world_size()

    def __call__(self, name: str, *args):
        if torch.cuda.is_available():
            # the current GPU is per thread, and rank 0 calls from asyncio's worker threads
            torch.cuda.set_device(self.trainer.device)
        if self.world > 1:
            torch.distributed.broadcast_object_list([(name, args)], src=0)
        if name == "stop":
            leave_together()
            return None
        return getattr(self.trainer, name)(*args)


def follow(trainer: Trainer) -> None:
    """The loop of ranks > 0: replay rank 0's calls until it says stop."""
    while True:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == "stop":
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
