"""learner.trainer.skip_cpu_shm_build: on CPU the learner starts DeepSpeed's process group without
JIT-building the shared-memory comm op, so a learner killed mid-build cannot leave a lock file that
blocks every later learner (seen twice on the shared 2-core machine: ~/.cache/torch_extensions/
py311_cpu/deepspeed_shm_comm/lock)."""

from __future__ import annotations

import pytest
import torch

from parley.learner.trainer import skip_cpu_shm_build


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU accelerator's op")
def test_the_shm_op_is_never_built_on_cpu(monkeypatch):
    import importlib

    from deepspeed.accelerator import get_accelerator

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # the attribute deepspeed.comm.torch is torch itself

    builder_type = type(get_accelerator().create_op_builder("ShareMemCommBuilder"))
    loads = []
    monkeypatch.setattr(builder_type, "load", lambda self, *a, **k: loads.append(self.NAME))
    assert skip_cpu_shm_build()
    assert ds_torch.build_shm_op() is None  # what DeepSpeed's TorchBackend calls when the group starts
    assert loads == []  # no compile, so no build lock
