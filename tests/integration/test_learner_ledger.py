"""The ledger writes what changed: buffered samples go once into the append-only sample log beside
state.msgpack, so a write costs the new samples plus a small state, however many samples are
buffered; resume brings every buffered sample back, also after a SIGKILL at any moment of a write
or of a compaction. The real Learner (flush, resume) and the real learner.checkpoint.Ledger; no
server is needed (the Learner is built without NATS, as in test_learner_fates)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from parley.learner import checkpoint as ckpt
from parley.protocol.messages import Task
from tests.integration.test_learner_fates import TrainerDouble, base_model, make_cfg, scored_for

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


def task(run: str, i: int) -> Task:
    return Task(task_id=f"{run}-g{i:06d}", run=run, item_id=f"item-{i}", n=2)


async def test_bytes_per_flush_stay_o_changes_and_resume_restores_every_sample(tmp_path):
    from parley.learner.service import Learner

    run_dir = tmp_path / "run"
    cfg = make_cfg("ledger", run_dir, steps=1, groups_per_step=2, max_staleness=0)
    learner = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=False, steps=1)
    flushes, per_write, full_rewrite = 100, [], 0
    for i in range(flushes):  # one more group buffered before each write (half of it: a partial group)
        for sample in range(2 if i % 2 else 1):
            assert learner.grouper.add(scored_for(task("ledger", i), sample, pad=20_000)) in ("added", "complete")
        await learner.intake.flush()
        per_write.append(learner.intake.ledger_bytes)
        # What one write of every buffered sample in full (the ledger before the sample log) would cost:
        full_rewrite += sum(len(msgspec.msgpack.encode(g.ordered())) for g in learner.grouper.buffer.values())
    total = learner.intake.ledger.bytes_written
    assert sum(per_write) == total
    sample_bytes = len(msgspec.msgpack.encode(scored_for(task("ledger", 0), 0, pad=20_000)))
    # Each write: the one or two new samples plus a state of ~100 small group records, never the buffer.
    assert max(per_write) < 2 * sample_bytes + 20_000, per_write
    assert per_write[-1] < 2 * sample_bytes + 20_000
    assert total < full_rewrite / 20, (total, full_rewrite)  # measured: ~1/34 of it at 100 writes
    assert learner.intake.ledger.compactions == 0  # nothing left the buffer: no dead record to drop

    before = {t: g.ordered() for t, g in learner.grouper.buffer.items()}
    learner.intake.ledger.close()
    resumed = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=True, steps=1)
    assert {t: g.ordered() for t, g in resumed.grouper.buffer.items()} == before  # every sample, field by field
    assert len(before) == flushes and sum(len(v) for v in before.values()) == 150
    written = resumed.intake.ledger.bytes_written
    await resumed.intake.flush()  # the restored samples are not written again
    assert resumed.intake.ledger.bytes_written - written < 20_000


async def test_an_old_ledger_with_inline_samples_resumes(tmp_path):
    """A ledger written before the sample log (full Scored inside state.msgpack) still resumes, and
    its samples move into the log with the next write."""
    from parley.learner.service import Learner

    run_dir = tmp_path / "run"
    cfg = make_cfg("old", run_dir, steps=1, groups_per_step=2, max_staleness=0)
    samples = [scored_for(task("old", 0), 0), scored_for(task("old", 0), 1), scored_for(task("old", 1), 0)]
    groups = [
        ckpt.GroupState(task_id="old-g000000", first_seen=1.0, completed=2.0, samples=samples[:2]),
        ckpt.GroupState(task_id="old-g000001", first_seen=1.0, samples=samples[2:]),
    ]
    ckpt.record_base_model(run_dir, base_model(tmp_path))
    ckpt.write_state(run_dir, ckpt.LearnerState(groups=groups))
    learner = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=True, steps=1)
    assert [s for g in learner.grouper.buffer.values() for s in g.ordered()] == samples
    await learner.intake.flush()
    raw = msgspec.msgpack.decode((ckpt.learner_dir(run_dir) / ckpt.STATE_FILE).read_bytes(), type=ckpt.LearnerState)
    assert [(len(g.samples), len(g.refs)) for g in raw.groups] == [(0, 2), (0, 1)]
    assert [s for g in ckpt.read_state(run_dir).groups for s in g.samples] == samples


# A child that keeps writing ledgers through the real Ledger: before write k, tasks k-WINDOW..k-1 are
# buffered (each with both samples), so every write appends two samples and leaves two dead, and the
# small compaction threshold makes it compact every few writes. Restarted, it resumes from its ledger.
WRITER = textwrap.dedent("""
    import sys
    from parley.learner import checkpoint as ckpt
    from tests.integration.test_learner_ledger import expected_groups, window_samples
    run_dir = sys.argv[1]
    ledger = ckpt.Ledger(run_dir, compact_min_bytes=40_000)
    state = ledger.open()
    kept = {(g.task_id, s.sample): s for g in state.groups for s in g.samples} if state else {}
    k = state.next_index + 1 if state else 1
    while True:
        groups = []
        for g in expected_groups(k):
            samples = [kept.get((g.task_id, s.sample), s) for s in window_samples(g.task_id)]
            groups.append(ckpt.GroupState(task_id=g.task_id, first_seen=g.first_seen, samples=samples))
        kept = {(g.task_id, s.sample): s for g in groups for s in g.samples}
        ledger.write(ckpt.LearnerState(next_index=k, groups=groups))
        k += 1
""")
WINDOW = 6


def window_samples(task_id: str):
    i = int(task_id.rsplit("-g", 1)[1])
    return [scored_for(task("kill", i), sample, pad=2000 + 37 * (i % 11)) for sample in range(2)]


def expected_groups(k: int) -> list[ckpt.GroupState]:
    return [
        ckpt.GroupState(task_id=f"kill-g{i:06d}", first_seen=float(i), samples=window_samples(f"kill-g{i:06d}"))
        for i in range(max(0, k - WINDOW), k)
    ]


def test_sigkill_during_writes_and_compactions_loses_no_buffered_sample(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rng = random.Random(7)
    seen_logs, last = set(), 0
    for round_ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir)], cwd=REPO, env=env, stderr=subprocess.PIPE)
        t0 = time.monotonic()
        while (
            not ckpt.has_state(run_dir) or ckpt.read_state(run_dir).next_index <= last + 3
        ) and time.monotonic() - t0 < 60:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere in a write, an fsync or a compaction
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = ckpt.read_state(run_dir)
        assert state.next_index > last, f"round {round_}: no write after the resume"
        last = state.next_index
        want = expected_groups(state.next_index)
        assert [g.task_id for g in state.groups] == [g.task_id for g in want]
        assert [g.samples for g in state.groups] == [g.samples for g in want], f"round {round_}: a sample changed"
        seen_logs.add(state.sample_log)
    assert len(seen_logs) > 1, "no compaction happened under the kills; the test did not reach that case"
    # A resume removes generations the ledger does not name (a kill during a compaction leaves one).
    ledger = ckpt.Ledger(run_dir)
    state = ledger.open()
    ledger.close()
    logs = sorted(p.name for p in ckpt.learner_dir(run_dir).glob("samples-*.log"))
    assert logs == [state.sample_log]


async def test_a_damaged_or_missing_sample_log_stops_the_resume_with_its_name(tmp_path):
    from parley.learner.service import Learner

    run_dir = tmp_path / "run"
    cfg = make_cfg("damaged", run_dir, steps=1, groups_per_step=2, max_staleness=0)
    learner = Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=False, steps=1)
    for sample in range(2):
        learner.grouper.add(scored_for(task("damaged", 0), sample))
    await learner.intake.flush()
    learner.intake.ledger.close()
    log = ckpt.learner_dir(run_dir) / ckpt.read_state(run_dir).sample_log
    data = bytearray(log.read_bytes())
    data[-5] ^= 0xFF  # one byte of the second sample
    log.write_bytes(bytes(data))
    with pytest.raises(
        ckpt.LedgerError,
        match=r"samples-000001\.log: the ledger names a sample of damaged-g000000 "
        r"at offset \d+, but its checksum does not match",
    ):
        Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=True, steps=1)
    log.unlink()
    with pytest.raises(ckpt.LedgerError, match=r"sample log is missing; restore learner/"):
        Learner(cfg, None, None, TrainerDouble(), model_dir=base_model(tmp_path), resume=True, steps=1)
