"""bench/gpu_run.sh part LP (issue 56: where the 4B LoRA learner's step goes) with test doubles for
python3 and nvidia-smi: the learner bench's two invocations at gpu-1-4b-lora.toml's step shape, each
bounded, and the few files the part leaves."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

from tests.factories import run_gpu_part

# test double of python3: records its arguments; writes what bench/learner_gpu.py would (--out's JSON and
# .md, a summary under --profile's folder)
FAKE_PYTHON = r"""#!/bin/bash
printf "%s|" "$@" >>"$STUB_LOG"; echo >>"$STUB_LOG"
prev=
for a in "$@"; do
    case "$prev" in
    --out) echo '{}' >"$a"; echo '| table |' >"${a%.json}.md" ;;
    --profile) mkdir -p "$a"; echo '{}' >"$a/profile_$RANDOM.json" ;;
    esac
    prev=$a
done
"""


def _run_lp(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]], Path]:
    res, lines, out = run_gpu_part(
        tmp_path, "LP", FAKE_PYTHON, "NVIDIA H100 80GB HBM3, 81559 MiB", LP_MODEL_DIR=str(tmp_path / "model"), **env
    )
    return res, [c.rstrip("|").split("|") for c in lines], out


def _opt(call: list[str], name: str) -> str:
    return call[call.index(name) + 1]


def test_part_lp_sweeps_compiled_micro_batches_then_eager_at_the_lora_configs_step(tmp_path):
    res, calls, out = _run_lp(tmp_path)
    assert res.returncode == 0, res.stderr
    sweep, eager = calls
    for c in (sweep, eager):
        assert c[0] == "bench/learner_gpu.py"
        # gpu-1-4b-lora.toml's step: 8 groups of 8 random_words conversations, its learner's settings
        assert (_opt(c, "--sequences"), _opt(c, "--seq-tokens"), _opt(c, "--seq-trained")) == ("64", "1816", "1536")
        assert (_opt(c, "--lora-rank"), _opt(c, "--kl-coef"), _opt(c, "--zero"), _opt(c, "--attn")) == (
            "16",
            "0",
            "2",
            "varlen",
        )
        assert _opt(c, "--model-dir") == str(tmp_path / "model")  # built once, loaded by the second
        assert _opt(c, "--profile") == str(out / "lp_profile") and "--skip-plain" in c
    assert _opt(sweep, "--compile") == "layers" and _opt(sweep, "--gradient-checkpointing") == "off,on"
    assert _opt(sweep, "--micro-batch-tokens") == "4096,8192"
    assert _opt(sweep, "--recompute-micro-batch-tokens") == "16384,32768"
    assert _opt(eager, "--compile") == "off" and _opt(eager, "--micro-batch-tokens") == "8192"
    # each bench stops inside its step's limit; the eager one in what the sweep left of LP_S (the test
    # doubles take no time: all of it)
    assert int(_opt(sweep, "--budget-s")) < 370 and int(_opt(eager, "--budget-s")) < 475
    assert "[gpu_run] lp_sweep: rc=0" in res.stdout and "[gpu_run] lp_eager: rc=0" in res.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["learner_lp.json", "learner_lp_eager.json", "lp_eager.log", "lp_profile.tgz", "lp_sweep.log"]
    with tarfile.open(out / "lp_profile.tgz") as tar:
        assert sum(n.endswith(".json") for n in tar.getnames()) == 2
    assert not (tmp_path / "model").exists()  # the 8 GB model does not outlive the part


def test_part_lp_skips_the_eager_run_when_too_little_time_is_left_and_takes_other_sizes(tmp_path):
    res, calls, out = _run_lp(tmp_path, LP_S="80", SWEEP_S="60", MBT="2048", GC_MBT="65536")
    assert res.returncode == 0, res.stderr
    (sweep,) = calls
    assert _opt(sweep, "--micro-batch-tokens") == "2048" and _opt(sweep, "--recompute-micro-batch-tokens") == "65536"
    assert _opt(sweep, "--budget-s") == "45"
    assert "lp_eager: skipped" in (out / "lp_eager.log").read_text()


def test_part_lp_second_run_takes_other_settings(tmp_path):
    """LP_SECOND replaces the eager run's settings: the last of an option given twice wins in argparse."""
    res, calls, _ = _run_lp(tmp_path, LP_SECOND="--compile layers --zero 0")
    assert res.returncode == 0, res.stderr
    second = calls[1]
    assert second[len(second) - 1 - second[::-1].index("--zero") + 1] == "0"
    assert second[len(second) - 1 - second[::-1].index("--compile") + 1] == "layers"
