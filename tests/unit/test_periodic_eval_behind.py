"""evaluation.periodic's export behind training (PeriodicEval.submit with `write`): a version whose
weights travel in GPU buffers is copied to the CPU on the step's path and written and exported while the
next steps run (before, 0.45 + 0.1 s of every evaluated SmolLM2 step's end on an H100, 2026-12-07). The
eval child is a test double (PlantedEval); the writes are real files."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from parley.evaluation.periodic import PeriodicEval, evaluated, failed_dir, model_dir, owed_marker
from parley.learner import checkpoint as ckpt
from tests.unit.test_periodic_eval import PlantedEval, make_run, publish_weights

PLAN = {0: (0.45, 0.83, 2.9), 2: (0.48, 0.80, 2.1), 4: (0.47, 0.80, 2.0)}


class WriteDouble:
    """Test double of weights.publish.Weights.eval_copy's call: writes the version's weights directory
    when `go` is set (a slow disk), from a worker thread as the real one runs."""

    def __init__(self, run_dir, version: int, go: threading.Event | None = None):
        self.run_dir, self.version, self.go = run_dir, version, go
        self.thread = None
        self.done = threading.Event()

    def __call__(self) -> None:
        self.thread = threading.current_thread()
        if self.go is not None:
            assert self.go.wait(10)
        publish_weights(self.run_dir, self.version)
        self.done.set()


@contextlib.asynccontextmanager
async def running(tmp_path):
    """A PeriodicEval over the test double's evals, its queue worked through until the block ends."""
    cfg, run_dir = make_run(tmp_path)
    double = PlantedEval(PLAN)
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=double)
    halt = asyncio.Event()
    runner = asyncio.create_task(pe.run(halt))
    try:
        yield pe, run_dir, double
    finally:
        await pe.drain(30.0, asyncio.Event())  # waits for the writes, the exports and the evals
        halt.set()
        await runner


async def test_the_export_runs_behind_the_step_and_the_version_is_played_after_it(tmp_path):
    async with running(tmp_path) as (pe, run_dir, double):
        await pe.submit(0, 0)
        go = threading.Event()
        write = WriteDouble(run_dir, 2, go)
        # submit returns while the weights are still being written: the step's path does not wait
        await asyncio.wait_for(pe.submit(2, 2, write), timeout=2)
        assert owed_marker(run_dir, 2).is_file() and pe.busy and not model_dir(run_dir, 2).exists()
        assert pe.due(2) is False  # submitted: not due again
        go.set()
    assert write.thread is not threading.main_thread()
    assert [j.version for j in double.jobs] == [0, 2] and evaluated(run_dir, 2)
    assert not owed_marker(run_dir, 2).exists()  # exported: nothing owed


async def test_a_second_export_waits_for_the_first(tmp_path):
    async with running(tmp_path) as (pe, run_dir, double):
        go = threading.Event()
        await pe.submit(2, 2, WriteDouble(run_dir, 2, go))
        second = asyncio.create_task(pe.submit(4, 4, WriteDouble(run_dir, 4)))
        await asyncio.sleep(0.2)
        assert not second.done()  # one CPU copy of the weights waits at most
        go.set()
        await asyncio.wait_for(second, timeout=10)
    assert [j.version for j in double.jobs] == [2, 4]


async def test_a_learner_stopped_before_the_export_leaves_the_version_owed_and_the_next_exports_it(tmp_path):
    cfg, run_dir = make_run(tmp_path)
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=PlantedEval(PLAN))
    go = threading.Event()
    write = WriteDouble(run_dir, 2, go)
    await pe.submit(2, 2, write)
    for _ in range(200):  # the write has begun in its thread
        if write.thread is not None:
            break
        await asyncio.sleep(0.01)
    await pe.close()  # stopped mid-write: the export is cut, the version stays owed
    go.set()
    assert write.done.wait(10)  # the thread's write ends; nothing exports it
    await asyncio.sleep(0.1)
    assert owed_marker(run_dir, 2).is_file() and not model_dir(run_dir, 2).exists()

    # the next learner, resumed at step 3: the weights the write left are exported and played
    assert ckpt.weights_dir(run_dir, 2).is_dir()  # the cut write's thread finished once let go
    double = PlantedEval(PLAN)
    nxt = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=double)
    assert 2 in nxt.requeue_unfinished(3)
    assert model_dir(run_dir, 2).is_dir() and not owed_marker(run_dir, 2).exists()


def test_an_owed_version_whose_weights_are_gone_is_set_aside_with_the_reason(tmp_path):
    cfg, run_dir = make_run(tmp_path)
    for v in (2, 6):
        owed_marker(run_dir, v).parent.mkdir(parents=True, exist_ok=True)
        owed_marker(run_dir, v).write_text(f"{v}\n")
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=PlantedEval(PLAN))
    queued = pe.requeue_unfinished(4)  # v2 owed, nothing kept of it; v6 is past the resumed step
    assert 2 not in queued and 6 not in queued
    reason = (failed_dir(run_dir, 2) / "error.txt").read_text()
    assert "owed an eval, but its weights were not kept" in reason
    assert not owed_marker(run_dir, 2).exists() and not owed_marker(run_dir, 6).exists()
    assert not failed_dir(run_dir, 6).exists()


async def test_a_write_that_fails_behind_training_leaves_the_version_unevaluated_with_its_reason(tmp_path):
    def broken() -> None:  # e.g. a rank without the snapshot: None.write
        raise AttributeError("'NoneType' object has no attribute 'write'")

    async with running(tmp_path) as (pe, run_dir, double):
        await pe.submit(2, 2, broken)
        await pe.settle()
        await pe.submit(4, 4, WriteDouble(run_dir, 4))  # the next version is not held up by it
    assert [j.version for j in double.jobs] == [4]
    assert [(o.version, o.ok) for o in pe.outcomes if o.version == 2] == [(2, False)]
    assert "AttributeError" in next(o.error for o in pe.outcomes if o.version == 2)
    assert not owed_marker(run_dir, 2).exists() and pe.unfinished == 0
