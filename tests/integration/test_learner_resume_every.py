"""Exact resume with checkpoint_every > 1 and the feeder in play: the learner's own feeder issues the
tasks, a stand-in actor answers each with synthetic scored samples (the same for the same task index in
every run), and the learner is SIGKILLed after a step that no checkpoint covers. Resumed, it retrains
that step from the checkpoint before it, and ends with the same trajectory ids per step and the same
weight tensors as an uninterrupted run. Real nats-server, real DeepSpeed on the toy model (fp32, CPU),
the real `parley learner` command."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from parley.protocol import codec, topology
from parley.protocol.bus import publish
from parley.protocol.connect import barrier
from tests.integration.test_learner_resume import BUS, REPO, N, finish, make_scored, toy, trained_lines, wait_for  # noqa: F401 (toy: a fixture)

# the extended tier (docs/operations.md, "The test suite"): test_learner_resume.py keeps the exact resume
# of a SIGKILLed learner in `make test`; this one adds a kill after a step no checkpoint covers
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(900)]

GROUPS_PER_STEP, STEPS, EVERY = 2, 4, 2  # checkpoints after steps 2 and 4; the kill comes after step 3


def start(url: str, run: str, run_dir: Path, model: Path, log: Path, resume: bool = False) -> subprocess.Popen:
    sets = [
        f'run.dir="{run_dir}"',
        f'policy.model="{model}"',
        f"rollout.n={N}",
        f"learner.groups_per_step={GROUPS_PER_STEP}",
        f"learner.checkpoint_every={EVERY}",
        "learner.max_staleness=1",
        'learner.stale_policy="correct"',
        "learner.lr=1e-3",
        "learner.micro_batch_tokens=256",
        'learner.dtype="float32"',
        "learner.ledger_flush_s=0.5",
        "learner.eval_every=0",
        f"bus.ack_wait_s={BUS.ack_wait_s}",
        f"bus.max_bytes={BUS.max_bytes}",
    ]
    cmd = [sys.executable, "-m", "parley.deploy.cli", "learner", "--nats", url, "--run", run, "--steps", str(STEPS)]
    for s in sets:
        cmd += ["--set", s]
    if resume:
        cmd.append("--resume")
    return subprocess.Popen(
        cmd, cwd=REPO, env={**os.environ, "PARLEY_LOG": "INFO"}, stdout=log.open("a"), stderr=subprocess.STDOUT
    )


class StandInActor:
    """Answers the feeder's tasks as an actor would: N scored samples per task, built from the task's
    index alone (so every run trains the same data), behaviour version = the task's admitted version.
    Tasks at or beyond `hold_from` are kept unanswered until `release()`."""

    def __init__(self, nc, js, toy, run: str, hold_from: int | None = None):
        self.nc, self.js, self.run = nc, js, run
        _, self.tok, self.model = toy
        self.hold_from = hold_from
        self.seen: dict[int, object] = {}
        self.answered: set[int] = set()
        self.queue: asyncio.Queue = asyncio.Queue()
        # One task answered at a time, and release() answers every held task before any later one:
        # otherwise a task issued after the resume could complete before a released one (both
        # publishing at once), change which groups step 4 trains, and fail the comparison for
        # reasons of this double, not of the learner.
        self.lock = asyncio.Lock()

    async def start(self):
        async def on_task(msg):
            await self.queue.put(codec.decode("tasks", msg.data))

        self.sub = await self.nc.subscribe(topology.subject(self.run, "tasks"), cb=on_task)
        await barrier(self.nc)
        self.worker = asyncio.create_task(self._answer_all())
        return self

    async def _answer_all(self):
        while True:
            task = await self.queue.get()
            index = int(task.task_id.rsplit("-g", 1)[1])
            self.seen[index] = task
            async with self.lock:
                if self.hold_from is None or index < self.hold_from:
                    await self.answer(index)

    async def answer(self, index: int):
        if index in self.answered:
            return
        self.answered.add(index)
        task = self.seen[index]
        for sample in range(N):
            s = make_scored(self.tok, self.model, self.run, index, sample)
            s.task_id = s.trajectory.task_id = task.task_id
            s.traj_id = s.trajectory.traj_id = f"{task.task_id}/{sample}"
            s.trajectory.item_id = task.item_id
            for turn in s.trajectory.turns:
                turn.version = task.admitted_version
            await publish(self.js, self.run, "scored", s)

    async def release(self):
        async with self.lock:
            self.hold_from = None
            for index in sorted(self.seen):
                await self.answer(index)

    def check(self) -> bool:
        """False while answering; re-raises what stopped it (a test bug, not a learner one)."""
        if self.worker.done():
            self.worker.result()
            raise RuntimeError("the stand-in actor stopped")
        return False

    async def stop(self):
        self.check()
        self.worker.cancel()
        await self.sub.unsubscribe()


async def finish_with(actor: StandInActor, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """finish(), failing at once if the stand-in actor breaks meanwhile."""
    done = asyncio.create_task(finish(proc, log, timeout))
    await asyncio.wait({done, actor.worker}, return_when=asyncio.FIRST_COMPLETED)
    actor.check()
    await done


def by_index(lines: list[dict]) -> list[tuple[int, list[str]]]:
    """(step, trajectory ids without the run name) of trained.jsonl lines."""
    return [(line["step"], [t.split("-", 1)[1] for t in line["traj_ids"]]) for line in lines]


def final_weights(run_dir: Path):
    from safetensors.torch import load_file

    from parley.learner import checkpoint as ckpt

    return load_file(ckpt.weights_dir(run_dir, STEPS) / "model.safetensors")


async def test_kill_between_checkpoints_resumes_to_the_same_weights(nc, js, nats_server, toy, tmp_path):
    import torch

    from parley.learner.checkpoint import read_state

    model_path = toy[0]

    # uninterrupted
    await topology.ensure_topology(js, "whole", BUS)
    actor = await StandInActor(nc, js, toy, "whole").start()
    whole_dir, whole_log = tmp_path / "whole", tmp_path / "whole.log"
    proc = start(nats_server.url, "whole", whole_dir, model_path, whole_log)
    await finish_with(actor, proc, whole_log, timeout=400)
    await actor.stop()
    expected = by_index(trained_lines(whole_dir))
    assert [step for step, _ in expected] == [1, 2, 3, 4]

    # killed after step 3 (checkpoint at step 2): the tasks of step 4 are held back so it cannot run
    await topology.ensure_topology(js, "killed", BUS)
    hold = 3 * GROUPS_PER_STEP
    actor = await StandInActor(nc, js, toy, "killed", hold_from=hold).start()
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    proc = start(nats_server.url, "killed", run_dir, model_path, log)
    await wait_for(lambda: actor.check() or len(trained_lines(run_dir)) == 3, 400, "step 3", proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert read_state(run_dir).step == 2, "step 3 must not be covered by a checkpoint"

    proc = start(nats_server.url, "killed", run_dir, model_path, log, resume=True)
    await wait_for(lambda: "resumed at step 2" in log.read_text(), 300, "the resume", proc, log)
    await actor.release()
    await finish_with(actor, proc, log, timeout=400)
    await actor.stop()

    assert by_index(trained_lines(run_dir)) == expected
    whole, resumed = final_weights(whole_dir), final_weights(run_dir)
    assert set(whole) == set(resumed)
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0, msg=name)
