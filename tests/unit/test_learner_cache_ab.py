"""bench/learner_poison.py --cache-ab's verdict: keeping the GPU cache between steps "moves the steps"
when the first release run and the first keep_when_room run differ by more than 4x what two runs of one
setting differ by (the larger of the two), and not when they differ within it. The runs themselves
need CUDA (part K); here they are written out."""

from __future__ import annotations

import math

import pytest

from bench.learner_poison import cache_verdict, main


def run(mode: str, losses, fingerprint_shift: float = 0.0) -> dict:
    return {
        "gpu_cache": mode,
        "fill": f"gpu_cache={mode}",
        "steps": [
            {
                "loss": x,
                "grad_norm": 1.0,
                "entropy": 0.9,
                "skipped": 0.0,
                "fingerprint": [100.0 + fingerprint_shift, -3.0],
            }
            for x in losses
        ],
    }


def test_a_difference_within_what_repeats_differ_by_does_not_move_the_steps():
    runs = [
        run("release", [0.5, 0.4]),
        run("release", [0.5, 0.4 + 1e-3]),
        run("keep_when_room", [0.5, 0.4 + 2e-3]),
        run("keep_when_room", [0.5, 0.4]),
    ]
    v = cache_verdict(runs)
    # the noise is the larger pair's (keep's 2e-3, release's 1e-3)
    assert v["noise"]["loss"] == pytest.approx(2e-3) and v["diff"]["loss"] == pytest.approx(2e-3)
    assert v["cache_moves_steps"] is False


def test_a_difference_past_four_times_the_noise_or_a_nan_in_one_setting_moves_the_steps():
    far = [
        run("release", [0.5, 0.4]),
        run("release", [0.5, 0.4]),
        run("keep_when_room", [0.5, 0.4], fingerprint_shift=0.5),
        run("keep_when_room", [0.5, 0.4], 0.5),
    ]
    v = cache_verdict(far)
    assert v["noise"]["weights_rel"] == 0.0 and v["diff"]["weights_rel"] == pytest.approx(0.005)
    assert v["cache_moves_steps"] is True
    nan = [
        run("release", [0.5, 0.4]),
        run("release", [0.5, 0.4]),
        run("keep_when_room", [0.5, math.nan]),
        run("keep_when_room", [0.5, math.nan]),
    ]
    assert cache_verdict(nan)["cache_moves_steps"] is True


def test_the_cache_ab_is_refused_without_cuda_before_any_work(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the A/B would run")
    with pytest.raises(SystemExit) as e:
        main(["--cache-ab", "--model", "/nonexistent-model-dir"])
    assert e.value.code == 2 and "--cache-ab needs CUDA" in capsys.readouterr().err
