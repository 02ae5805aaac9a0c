"""deploy/report.py's charts as figure objects: KL and entropy each on their own y axis, the eval with
95% confidence intervals (error bars) and a y label per column, a label with its unit on every axis."""

import math

import pytest
from matplotlib.container import ErrorbarContainer

from parley.deploy import report
from parley.evaluation.benchmark import mean_interval
from parley.evaluation.selection import VersionEval

ROWS = [
    {"step": s, "kl_mean": 0.0001 * s, "entropy": 3.0 - 0.01 * s, "loss": 0.02 / s, "clip_frac": 0.01 * s}
    for s in (1, 2, 3)
]


def test_kl_and_entropy_on_their_own_axes():
    fig = report.optim_figure(ROWS, title="t")
    axes = fig.get_axes()
    by_label = {ax.get_ylabel(): ax for ax in axes}
    kl = next(ax for label, ax in by_label.items() if label.startswith("KL"))
    ent = next(ax for label, ax in by_label.items() if label.startswith("policy entropy"))
    assert kl is not ent
    # each axis' range is its own quantity's: KL's top is near 0.0003, not entropy's 3
    assert kl.get_ylim()[1] < 0.001 and ent.get_ylim()[0] > 2.5
    assert [line.get_label() for line in kl.get_lines()] == ["kl_mean"]
    assert [line.get_label() for line in ent.get_lines()] == ["entropy"]
    assert all("nats" in ax.get_ylabel() for ax in (kl, ent))
    assert len(axes) == 4 and all(ax.get_ylabel() for ax in axes)
    assert any(ax.get_xlabel() == "training step" for ax in axes)


def test_a_panel_without_data_is_left_out():
    fig = report.optim_figure([{"step": 1, "kl_mean": 0.0, "entropy": 2.9}], title="t")
    assert len(fig.get_axes()) == 2
    # entropy alone (no KL in the rows): on the left axis, labelled, no empty axis beside it
    [ax] = report.optim_figure([{"step": 1, "entropy": 2.9}], title="t").get_axes()
    assert ax.get_ylabel().startswith("policy entropy") and ax.get_xlabel() == "training step"
    assert report.optim_figure([{"step": 1, "reward_mean": 0.5}], title="t") is None


def test_eval_has_intervals_and_labels():
    evals = [
        VersionEval(version=v, items={f"i{k}": {"bleu": 0.1 * v + 0.05 * k, "tokens_k": 1.0 + k} for k in range(4)})
        for v in (0, 1, 2)
    ]
    series = report.eval_series(evals, ("bleu", "tokens_k"))
    mean, lo, hi = mean_interval([0.1 + 0.05 * k for k in range(4)])
    assert series["bleu"][1] == (1, pytest.approx(mean), pytest.approx(lo), pytest.approx(hi))
    fig = report.eval_figure(series, title="t")
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["bleu", "tokens_k (thousand tokens)"]
    assert axes[-1].get_xlabel() == "policy version"
    for ax in axes:
        [bars] = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert bars.has_yerr
    # the drawn error bar spans the interval: its segment's y extent is [lo, hi]
    [bars] = [c for c in axes[0].containers if isinstance(c, ErrorbarContainer)]
    segment = bars.lines[2][0].get_segments()[1]
    assert [y for _, y in segment] == [pytest.approx(lo), pytest.approx(hi)]


def test_a_single_item_eval_draws_no_bar_but_still_draws():
    evals = [VersionEval(version=0, items={"i0": {"bleu": 0.3}})]
    series = report.eval_series(evals, ("bleu",))
    assert math.isnan(series["bleu"][0][2])
    assert report.eval_figure(series, title="t").get_axes()[0].get_ylabel() == "bleu"


def test_rewards_axes_are_labelled():
    fig = report.rewards_figure(report.reward_series([{"step": 1, "reward_mean": 0.5}]), title="t")
    [ax] = fig.get_axes()
    assert ax.get_xlabel() == "training step" and ax.get_ylabel()
