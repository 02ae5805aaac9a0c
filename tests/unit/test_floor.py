"""bench/floor.py: the floor of docs/gpu.md's workload, against the figures worked out by hand there."""

import json

from bench.floor import Workload, floor, main, params
from parley.engines.models import MODEL_SHAPES


def test_qwen3_4b_parameter_count_is_the_published_one():
    # Qwen3-4B's model card: 4.0B parameters; the plan's 4022.5M (tied embeddings counted once)
    assert params(MODEL_SHAPES["Qwen/Qwen3-4B"]) == 4_022_468_096


def test_the_doc_workload_floor_on_each_card():
    # docs/gpu.md: 1.50 PFLOP a step, 768 decode steps of 17.0 GB; 1.51 s + 3.90 s (H100), + 2.73 s (H200)
    h100, h200 = floor(Workload(), "h100"), floor(Workload(), "h200")
    assert h100["trained_tokens_per_step"] == 49_152 and h100["all_tokens_per_step"] == 58_112
    assert abs(h100["training_flop_per_step"] / 1e15 - 1.496) < 1e-3
    assert h100["decode_steps_per_step"] == 768 and h100["bytes_per_decode_step_gb"] == 17.03
    assert (h100["train_s"], h100["decode_s"], h200["decode_s"]) == (1.512, 3.904, 2.725)
    assert abs(h100["floor_trained_tokens_per_s"] - 9_076) <= 2
    assert abs(h200["floor_trained_tokens_per_s"] - 11_602) <= 2


def test_a_larger_decode_batch_and_lora_raise_the_floor():
    base = floor(Workload(), "h100")["floor_trained_tokens_per_s"]
    wide = floor(Workload(groups=8, batch=128), "h100")
    lora = floor(Workload(groups=8, batch=128, lora=True), "h100")
    assert base < wide["floor_trained_tokens_per_s"] < lora["floor_trained_tokens_per_s"]
    assert lora["decode_s"] == wide["decode_s"] and lora["train_s"] < wide["train_s"]


def test_cli_writes_both_cards(tmp_path, capsys):
    out = tmp_path / "f.json"
    assert main(["--groups", "8", "--batch", "128", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["cards"]) == {"h100", "h200"}
