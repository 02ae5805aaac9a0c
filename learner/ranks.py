"""Several ranks: rank 0 runs the learner service and drives the Trainer through `Driver`; the
other ranks run `follow()` and replay its calls, so every collective is made by every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from learner.trainer import Trainer


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
    """Every rank's last call: wait for the others, then close the process group. A rank that exits
    with gloo's threads still running was seen to abort in teardown ("terminate called without an
    active exception", SIGABRT), which torch.distributed.run reports as a failed run."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
