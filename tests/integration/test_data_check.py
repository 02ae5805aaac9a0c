"""`parley data check` as a user runs it (a real subprocess), and `parley replay --stream` reading
eval records and scored trajectories stored on a real nats-server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parley.protocol import topology
from parley.protocol.bus import publish
from tests.unit.test_benchmark_evallog import eval_record, scored

pytestmark = pytest.mark.integration
PARLEY = [sys.executable, "-m", "parley.deploy.cli"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def row(conv_id, prompt, reference):
    return {
        "conv_id": conv_id,
        "turn_id": 0,
        "prompt": [{"role": "user", "content": prompt}],
        "single_turn_prompt": prompt,
        "single_turn_completion": reference,
    }


def test_data_check_exits_1_naming_a_planted_overlap(tmp_path):
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [
            row("t0", "write about bees", "Bees\n\nBees make honey in summer."),
            row("t1", "notes on bread", "Bread\n\nFlour, water, salt and time."),
        ],
    )
    held = write_jsonl(
        tmp_path / "eval.jsonl",
        [
            row("e0", "a post about bees", "Bees.\n\nBees make honey   in summer!"),
            row("e1", "a cover letter", "Dear team\n\nI would like to apply."),
        ],
    )
    out = subprocess.run(
        [*PARLEY, "data", "check", "--train", train, "--eval", held], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 shared reference targets, 0 shared prompts" in out.stdout
    assert "train t0/0 = eval e0/0" in out.stdout
    assert out.stderr.startswith("parley data check: 1 reference targets of") and "eval.jsonl" in out.stderr

    clean = write_jsonl(tmp_path / "clean.jsonl", [row("e1", "notes on bread", "Rye\n\nA darker loaf.")])
    out = subprocess.run(
        [*PARLEY, "data", "check", "--train", train, "--eval", clean], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "0 shared reference targets, 1 shared prompts" in out.stdout

    out = subprocess.run(
        [*PARLEY, "data", "check", "--eval", str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "nope.jsonl does not exist" in out.stderr


async def test_replay_reads_eval_and_scored_streams(js, nats_server):
    run = "replaytest"
    await topology.ensure_topology(js, run)
    for k in range(3):
        await publish(js, run, "eval", eval_record("base", k, inter=0.5))
        await publish(js, run, "eval", eval_record("proactive", k, inter=0.9))
    await publish(js, run, "scored", scored(version=2))
    args = ["replay", "--nats", nats_server.url, "--run", run]
    out = subprocess.run(
        [*PARLEY, *args, "--stream", "eval", "--baseline", "base"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "| proactive | 3 |" in out.stdout and "6 conversations" in out.stdout
    assert "| proactive | interactivity | +0.4000 |" in out.stdout
    out = subprocess.run([*PARLEY, *args, "--stream", "scored"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| v2 | 1 |" in out.stdout
