"""Unit tests for rewards.diagnostics: per-term statistics and the no-signal monitor."""

import math

import pytest

from parley.rewards.diagnostics import SignalMonitor, TermStats, step_diagnostics


def _word_count_term(words: int) -> float:
    # The users' length term: raw word count times -0.1, clamped to [-1, 1].
    return max(-1.0, min(1.0, -0.1 * words))


def _user_step(step: int) -> tuple[list[list[dict[str, float]]], list[list[float]]]:
    """4 prompts x 4 samples; documents of 40..900 words, BLEU varying within groups."""
    groups, totals = [], []
    for g in range(4):
        group, row = [], []
        for i in range(4):
            words = 40 + 60 * i + 100 * g + 7 * step
            terms = {
                "bleu": 0.2 + 0.08 * i + 0.01 * g + 0.005 * step,
                "length": _word_count_term(words),
            }
            group.append(terms)
            row.append(sum(terms.values()))
        groups.append(group)
        totals.append(row)
    return groups, totals


def test_saturated_length_term_is_flagged_and_bleu_is_not():
    monitor = SignalMonitor(window=5, min_std=1e-3)
    for step in range(5):
        stats = step_diagnostics(*_user_step(step))
        assert stats["length"].mean == pytest.approx(-1.0)
        assert stats["length"].within_group_std == 0.0
        assert stats["length"].corr_with_total == 0.0  # constant: nan-safe 0
        assert stats["bleu"].within_group_std > 1e-3
        flagged = monitor.update(stats)
        # Flat since the first step: flagged from that step on, not only after the window.
        assert flagged == ["length"]
    report = monitor.report()
    assert report["length"] == {"no_signal": True, "steps_flat": 5, "steps_seen": 5, "steps_with_signal": 0}
    assert report["bleu"] == {"no_signal": False, "steps_flat": 0, "steps_seen": 5, "steps_with_signal": 5}


def test_flat_run_resets_when_term_varies_again():
    monitor = SignalMonitor(window=2, min_std=0.01)
    flat = {"x": TermStats(mean=0.0, within_group_std=0.0, corr_with_total=0.0)}
    varied = {"x": TermStats(mean=0.0, within_group_std=0.5, corr_with_total=0.3)}
    assert monitor.update(varied) == []
    assert monitor.update(flat) == []  # it carried signal before: one flat step is not enough
    assert monitor.update(flat) == ["x"]  # the whole window flat
    assert monitor.update(varied) == []
    assert monitor.report()["x"] == {"no_signal": False, "steps_flat": 0, "steps_seen": 4, "steps_with_signal": 2}


def test_a_term_dead_for_every_step_of_a_short_run_is_flagged_on_each_step():
    # The embedded default's 3-step run: BLEU 0.0 for every sample, interactivity varying.
    monitor = SignalMonitor()  # the learner's window of 5 is never reached in 3 steps
    dead = TermStats(mean=0.0, within_group_std=0.0, corr_with_total=0.0)
    alive = TermStats(mean=0.4, within_group_std=0.1, corr_with_total=0.9)
    for _ in range(3):
        assert monitor.update({"bleu": dead, "interactivity": alive}) == ["bleu"]
    assert monitor.report()["bleu"]["no_signal"] and not monitor.report()["interactivity"]["no_signal"]


def test_hand_case_statistics():
    # term a over samples: [1, 2 | 3, 4]; totals [1, 3 | 2, 4].
    # Pearson: dx = [-1.5, -.5, .5, 1.5], dy = [-1.5, .5, -.5, 1.5] -> 4 / 5 = 0.8.
    groups = [
        [{"a": 1.0, "c": 5.0}, {"a": 2.0, "c": 5.0}],
        [{"a": 3.0, "c": 5.0}, {"a": 4.0, "c": 5.0}],
    ]
    totals = [[1.0, 3.0], [2.0, 4.0]]
    stats = step_diagnostics(groups, totals)
    assert stats["a"].mean == pytest.approx(2.5)
    assert stats["a"].within_group_std == pytest.approx(0.5)  # population std 0.5 in each group
    assert stats["a"].corr_with_total == pytest.approx(0.8)
    assert stats["c"] == TermStats(mean=5.0, within_group_std=0.0, corr_with_total=0.0)


def test_correlation_sign_and_constant_total():
    groups = [[{"up": 1.0, "down": 3.0}, {"up": 2.0, "down": 2.0}, {"up": 3.0, "down": 1.0}]]
    stats = step_diagnostics(groups, [[2.0, 4.0, 6.0]])
    assert stats["up"].corr_with_total == pytest.approx(1.0)
    assert stats["down"].corr_with_total == pytest.approx(-1.0)
    # Constant totals (a zero-advantage step): correlation is 0, not nan.
    stats = step_diagnostics(groups, [[1.0, 1.0, 1.0]])
    assert stats["up"].corr_with_total == 0.0
    assert not math.isnan(stats["down"].corr_with_total)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        step_diagnostics([[{"a": 1.0}]], [[1.0, 2.0]])
    with pytest.raises(ValueError):
        step_diagnostics([[{"a": 1.0}], [{"b": 1.0}]], [[1.0], [1.0]])
    with pytest.raises(ValueError):
        SignalMonitor(window=0)


def test_a_dead_term_of_a_3_step_run_shows_in_the_closing_table_and_the_live_view(tmp_path):
    # What the learner writes per step (learner.stepper: metrics() -> metrics.jsonl, live_counters for
    # the heartbeat) and what `parley up` prints at the end (deploy.up.summary_text).
    import json

    from parley.deploy.up import summary_text
    from parley.learner.stepper import live_counters

    monitor = SignalMonitor()
    dead = TermStats(mean=0.0, within_group_std=0.0, corr_with_total=0.0)
    alive = TermStats(mean=0.4, within_group_std=0.1, corr_with_total=0.9)
    rows = []
    for step in range(1, 4):
        stats = {"bleu": dead, "interactivity": alive}
        rows.append(
            {
                "step": step,
                "version": step,
                "reward_mean": 0.4,
                "no_signal_terms": monitor.update(stats),
                "reward_terms": {
                    k: {"mean": v.mean, "within_group_std": v.within_group_std, "corr_with_total": v.corr_with_total}
                    for k, v in stats.items()
                },
            }
        )
        assert live_counters(rows[-1])["reward.bleu.NO_SIGNAL"] == 1.0
        assert "reward.interactivity.NO_SIGNAL" not in live_counters(rows[-1])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = summary_text(tmp_path).splitlines()
    body = [line for line in table if line.startswith("| ") and line[2].isdigit()]
    assert len(body) == 3 and all(line.rstrip(" |").endswith("bleu") for line in body)
