"""bench/step_match.py's comparison math, without TRL or a model: cosine / norm ratio / max diff of two
updates, per tensor and overall, the clip factor, AdamW's first step and the per-sample regrouping."""

from __future__ import annotations

import math

import pytest
import torch

from bench import step_match


def test_compare_same_scaled_and_opposite():
    a = torch.tensor([3.0, 4.0])
    same = step_match.compare(a, a.clone())
    assert same["cos"] == pytest.approx(1.0) and same["ratio"] == pytest.approx(1.0) and same["max_abs"] == 0.0
    half = step_match.compare(a, a / 2)
    assert half["cos"] == pytest.approx(1.0) and half["ratio"] == pytest.approx(0.5) and half["max_abs"] == 2.0
    assert half["rel"] == pytest.approx(0.5)
    assert step_match.compare(a, -a)["cos"] == pytest.approx(-1.0)
    assert step_match.compare(torch.zeros(2), torch.zeros(2))["ratio"] == 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        step_match.compare(a, torch.zeros(3))


def test_compare_dicts_overall_and_worst():
    a = {"x": torch.tensor([1.0, 0.0]), "y": torch.tensor([[0.0, 2.0]])}
    b = {"x": torch.tensor([1.0, 0.0]), "y": torch.tensor([[2.0, 0.0]])}  # y orthogonal
    out = step_match.compare_dicts(a, b)
    assert out["worst"] == "y" and out["worst_cos"] == pytest.approx(0.0)
    assert out["per_tensor"]["x"]["cos"] == pytest.approx(1.0)
    # overall: a = (1, 0, 0, 2), b = (1, 0, 2, 0): cos = 1 / 5
    assert out["overall"]["cos"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="names differ"):
        step_match.compare_dicts(a, {"x": a["x"]})


def test_deltas_and_clip_coef():
    d = step_match.deltas({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.5, 1.0])})
    assert d["w"].tolist() == [0.5, -1.0] and d["w"].dtype == torch.float64
    assert step_match.clip_coef(0.5, 1.0) == 1.0
    assert step_match.clip_coef(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)
    assert step_match.clip_coef(4.0, 0.0) == 1.0  # no clipping configured


def test_adam_first_update_is_torch_adamw_and_scale_free():
    g = torch.tensor([1e-3, -2.0, 5e-9, 0.0], dtype=torch.float64)
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    p.grad = g.clone()
    opt.step()
    pred = step_match.adam_first_update(g, 1e-4)
    torch.testing.assert_close(pred, p.detach())
    # a gradient 10x larger moves the weights the same, but for entries near eps
    pred10 = step_match.adam_first_update(10 * g, 1e-4)
    assert pred10[:2].tolist() == pytest.approx(pred[:2].tolist(), rel=1e-4)


def test_per_sample_lists_and_diff():
    vals, seq = [0.1, 0.2, 0.3, 0.4], [1, 0, 1, 1]
    lists = step_match.per_sample_lists(vals, seq, 3)
    assert lists == [[0.2], [0.1, 0.3, 0.4], []]
    assert step_match.max_list_diff(lists, [[0.25], [0.1, 0.3, 0.4], []]) == pytest.approx(0.05)
    assert math.isinf(step_match.max_list_diff(lists, [[0.2], [0.1], []]))
