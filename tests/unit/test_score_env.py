"""The scorer with the run's environment: hidden_goal is scored with no judge at all (none asked, none
needed), its reward evaluated as the environment defines it; the empty-reference refusal applies only
to rewards that ask the judge; a verdict a judge metric cannot read is JudgeFailed."""

from __future__ import annotations

import pytest

from parley.config.scorer import ScorerConfig
from parley.environments import hidden_goal
from parley.environments.base import JudgeMetric, PureMetric, Reward
from parley.protocol.messages import ChatMessage, JudgeReply
from parley.rollout.score import Unscorable, score_trajectory
from parley.services.judge.client import JudgeFailed
from tests import factories

PIZZA = hidden_goal.Goal("pizza", (("size", "large"), ("crust", "thin"), ("topping", "ham")))


def _traj(messages, reference):
    return factories.trajectory(messages=messages, reference=reference, futures=[], assistant_tokens=30)


class NoJudge:
    """Fails the test if any judge operation is asked."""

    async def ask(self, op, messages, *, seed=0):
        raise AssertionError(f"the judge was asked {op!r}")


async def test_hidden_goal_is_scored_without_a_judge():
    reward = hidden_goal.environment(n_items=4).reward
    traj = _traj(
        [
            ChatMessage("user", "I want to order a pizza."),
            ChatMessage("assistant", "Size, crust, topping?"),
            ChatMessage("user", "size: large, crust: thin, topping: ham."),
            ChatMessage("assistant", "FINAL: size=large, crust=thick, topping=ham"),
        ],
        PIZZA.hidden(),
    )
    for judge in (None, NoJudge()):
        scored = await score_trajectory(traj, judge, ScorerConfig(), reward=reward)
        assert scored.metrics == pytest.approx({"goal_match": 2 / 3, "exact": 0.0, "assistant_turns": 2.0})
        assert scored.weights == {"goal_match": 1.0, "assistant_turns": -0.05}  # [scorer] weights {}: the env's
        assert scored.total == pytest.approx(2 / 3 - 2 * 0.05)
        assert scored.judge == [] and scored.judge_model == "" and scored.document == ""


async def test_configured_weights_and_clamps_apply_to_the_environments_metrics():
    reward = hidden_goal.environment(n_items=4).reward
    traj = _traj(
        [
            ChatMessage("user", "I want to order a pizza."),
            ChatMessage("assistant", "FINAL: size=large, crust=thin, topping=ham"),
        ],
        PIZZA.hidden(),
    )
    cfg = ScorerConfig(weights={"exact": 2.0, "assistant_turns": -1.0}, clamps={"assistant_turns": [0.0, 0.5]})
    scored = await score_trajectory(traj, None, cfg, reward=reward)
    assert scored.total == pytest.approx(2.0 * 1.0 - 1.0 * 0.5)


def _understanding(reply: JudgeReply, conv) -> float:
    if "understanding" not in reply.levels:
        raise ValueError(f"no understanding level in {reply.levels}")
    return float(reply.levels["understanding"])


def _echo_reward(*, judged: bool) -> Reward:
    metrics = [PureMetric("length", compute=lambda c: float(len(c.messages)), weight=1.0)]
    if judged:
        metrics.append(JudgeMetric("rated", op="interactivity", value=_understanding, weight=1.0))
    return Reward(metrics=tuple(metrics))


async def test_an_empty_reference_is_unscorable_only_for_a_reward_that_asks_the_judge():
    traj = _traj([ChatMessage("user", "hi"), ChatMessage("assistant", "hello")], reference="")
    scored = await score_trajectory(traj, None, ScorerConfig(), reward=_echo_reward(judged=False))
    assert scored.metrics == {"length": 2.0}
    with pytest.raises(Unscorable, match="no reference"):
        await score_trajectory(traj, NoJudge(), ScorerConfig(), reward=_echo_reward(judged=True))


async def test_a_pure_metric_that_cannot_read_the_conversation_is_unscorable_not_retried():
    traj = _traj([ChatMessage("user", "hi"), ChatMessage("assistant", "FINAL: size=large")], reference="not a goal")
    with pytest.raises(Unscorable, match="is not a hidden_goal goal"):
        await score_trajectory(traj, None, ScorerConfig(), reward=hidden_goal.environment(n_items=4).reward)


async def test_a_verdict_the_judge_metric_cannot_read_is_judge_failed():
    class Judge:
        async def ask(self, op, messages, *, seed=0):  # services.judge.client.Judge: one entry, by op
            return await getattr(self, op)(messages, seed=seed)

        async def interactivity(self, messages, *, seed=0):
            return JudgeReply(ok=True, levels={"clarification": 1}, model="double")

    traj = _traj([ChatMessage("user", "hi"), ChatMessage("assistant", "hello")], reference="ref")
    with pytest.raises(JudgeFailed, match="unusable.*understanding"):
        await score_trajectory(traj, Judge(), ScorerConfig(), reward=_echo_reward(judged=True))
