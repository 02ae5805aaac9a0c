"""[learner] updates_per_step: a step's groups are split in order into mini-batches of whole groups,
each trained with its own loss and optimizer step (verl's ppo_mini_batch_size). CPU, gloo, one process,
the toy model; the stepper's split with the real Trainer behind a recording driver."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from parley.config.learner import LearnerConfig
from parley.learner.groups import Grouper
from parley.learner.stepper import Stepper
from parley.learner.trainer import Trainer
from tests import factories

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

N, GROUPS = 3, 4


def _scored(task: str, sample: int, reward: float):
    traj = factories.trajectory(
        "r",
        task,
        sample,
        item_id=task,
        messages=[],
        token_ids=[5 + sample, 9, 12 + sample, 7, 30 + sample, 11, 40, 8],
        loss_mask=[0, 0, 1, 1, 1, 0, 1, 1],
        turns=[factories.turn(2, [-2.0, -2.1, -2.2], 0), factories.turn(6, [-2.3, -2.4], 0)],
    )
    return factories.scored(traj, {"bleu": reward})


class RecordingDriver:
    """Test double of learner.ranks' driver: calls the real Trainer and records each call's samples."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.calls = trainer, []

    def train_step(self, samples):
        stats = self.trainer.train_step(samples)
        self.calls.append(([s.traj_id for s in samples], stats))
        return stats


def _step(lc: LearnerConfig, driver) -> tuple[list, dict]:
    grouper = Grouper(N, max_staleness=1, stale_policy="drop", timeout_s=60.0)
    for g in range(GROUPS):
        for i in range(N):
            grouper.add(_scored(f"g{g}", i, reward=0.2 * i + 0.1 * g))
    taken, _ = grouper.take(GROUPS, 0)
    cfg = SimpleNamespace(learner=lc, policy=SimpleNamespace(reference="local"), run=SimpleNamespace(name="r"))
    cfg.run_dir = "unused"
    stepper = Stepper(
        None, cfg, None, driver, grouper=grouper, feeder=None, intake=None, weights=None, evals=None,
        steplog=None, env_record=None, consumer="test", started=0.0,
    )  # fmt: skip
    trained, stats, refused, _, untried = asyncio.run(stepper.train(taken))
    assert not refused and not untried
    return trained, stats


def test_two_updates_per_step_make_two_optimizer_steps_on_half_the_groups_each(tiny_model):
    lc = LearnerConfig(zero_stage=2, lr=1e-3, kl_coef=0.0, micro_batch_tokens=64, groups_per_step=4, updates_per_step=2)
    trainer = Trainer(lc, tiny_model)
    driver = RecordingDriver(trainer)
    trained, stats = _step(lc, driver)

    assert trainer.engine.global_steps == 2  # two optimizer steps in one learner step
    assert [t.group.task_id for t in trained] == ["g0", "g1", "g2", "g3"]
    # each update saw only its mini-batch, so its loss is that mini-batch's token-mean
    assert [ids for ids, _ in driver.calls] == [
        [f"g{g}/{i}" for g in (0, 1) for i in range(N)],
        [f"g{g}/{i}" for g in (2, 3) for i in range(N)],
    ]
    per = [s for _, s in driver.calls]
    assert stats["updates"] == 2.0
    assert stats["sequences"] == 12.0 and stats["trained_tokens"] == sum(s["trained_tokens"] for s in per)
    w = [s["trained_tokens"] for s in per]
    assert stats["loss"] == pytest.approx((per[0]["loss"] * w[0] + per[1]["loss"] * w[1]) / sum(w))


def test_one_update_per_step_is_the_step_as_before(tiny_model):
    lc = LearnerConfig(zero_stage=2, lr=1e-3, kl_coef=0.0, micro_batch_tokens=64, groups_per_step=4)
    trainer = Trainer(lc, tiny_model)
    driver = RecordingDriver(trainer)
    _, stats = _step(lc, driver)
    assert trainer.engine.global_steps == 1 and len(driver.calls) == 1 and len(driver.calls[0][0]) == 12
    assert stats == {**driver.calls[0][1], "updates": 1.0}
