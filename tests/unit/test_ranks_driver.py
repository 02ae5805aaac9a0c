"""learner.ranks.Driver: rank 0's typed calls on the Trainer, each broadcast as the Trainer method's
name and arguments, which follow() replays on the other ranks. Test doubles for the process group
(broadcast_object_list recorded) and the trainer; no torch.distributed group is started."""

from __future__ import annotations

import inspect

import pytest
import torch

from parley.learner import ranks
from parley.learner.trainer import Trainer

CALLS = {
    "train_step": ([],),
    "warm_up": (),
    "save_checkpoint": ("/ckpt", "step000001"),
    "load_checkpoint": ("/ckpt", "step000001"),
    "weights_snapshot": (),
    "adapter_snapshot": (),
    "pack_adapter": (3,),
    "pack_weights": (3,),
    "pack_versions": (3, 0.5),
    "weights_writable_in": (),
}


class TrainerDouble:
    device = "cpu"

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return name

        return call


@pytest.fixture
def wire(monkeypatch):
    sent = []
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda box, src: sent.append(box[0]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return sent


def test_every_typed_call_runs_here_and_is_replayed_by_the_other_ranks(wire, monkeypatch):
    public = {n for n, _ in inspect.getmembers(ranks.Driver, inspect.isfunction) if not n.startswith("_")}
    assert public == {*CALLS, "stop"}, "a Driver call without a case here"
    trainer = TrainerDouble()
    driver = ranks.Driver(trainer)
    for name, args in CALLS.items():
        assert getattr(driver, name)(*args) == name
        assert hasattr(Trainer, name)
    assert wire == list(CALLS.items()) and trainer.calls == list(CALLS.items())

    # another rank: follow() replays what rank 0 sent, in order, until stop
    left = []
    monkeypatch.setattr(ranks, "leave_together", lambda: left.append(True))
    driver.stop()
    assert wire[-1] == (ranks.STOP, ()) and left == [True]
    replayed, queue = TrainerDouble(), list(wire)

    def receive(box, src):
        box[0] = queue.pop(0)

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", receive)
    ranks.follow(replayed)
    assert replayed.calls == list(CALLS.items()) and queue == [] and left == [True, True]
