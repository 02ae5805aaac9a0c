"""The learner refuses to start when its eval items share reference targets with its training items."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _write(path, docs):
    rows = [
        {
            "conv_id": f"{path.stem}-{i}",
            "turn_id": 0,
            "prompt": [{"role": "user", "content": f"help me write {i}"}],
            "single_turn_prompt": f"write doc {i}",
            "single_turn_completion": d,
            "single_turn_metadata": {"title": f"T{i}"},
        }
        for i, d in enumerate(docs)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_learner_refuses_planted_overlap_and_allows_it_only_when_asked(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    _write(train, ["A first document about tides.", "A second one, about bread."])
    _write(held, ["a first document about TIDES", "Something else entirely."])  # same target after normalization
    base = [
        sys.executable,
        "-m",
        "parley.deploy.cli",
        "learner",
        "--set",
        f'data.path="{train}"',
        "--set",
        f'data.eval_path="{held}"',
        "--set",
        f'run.dir="{tmp_path / "run"}"',
    ]
    out = subprocess.run(
        [*base, "--nats", "nats://127.0.0.1:1", "--set", "nats.connect_timeout_s=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "share 1 reference targets" in out.stderr and "--allow-overlap" in out.stderr
    assert not (tmp_path / "run" / "overlap.json").exists()

    # Allowed: it gets past the guard (then fails to reach NATS), and the overlap is recorded in the run.
    out = subprocess.run(
        [*base, "--allow-overlap", "--nats", "nats://127.0.0.1:1", "--set", "nats.connect_timeout_s=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 3, out.stderr
    assert json.loads((tmp_path / "run" / "overlap.json").read_text())
