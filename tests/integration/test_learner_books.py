"""Crash-consistent books: the DeepSpeed checkpoint the ledger names, trained.jsonl and the archive
are durable (written, fsynced, renamed, the directory fsynced) before the ledger write that names
them, so a power cut after any ledger write finds everything it vouches for; and a resume loses no
outcome and trains nothing twice, also with checkpoint_every > 1. The real Learner (stepper, intake,
ledger, resume) with a test-double trainer, built without NATS as in test_learner_ledger; the
ordering is seen through a spy on os.fsync and os.replace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from parley.evaluation.evallog import read_log
from parley.learner import checkpoint as ckpt
from tests.integration.test_learner_fates import TrainerDouble, base_model, make_cfg, scored_for
from tests.integration.test_learner_ledger import task

pytestmark = [pytest.mark.integration]


class FsyncSpy:
    """Test double around os.fsync / os.replace: records, in order, which path each fsync made
    durable and each rename, then calls the real function."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return real_fsync(fd)

        def replace(src, dst, **kw):
            self.events.append(("replace", str(Path(dst).resolve())))
            if Path(dst).name == ckpt.STATE_FILE:  # which step and tag this ledger write names
                self.events.append(
                    ("ledger", msgspec.msgpack.decode(Path(src).read_bytes(), type=ckpt.LearnerState).tag)
                )
            return real_replace(src, dst, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        # pathlib's rename/replace (write_parquet's) go through os.replace too
        monkeypatch.setattr(Path, "replace", lambda self, target: replace(self, target) or Path(target))

    def first(self, kind: str, path: Path | str) -> int:
        path = str(Path(path).resolve())
        return next(i for i, e in enumerate(self.events) if e == (kind, path))

    def last(self, kind: str, path: Path | str) -> int:
        path = str(Path(path).resolve())
        return max(i for i, e in enumerate(self.events) if e == (kind, path))


class CheckpointDouble(TrainerDouble):
    """Test double: save_checkpoint writes a file in the tag directory, as DeepSpeed does."""

    def __call__(self, op, *args):
        out = super().__call__(op, *args)
        if op == "save_checkpoint":
            (args[0] / args[1] / "mp_rank_00_model_states.pt").write_bytes(b"model")
            (args[0] / "latest").write_text(args[1])
        return out


def learner_for(run_dir: Path, tmp_path: Path, *, resume: bool, checkpoint_every: int = 1):
    from parley.learner.service import Learner

    # steps = 0 (no budget) and a publish_every never reached: the steps here publish nothing (no NATS)
    cfg = make_cfg(
        "books",
        run_dir,
        steps=0,
        groups_per_step=1,
        max_staleness=10_000,  # the samples here are all of version 0
        publish_every=10_000,
        checkpoint_every=checkpoint_every,
    )
    return Learner(cfg, None, None, CheckpointDouble(), model_dir=base_model(tmp_path), resume=resume, steps=0)


def add_group(learner, i: int, *, flat: bool = False) -> None:
    for sample in range(2):
        learner.grouper.add(scored_for(task("books", i), sample, flat=flat))


async def test_what_the_ledger_names_is_durable_before_it(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    learner = learner_for(run_dir, tmp_path, resume=False)
    add_group(learner, 0, flat=True)  # no signal: finished untrained, archived as dropped
    add_group(learner, 1)
    spy = FsyncSpy(monkeypatch)
    assert await learner.stepper.try_step()
    assert ckpt.read_state(run_dir).tag == "step000001"

    named = spy.events.index(("ledger", "step000001"))  # the first ledger write that names step 1
    ck = ckpt.ckpt_dir(run_dir) / "step000001"
    archive = ckpt.archive_dir(run_dir)
    for path in (
        ck / "mp_rank_00_model_states.pt",
        ck,
        ckpt.ckpt_dir(run_dir),  # the tag's entry
        run_dir / "trained.jsonl",
        archive / "step000001-trained.parquet",
        archive / "dropped-00000000.parquet",
        archive,  # the archive files' entries
    ):
        assert spy.last("fsync", path) < named, path
    assert spy.first("replace", archive / "step000001-trained.parquet") < named
    assert spy.first("replace", archive / "dropped-00000000.parquet") < named
    assert [s.task_id for s in read_log(archive / "dropped-00000000.parquet")] == ["books-g000000"] * 2
    assert ckpt.read_state(run_dir).archive_seq == 1


def books(run_dir: Path) -> tuple[list[str], dict[str, str], list[str], list[str]]:
    """(tasks trained per trained.jsonl, not_trained per trained.jsonl, tasks of the archive's
    trained samples, tasks of its dropped samples), each sample's task once per sample."""
    trained, not_trained = [], {}
    for line in (run_dir / "trained.jsonl").read_text().splitlines():
        entry = json.loads(line)
        trained += entry["tasks"]
        for t, why in entry["not_trained"].items():
            assert t not in not_trained, f"{t} reported twice"
            not_trained[t] = why
    root = ckpt.archive_dir(run_dir)
    arch_trained = [s.task_id for p in sorted(root.glob("step*-trained.parquet")) for s in read_log(p)]
    arch_dropped = [s.task_id for p in sorted(root.glob("dropped-*.parquet")) for s in read_log(p)]
    return trained, not_trained, arch_trained, arch_dropped


async def test_outcomes_since_the_last_checkpoint_survive_a_resume(tmp_path):
    """checkpoint_every 2: step 1 (task 1 trained, task 0 skipped with it) is not checkpointed, and
    task 3 is skipped after it; then the learner dies. The resumed one trains task 1 again (step 1
    from the initial weights) and its books hold every task once: 0 lost, 0 trained twice."""
    run_dir = tmp_path / "run"
    learner = learner_for(run_dir, tmp_path, resume=False, checkpoint_every=2)
    add_group(learner, 0, flat=True)
    add_group(learner, 1)
    assert await learner.stepper.try_step()
    add_group(learner, 3, flat=True)
    assert not await learner.stepper.try_step()  # task 3 skipped, no step (nothing trainable)
    await learner.intake.flush()
    assert ckpt.read_state(run_dir).step == 0
    learner.intake.ledger.close()  # the kill: nothing more is written

    resumed = learner_for(run_dir, tmp_path, resume=True, checkpoint_every=2)
    assert set(resumed.grouper.buffer) == {"books-g000001"}
    add_group(resumed, 2)
    assert await resumed.stepper.try_step()
    assert await resumed.stepper.try_step()
    assert ckpt.read_state(run_dir).step == 2

    trained, not_trained, arch_trained, arch_dropped = books(run_dir)
    assert sorted(trained) == ["books-g000001", "books-g000002"]
    assert set(not_trained) == {"books-g000000", "books-g000003"}
    assert all(why.startswith("zero advantage") for why in not_trained.values())
    assert sorted(arch_trained) == ["books-g000001"] * 2 + ["books-g000002"] * 2
    assert sorted(arch_dropped) == ["books-g000000"] * 2 + ["books-g000003"] * 2


async def test_a_ledger_write_grows_with_the_open_work_not_the_history(tmp_path):
    """Every task that finished (trained, or skipped with a reason) is recorded once: under the
    watermark in state.msgpack, its reason once in the append-only reasons log. So the step's own
    ledger write stays the same size at task 40 as at task 240 (before: the whole `done` and
    `reasons` maps, every write); and a resume still knows each finished task and its reason."""
    run_dir = tmp_path / "run"
    learner = learner_for(run_dir, tmp_path, resume=False)
    state_sizes = {}
    for i in range(0, 240, 2):
        add_group(learner, i, flat=True)  # skipped, with a reason
        add_group(learner, i + 1)  # trained
        assert await learner.stepper.try_step()
        state_sizes[i] = (ckpt.learner_dir(run_dir) / ckpt.STATE_FILE).stat().st_size
    assert state_sizes[238] <= state_sizes[40] + 16, (state_sizes[40], state_sizes[238])
    reasons_path = ckpt.learner_dir(run_dir) / ckpt.REASONS_FILE
    state = ckpt.read_state(run_dir)
    assert dict.__len__(msgspec.msgpack.decode((ckpt.learner_dir(run_dir) / ckpt.STATE_FILE).read_bytes())["done"]) == 0
    assert state.done_below == 240 and state.step == 120
    assert all(f"books-g{i:06d}" in state.done for i in range(240)) and "books-g000240" not in state.done
    assert state.done["books-g000238"] == "zero_advantage" and len(state.reasons) == 120
    # the reasons log: one line per skipped task, appended once
    assert len(reasons_path.read_text().splitlines()) == 120

    learner.intake.ledger.close()
    resumed = learner_for(run_dir, tmp_path, resume=True)
    late = scored_for(task("books", 17), 0)
    assert resumed.grouper.add(late) == "late"  # finished under the watermark: not a new group
    add_group(resumed, 240)
    add_group(resumed, 241)
    assert await resumed.stepper.try_step()
    assert len(reasons_path.read_text().splitlines()) == 120  # nothing written again
    assert ckpt.read_state(run_dir).done_below == 241
