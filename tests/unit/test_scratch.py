"""runtime.scratch: a scratch directory names its host and process, and making one removes those of
its kind that a process no longer alive on this host left (an actor killed mid-run left a copy of the
served weights in the temp directory each time)."""

from __future__ import annotations

import os
import subprocess
import sys

from parley.runtime import scratch


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_new_scratch_dir_removes_only_what_dead_processes_of_this_host_left(tmp_path):
    host = scratch._host()
    gone = tmp_path / f"parley-weights-{host}-{dead_pid()}-actor-0-abc"
    live = tmp_path / f"parley-weights-{host}-{os.getppid()}-actor-1-def"  # our parent: alive
    mine = tmp_path / f"parley-weights-{host}-{os.getpid()}-actor-2-ghi"
    elsewhere = tmp_path / f"parley-weights-otherhost-{dead_pid()}-actor-3-jkl"  # another machine's
    other_kind = tmp_path / f"parley-selfcheck-{host}-{dead_pid()}-mno"
    for d in (gone, live, mine, elsewhere, other_kind):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "model.safetensors").write_bytes(b"x" * 100)
    new = scratch.scratch_dir("weights", "actor-4", base=tmp_path)
    assert new.is_dir() and new.name.startswith(f"parley-weights-{host}-{os.getpid()}-actor-4-")
    assert not gone.exists()
    assert live.exists() and mine.exists() and elsewhere.exists() and other_kind.exists()


def test_a_dead_process_is_told_from_a_live_one():
    assert scratch.alive(os.getpid()) and not scratch.alive(dead_pid())


def test_a_model_build_removes_what_a_killed_build_left(tmp_path, monkeypatch):
    """engines.models.ensure_model builds in a staging dir beside the cache entry; one a killed build
    left (a model's size) is removed by the next build, which holds the build lock."""
    from parley.engines import models

    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    left = tmp_path / "models" / ".tiny-build-abc123"
    (left / "half").mkdir(parents=True)

    def builder_double(out):  # a test double for build_tiny
        (out / "config.json").write_text("{}")

    monkeypatch.setitem(models._BUILDERS, "tiny", builder_double)
    assert models.ensure_model("tiny") == tmp_path / "models" / "tiny"
    assert not left.exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".tiny-build")] == []
