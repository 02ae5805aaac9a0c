"""diagnose_groups on Scored groups: the users' saturated length term is flagged, a healthy term is not."""

from __future__ import annotations

import pytest

from parley.protocol.messages import Scored
from parley.rewards.diagnostics import SignalMonitor, diagnose_groups
from parley.rewards.reward import total_reward
from tests import factories

# The users' story: raw word count x -0.1, clamped to [-1, 1]. As a metric clamp that is
# words clamped to [-10, 10] before the -0.1 weight: any document over 10 words sits at -1.
WEIGHTS = {"bleu": 1.0, "length": -0.1}
CLAMPS = {"length": [-10.0, 10.0]}


def _scored(g: int, i: int, step: int, clamps=CLAMPS) -> Scored:
    """A Scored as the scorer writes it: the total under the clamps, and the clamps it recorded."""
    traj = factories.trajectory("diag", task_id=f"s{step}-g{g}", sample=i)
    metrics = {"bleu": 0.2 + 0.08 * i + 0.01 * g, "length": float(40 + 60 * i + 100 * g + 7 * step)}
    bounds = {k: (lo, hi) for k, (lo, hi) in clamps.items()}
    return factories.scored(traj, metrics, WEIGHTS, total=total_reward(metrics, WEIGHTS, bounds), clamps=dict(clamps))


def test_saturated_length_term_in_scored_groups_is_flagged_and_bleu_is_not():
    monitor = SignalMonitor(window=3, min_std=1e-3)
    for step in range(3):
        groups = [[_scored(g, i, step) for i in range(4)] for g in range(4)]
        stats = diagnose_groups(groups)  # the clamps each Scored recorded
        assert stats["length"].mean == pytest.approx(-1.0)
        assert stats["length"].within_group_std == 0.0
        assert stats["bleu"].within_group_std == pytest.approx(0.08 * (5**0.5) / 2)  # std of 0, .08, .16, .24
        assert stats["bleu"].corr_with_total == pytest.approx(1.0)  # the total moves only with bleu
        flagged = monitor.update(stats)
    assert flagged == ["length"]


def test_without_the_clamp_the_length_term_varies():
    groups = [[_scored(g, i, 0, clamps={}) for i in range(4)] for g in range(2)]
    stats = diagnose_groups(groups)  # the unclamped term: -0.1 x words differs inside each group
    assert stats["length"].within_group_std > 1.0


def test_scored_samples_with_different_weights_are_rejected():
    a, b = _scored(0, 0, 0), _scored(0, 1, 0)
    b.weights = {"bleu": 1.0}
    with pytest.raises(ValueError, match="terms"):
        diagnose_groups([[a, b]])
