"""The files a --resume reads beside the ledger (the run's environment.json, learner/base_model) are
durable when a fresh start returns: before, they were written without fsync, and after a power cut
(tests/faults/test_kill_power.py) each --resume stopped on an empty environment.json."""

from __future__ import annotations

import os
from pathlib import Path

from parley.learner import checkpoint as ckpt
from parley.learner import resume


def test_a_fresh_start_makes_its_records_durable(tmp_path, monkeypatch):
    synced: list[Path] = []
    real = os.fsync

    def spy(fd):
        real(fd)
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")))

    monkeypatch.setattr(os, "fsync", spy)
    run_dir, model = tmp_path / "run", tmp_path / "model"
    model.mkdir()
    resume.fresh(run_dir, model, {"name": "x"})
    # what each file holds was fsynced (under a temporary name, renamed over it), and the rename's directory
    assert (run_dir / ".environment.json.tmp") in synced and run_dir in synced
    assert (ckpt.learner_dir(run_dir) / ".base_model.tmp") in synced and ckpt.learner_dir(run_dir) in synced
    assert ckpt.base_model(run_dir) == model.resolve()
    assert (run_dir / "environment.json").read_text().strip() == '{\n "name": "x"\n}'
