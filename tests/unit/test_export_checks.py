"""`parley export` checks a version's safetensors header before it writes anything (issue 57): a file
cut short or with a damaged header is refused in one line naming the file and the fix, and the output
directory is not created. Before, export copied the damaged file on (or handed it to the merge) and a
loader failed on it later, far from the cause. The files are the learner's own (WeightSnapshot, the
adapter writer), damaged afterwards."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parley.learner import checkpoint as ckpt
from parley.weights import lora
from parley.weights.snapshot import WeightSnapshot

REPO = Path(__file__).resolve().parents[2]


def run_with_versions(tmp_path) -> Path:
    """A run whose version 1 holds whole weights and version 2 a LoRA adapter, as the learner writes them."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (base / "tokenizer.json").write_text("{}")
    run_dir = tmp_path / "run"
    ckpt.record_base_model(run_dir, base)
    weights = {"model.embed_tokens.weight": torch.arange(24.0).reshape(6, 4), "model.norm.weight": torch.ones(4)}
    WeightSnapshot(weights, json.dumps({"model_type": "llama"})).write(ckpt.weights_dir(run_dir, 1))
    adapter = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4)}
    lora.write_adapter(adapter, {"r": 2, "peft_type": "LORA"}, ckpt.weights_dir(run_dir, 2))
    return run_dir


def header_of(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def cut_short(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 10)  # a copy or an upload that stopped before the end


def cut_in_the_header(path: Path) -> None:
    os.truncate(path, 20)


def header_overwritten(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:16] = b"\x00\xff" * 4
    path.write_bytes(bytes(raw))


def length_overwritten(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(raw))


def offsets_past_the_end(path: Path) -> None:
    """A header rewritten in place (same length) whose last tensor claims bytes the file does not hold."""
    n, header = header_of(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"][1] += 4  # the same number of digits: the header keeps its length
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n :])


DAMAGE = {
    "cut short": (cut_short, "past its end"),
    "cut in the header": (cut_in_the_header, "header length"),
    "header overwritten": (header_overwritten, "header is not JSON"),
    "length overwritten": (length_overwritten, "header length 1099511627776 beyond"),
    "offsets past the end": (offsets_past_the_end, "past its end"),
}


def test_the_learners_own_files_pass(tmp_path):
    run_dir = run_with_versions(tmp_path)
    assert ckpt.check_safetensors(ckpt.weights_dir(run_dir, 1) / "model.safetensors") is None
    assert ckpt.check_safetensors(ckpt.weights_dir(run_dir, 2) / "model.safetensors") is None
    out = ckpt.export_version(run_dir, 1, tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == (ckpt.weights_dir(run_dir, 1) / "model.safetensors").read_bytes()


@pytest.mark.parametrize("version", [1, 2], ids=["weights", "adapter"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_version_is_refused_before_anything_is_written(tmp_path, damage, version):
    run_dir = run_with_versions(tmp_path)
    path = ckpt.weights_dir(run_dir, version) / "model.safetensors"
    harm, why = DAMAGE[damage]
    harm(path)
    out = tmp_path / "out"
    with pytest.raises(ckpt.CorruptWeights) as e:
        ckpt.export_version(run_dir, version, out)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and why in msg, msg
    assert "Restore the file from a copy, or export another version (kept: [0, 1, 2])" in msg
    assert not out.exists()


def test_a_damaged_base_is_refused_for_version_0(tmp_path):
    run_dir = run_with_versions(tmp_path)
    base = ckpt.base_model(run_dir)
    WeightSnapshot({"w": torch.ones(3)}, "{}").write(base)
    cut_short(base / "model.safetensors")
    with pytest.raises(ckpt.CorruptWeights, match="past its end"):
        ckpt.export_version(run_dir, 0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parley_export_refuses_in_one_line(tmp_path):
    run_dir = run_with_versions(tmp_path)
    path = ckpt.weights_dir(run_dir, 1) / "model.safetensors"
    cut_short(path)
    proc = subprocess.run(
        [sys.executable, "-m", "parley.deploy.cli", "export", str(run_dir), str(tmp_path / "out"), "--version", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("parley export:")]
    assert len(lines) == 1 and str(path) in lines[0] and "Restore the file from a copy" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
