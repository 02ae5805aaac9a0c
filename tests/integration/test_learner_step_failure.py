"""A training step that cannot succeed ends: a step that fails deterministically after its samples
were acked (a CUDA out-of-memory on one long sample) ends the learner, and each --resume takes the
same groups first; the ledger counts the attempts, and at [learner] max_step_attempts the groups are
rejected with the error and dead-lettered instead of crash-looping the learner for ever. The real
Learner (feeder, SCORED consumer, ledger, resume, DEAD) on a real nats-server, with a test-double
trainer that raises torch.OutOfMemoryError whenever one task's samples are in the step."""

from __future__ import annotations

import asyncio

import pytest

from parley.learner.checkpoint import read_state
from parley.protocol import codec, topology
from tests.integration.test_learner_fates import ActorDouble, TrainerDouble, base_model, make_cfg, not_trained

pytestmark = [pytest.mark.integration]


class OomTrainerDouble(TrainerDouble):
    """Test double of learner.ranks.Driver: every train_step that holds a sample of `poison_task`
    raises torch.OutOfMemoryError, as a real CUDA step over one too-long sample does each time."""

    def __init__(self, poison_task: str):
        super().__init__()
        self.poison_task = poison_task

    def __call__(self, op, *args):
        if op == "train_step" and any(s.traj_id.startswith(self.poison_task + "/") for s in args[0]):
            import torch

            self.calls.append(op)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (test double)")
        return super().__call__(op, *args)


async def run_once(js, nc, cfg, trainer, *, resume: bool):
    """One learner process's life: returns its exit code, or the exception that ended it."""
    from parley.learner.service import Learner

    learner = Learner(
        cfg, js, nc, trainer, model_dir=base_model(cfg.run_dir.parent), resume=resume, steps=cfg.learner.steps
    )
    halt = asyncio.Event()
    actor = ActorDouble(js, cfg.run.name, lambda i: "answer", bus=cfg.bus).start(halt)
    try:
        return await asyncio.wait_for(learner.run(asyncio.Event()), timeout=60)
    except Exception as e:  # noqa: BLE001 - the test looks at what ended the learner
        return e
    finally:
        halt.set()
        await asyncio.gather(actor, return_exceptions=True)


async def test_a_step_that_runs_out_of_memory_every_time_is_rejected_after_max_attempts(js, nc, tmp_path):
    run, run_dir = "oom", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=2, groups_per_step=1, max_staleness=1, max_step_attempts=3)
    await topology.ensure_topology(js, run, cfg.bus)
    poison = f"{run}-g000000"
    trainer = OomTrainerDouble(poison)

    ends = [await run_once(js, nc, cfg, trainer, resume=i > 0) for i in range(4)]
    import torch

    # Three lives end in the OOM (each a crash a supervisor restarts with --resume); the fourth rejects
    # the group and trains the rest: before the attempts were counted, every life ended the same way.
    assert [type(e) for e in ends[:3]] == [torch.OutOfMemoryError] * 3, ends
    assert ends[3] == 0, ends[3]
    assert trainer.calls.count("train_step") == 3 + 2  # three failed steps, then the two of the budget

    state = read_state(run_dir)
    assert state.step == 2
    assert state.done[poison] == "step_failed"
    assert state.reasons[poison].startswith("not trained: a training step over these groups failed 3 times")
    assert "out of memory: OutOfMemoryError: CUDA out of memory" in state.reasons[poison]
    assert not_trained(run_dir)[poison] == state.reasons[poison]
    assert state.attempts == {}

    # every sample of the group is in DEAD, with the reason, and nothing trained it
    dead = topology.stream_name(run, "dead")
    assert (await js.stream_info(dead)).state.messages == 2
    letters = [codec.decode("dead", (await js.get_msg(dead, seq)).data) for seq in (1, 2)]
    assert sorted(letter.reason.split(":", 1)[0] for letter in letters) == [f"{poison}/0", f"{poison}/1"]
    assert all("failed 3 times" in letter.reason for letter in letters)
    trained = [line for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert len(trained) == 2 and poison not in "".join(trained).split('"not_trained"')[0]


async def killed_in_a_step(tmp_path, driver):
    """A learner of one group of two samples whose step `driver` ends with SystemExit (a test double's
    stand-in for the process dying); returns the ledger it left."""
    from parley.learner.service import Learner
    from tests.integration.test_learner_fates import scored_for
    from tests.integration.test_learner_ledger import task

    run_dir = tmp_path / "run"
    cfg = make_cfg("killed", run_dir, steps=1, groups_per_step=1, max_staleness=0)
    learner = Learner(cfg, None, None, driver, model_dir=base_model(tmp_path), resume=False, steps=1)
    for sample in range(2):
        learner.grouper.add(scored_for(task("killed", 0), sample))
    await learner.intake.flush()
    with pytest.raises(SystemExit):
        await learner.stepper.try_step()
    return read_state(run_dir)


async def test_a_step_killed_during_training_counts_as_an_attempt(tmp_path):
    """A kill inside the step (the kernel's OOM killer, a CUDA fault) leaves no exception to catch:
    the attempt is in the ledger before the step begins."""

    class KilledDouble(TrainerDouble):
        """Test double: the step never returns (stands for the process dying inside it)."""

        def __call__(self, op, *args):
            if op == "train_step":
                raise SystemExit("killed inside the step (test double)")
            return super().__call__(op, *args)

    state = await killed_in_a_step(tmp_path, KilledDouble())
    assert state.attempts == {"killed-g000000": 1}
    assert [g.task_id for g in state.groups] == ["killed-g000000"] and "killed-g000000" not in state.done


async def test_a_kill_after_the_training_is_no_failed_attempt(tmp_path):
    """A kill after the training returned (during the publication, the checkpoint write, ...) says
    nothing about the step: the ledger holds no attempt for its groups, which stay buffered for the
    resume to train. Before, the attempt stayed counted until the step's last ledger write, and three
    such kills rejected the groups as step_failed."""

    class KilledAfterDouble(TrainerDouble):
        """Test double: the step trains, then the process dies as the weights are taken for publication."""

        def __call__(self, op, *args):
            if op == "weights_snapshot":
                raise SystemExit("killed after the training (test double)")
            return super().__call__(op, *args)

    driver = KilledAfterDouble()
    state = await killed_in_a_step(tmp_path, driver)
    assert driver.calls.count("train_step") == 1
    assert state.attempts == {}
    assert state.step == 0 and [g.task_id for g in state.groups] == ["killed-g000000"]
    assert "killed-g000000" not in state.done
