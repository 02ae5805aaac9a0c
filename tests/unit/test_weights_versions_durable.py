"""The learner's kept weight versions (learner/weights/vNNNNNN: what a version is published from and
`parley export` lists) survive a power cut (issue 57): before, they were written without fsync, so a
power loss could leave a version listed by export whose model.safetensors is empty. The power cut is
simulated as in tests/faults/test_kill_power.py: every fsync and rename is journaled
(tests.faults.lives.journal_durability), then each file is cut to what its last fsync made durable."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from parley.learner import checkpoint as ckpt
from parley.weights import lora
from parley.weights.snapshot import WeightSnapshot
from tests.faults.lives import journal_durability
from tests.faults.test_kill_power import cut_to_durable


@pytest.fixture
def journal(tmp_path, monkeypatch):
    for name in ("fsync", "replace", "rename"):  # journal_durability replaces them; the test puts them back
        monkeypatch.setattr(os, name, getattr(os, name))
    path = tmp_path / "journal.jsonl"
    journal_durability(str(path))
    return path


def test_kept_versions_are_whole_after_a_power_cut(tmp_path, journal):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    run_dir = tmp_path / "run"
    ckpt.record_base_model(run_dir, base)
    weights = {"model.embed_tokens.weight": torch.arange(12.0).reshape(3, 4)}
    WeightSnapshot(dict(weights), json.dumps({"model_type": "llama"})).write(ckpt.weights_dir(run_dir, 1))
    adapter = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4)}
    lora.write_adapter(dict(adapter), {"r": 2, "peft_type": "LORA"}, ckpt.weights_dir(run_dir, 2))

    cut = cut_to_durable(run_dir, journal)
    assert cut["cut"] == 0, f"the power cut took {cut['bytes']} bytes of {cut['cut']} file(s)"
    assert ckpt.available_versions(run_dir) == [0, 1, 2]
    out = ckpt.export_version(run_dir, 1, tmp_path / "v1")
    assert torch.equal(
        load_file(out / "model.safetensors")["model.embed_tokens.weight"], weights["model.embed_tokens.weight"]
    )
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    out = ckpt.export_version(run_dir, 2, tmp_path / "v2")
    assert torch.equal(load_file(out / lora.ADAPTER_FILE)[next(iter(adapter))], torch.ones(2, 4))
    assert json.loads((out / lora.ADAPTER_CONFIG).read_text())["r"] == 2


def test_a_version_directory_entry_is_made_durable(tmp_path, monkeypatch):
    """Not simulated by the cut above: the directory entries (the renames, the version directory) are
    fsynced too."""
    synced = []
    real = os.fsync

    def spy(fd):
        real(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))

    monkeypatch.setattr(os, "fsync", spy)
    out = ckpt.weights_dir(tmp_path / "run", 3)
    WeightSnapshot({"w": torch.zeros(2)}, "{}").write(out)
    assert str(out) in synced and str(out.parent) in synced
