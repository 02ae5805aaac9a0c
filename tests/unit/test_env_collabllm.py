"""CollabLLM medium as an environment changes nothing: its metrics, weights, data, split, tasks,
overlap, simulator prompt and benchmark columns are the ones the roles use today, compared
against the roles' own code (rollout.score, config.learner, evaluation.benchmark/selection)."""

from __future__ import annotations

import asyncio

import pytest

from parley.config.learner import DataConfig, RolloutConfig
from parley.config.run import load_config
from parley.config.scorer import ScorerConfig
from parley.environments.base import find_overlap, leaking
from parley.environments.collabllm import NAME, environment
from parley.protocol import examples
from parley.rewards.reward import REWARD_METRICS, default_weights
from parley.rollout.score import score_trajectory
from parley.tasks import data as tasks_data
from tests import factories

REFERENCE = "A Week in Lisbon\n\nThe trams climb the hills while the river shines below."
LEVELS = {"understanding": 3, "clarification": 1, "suggestions": 2}


def _traj():
    return factories.trajectory(
        reference=REFERENCE,
        futures=[],
        assistant_tokens=420,
        messages=[
            ("user", "help me with a blog post"),
            ("assistant", "A Week in Lisbon\n\nThe trams climb the hills."),
        ],
    )


def test_reward_is_the_scorers():
    env = environment()
    assert env.reward.names == REWARD_METRICS
    # the weights a run reads when [scorer] weights is left out (the embedded default no longer names them)
    assert (
        env.reward.default_weights()
        == default_weights()
        == load_config().scorer.weights
        == {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1}
    )
    assert env.reward.judge_ops == ("extract", "interactivity") and env.needs_judge and env.needs_simulator


@pytest.mark.parametrize("variant", ["sacrebleu", "char"])
def test_metrics_equal_score_trajectory(variant):
    traj, judge = _traj(), factories.JudgeDouble(model="double", levels=LEVELS, score=0.5)
    scored = asyncio.run(score_trajectory(traj, judge, ScorerConfig(bleu_variant=variant)))
    replies = {op: asyncio.run(getattr(judge, op)(traj.messages)) for op in ("extract", "interactivity")}
    assert environment(bleu_variant=variant).reward.evaluate(traj, replies) == pytest.approx(scored.metrics)


def test_unknown_bleu_variant_is_named():
    with pytest.raises(ValueError, match=r"bleu_variant='nltk' not allowed; use one of \('sacrebleu', 'char'\)"):
        environment(bleu_variant="nltk")


def test_tasks_are_the_feeders():
    env = environment()
    data = DataConfig()
    train, held = env.tasks.train_eval(data)
    assert (train, held) == tasks_data.train_eval_items(data) and train and held
    assert env.tasks.task is tasks_data.task_from_item
    assert env.user.prompt == load_config().rollout.sim_prompt == "lazy_full"  # [rollout] sim_prompt "" resolved


def test_overlap_is_tasks_find_overlap():
    env = environment()
    items = tasks_data.load_items()
    train, held = items[:-2], items[-2:] + items[:1]  # the first item on both sides: planted leakage
    theirs = tasks_data.find_overlap(train, held)
    assert theirs.references
    ours = find_overlap(env.tasks, train, held)
    assert ours["reference"] == theirs.references and ours["prompt"] == theirs.prompts
    assert leaking(env.tasks, train, held) == {"reference": theirs.references}
    assert leaking(env.tasks, *tasks_data.split_items(items, 0.25)) == {}


def test_eval_protocol_is_the_benchmarks():
    from parley.evaluation.benchmark import METRICS, record_value
    from parley.evaluation.selection import SELECT_METRICS

    env = environment()
    assert env.eval.columns == METRICS
    assert env.eval.selectable == SELECT_METRICS
    assert env.eval.select == load_config().learner.eval_metric == "mr"  # [learner] eval_metric "" resolved
    rec = examples.eval_record("unit")
    rec.metrics = {"bleu": 0.31, "interactivity": 0.7, "token_amount": 0.9}  # token_amount as futures would make it
    for column in METRICS:
        assert env.eval.value(column, rec.metrics, rec) == pytest.approx(record_value(rec, column)), column


def test_the_name_is_the_entry_points():
    assert environment().name == NAME == "collabllm_medium"


def test_eval_tasks_are_the_benchmarks():
    from parley.evaluation.runner import EvalSettings, make_tasks

    env = environment()
    items = tasks_data.load_items()[:3]
    settings = EvalSettings(seeds=2, max_new_turns=10, assistant_max_tokens=512, sim_prompt="lazy_summary")
    rollout = RolloutConfig(
        max_new_turns=settings.max_new_turns, max_tokens=settings.assistant_max_tokens, sim_prompt=settings.sim_prompt
    )
    ours = [
        env.eval_task(it, run=settings.run, task_id=f"eval/{it.item_id}/{k}", n=1, rollout=rollout, seed=k, version=0)
        for it in items
        for k in range(settings.seeds)
    ]
    assert ours == make_tasks(items, settings)
