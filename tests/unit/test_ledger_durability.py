"""The ledger's rename is durable before anything relies on it: write_state fsyncs the learner
directory after replacing state.msgpack, and only then may an old sample log be unlinked. Without
the directory fsync a power cut after the unlink could bring back the old state.msgpack, naming a
sample log that no longer exists: the resume would stop with a LedgerError and the buffered samples
would be gone."""

from __future__ import annotations

import os
import stat

from parley.learner import checkpoint as ckpt


def test_state_rename_is_followed_by_an_fsync_of_its_directory(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append((f"fsync-{kind}", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = ckpt.write_state(tmp_path, ckpt.LearnerState(step=3))
    d = str(ckpt.learner_dir(tmp_path).resolve())
    assert events[-2:] == [("replace", str(path)), ("fsync-dir", d)], events
    assert ckpt.read_state(tmp_path).step == 3


def test_compaction_unlinks_the_old_log_only_after_the_directory_is_synced(tmp_path, monkeypatch):
    """A compaction starts a new sample log generation and unlinks the old one: the unlink comes after
    the directory fsync that makes the new state.msgpack (naming the new log) durable."""
    from pathlib import Path

    from parley.protocol.messages import Task
    from tests.integration.test_learner_fates import scored_for

    events: list[str] = []
    real_fsync, real_unlink = os.fsync, Path.unlink

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append("fsync-dir")
        return real_fsync(fd)

    def unlink(self, missing_ok=False):
        if self.name.startswith(ckpt.SAMPLE_LOG_PREFIX):
            events.append(f"unlink {self.name}")
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "unlink", unlink)
    ledger = ckpt.Ledger(tmp_path, compact_min_bytes=1)
    task = Task(task_id="durable-g000001", run="durable", item_id="item-1", n=2)
    first = scored_for(task, 0, pad=1000)
    ledger.write(ckpt.LearnerState(groups=[ckpt.GroupState(task_id=task.task_id, first_seen=0.0, samples=[first])]))
    old = ledger.log_name
    events.clear()
    ledger.write(ckpt.LearnerState(groups=[]))  # the sample left the buffer: all dead, compacted
    ledger.close()
    assert ledger.compactions == 1 and ledger.log_name != old
    assert f"unlink {old}" in events, events
    assert events.index("fsync-dir") < events.index(f"unlink {old}"), events
