"""The learner on two ranks (CPU, gloo, under torch.distributed.run) with ZeRO-2 and ZeRO-3: the ranks'
shards hold different numbers of trained tokens, hence of lm_head chunks, which under ZeRO-3 are
collectives (the run used to abort with "collective mismatch" on gloo and hang on NCCL). The step's
gradient norm equals that of the whole batch computed in one plain pass, and both stages train the
same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.ranks_step import step_samples
from tests.e2e.test_learner_train import whole_batch_grad_norm

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SCRIPT = Path(__file__).with_name("ranks_step.py")


def free_port() -> int:
    import socket

    with socket.socket() as sock:  # torch.distributed.run's static rendezvous needs a real port (0 hangs)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_tails(res: subprocess.CompletedProcess, logs: Path) -> str:
    """torch.distributed.run's own tail (which rank failed, with which exit code or signal), then the
    tail of each rank's stderr (where a C++ abort such as "terminate called ..." is written)."""
    parts = [f"torch.distributed.run exited {res.returncode}:\n{res.stdout[-1000:]}{res.stderr[-3000:]}"]
    for log in sorted(logs.glob("*/attempt_*/*/stderr.log")):
        parts.append(f"--- rank {log.parent.name}, end of stderr ---\n{log.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts)


def two_ranks(model_dir, zero: int, out: Path) -> dict:
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    logs = out / "logs"  # each rank's stdout and stderr in its own files (--redirects 3)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "--log-dir",
            str(logs),
            "--redirects",
            "3",
            str(SCRIPT),
            str(model_dir),
            str(zero),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
    )
    assert res.returncode == 0, rank_tails(res, logs)
    return json.loads((out / "stats.json").read_text())


def test_two_ranks_zero2_and_zero3_train_the_whole_batch(tiny_model, tmp_path):
    from safetensors.torch import load_file

    expected = whole_batch_grad_norm(tiny_model, step_samples())
    weights = {}
    for zero in (2, 3):
        stats = two_ranks(tiny_model, zero, tmp_path / f"z{zero}")
        assert stats["grad_norm"] == pytest.approx(expected, rel=1e-4), zero
        assert stats["state_dict_sizes"][0] > 0 and stats["state_dict_sizes"][1] == 0, stats["state_dict_sizes"]
        weights[zero] = load_file(tmp_path / f"z{zero}" / "weights" / "model.safetensors")
    assert set(weights[2]) == set(weights[3])
    for k in weights[2]:
        torch.testing.assert_close(
            weights[3][k], weights[2][k], rtol=1e-4, atol=2e-5
        )  # AdamW magnifies fp noise where a gradient is ~0; steps are 1e-3
