"""Unit tests for evaluation.leakage: a planted overlap between two small JSONL files is found, refused
without --allow-overlap, and recorded in run_dir/overlap.json when allowed."""

import json

import pytest

from parley.evaluation.leakage import OVERLAP_FILE, LeakageError, guard_overlap
from parley.tasks.data import load_items, split_items


def row(conv_id, prompt, reference):
    return {
        "conv_id": conv_id,
        "turn_id": 0,
        "prompt": [{"role": "user", "content": prompt}],
        "single_turn_prompt": prompt,
        "single_turn_completion": reference,
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def planted(tmp_path):
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [
            row("t0", "write a post about bees", "Bees\n\nBees make honey in summer."),
            row("t1", "a speech for the garden", "Garden speech\n\nThank you all for coming."),
            row("t2", "notes on bread", "Bread\n\nFlour, water, salt and time."),
        ],
    )
    held = write_jsonl(
        tmp_path / "eval.jsonl",
        [
            # The same reference as t0 up to case, spacing and punctuation: a leak.
            row("e0", "tell people about bees", "BEES\n\nbees   make honey, in summer"),
            # The same prompt as t2 but another target: reported, not a leak.
            row("e1", "notes on bread", "Rye\n\nA darker loaf."),
            row("e2", "a cover letter", "Dear team\n\nI would like to apply."),
        ],
    )
    return load_items(train), load_items(held)


def test_planted_overlap_is_refused_with_counts_and_flag(tmp_path):
    train, held = planted(tmp_path)
    with pytest.raises(LeakageError) as e:
        guard_overlap(train, held, allow=False, run_dir=tmp_path / "run")
    msg = str(e.value)
    assert "share 1 reference targets and 1 prompts" in msg
    assert "train t0/0 = eval e0/0" in msg and "--allow-overlap" in msg
    assert not (tmp_path / "run" / OVERLAP_FILE).exists()


def test_allowed_overlap_is_recorded(tmp_path):
    train, held = planted(tmp_path)
    overlap = guard_overlap(train, held, allow=True, run_dir=tmp_path / "run")
    assert overlap.references == [("t0/0", "e0/0")] and overlap.prompts == [("t2/0", "e1/0")]
    saved = json.loads((tmp_path / "run" / OVERLAP_FILE).read_text())
    assert saved["references"] == [["t0/0", "e0/0"]] and saved["prompts"] == [["t2/0", "e1/0"]]
    assert saved["train_items"] == 3 and saved["eval_items"] == 3


def test_prompt_overlap_alone_passes_and_is_recorded(tmp_path):
    train, held = planted(tmp_path)
    overlap = guard_overlap(train, held[1:], allow=False, run_dir=tmp_path / "run")
    assert not overlap.leaks and overlap.prompts == [("t2/0", "e1/0")]
    assert json.loads((tmp_path / "run" / OVERLAP_FILE).read_text())["references"] == []


def test_bundled_per_reference_split_is_clean(tmp_path):
    train, held = split_items(load_items("bundled"), 0.25, seed=0)
    overlap = guard_overlap(train, held, allow=False, run_dir=tmp_path)
    assert not overlap.references and not overlap.prompts
    assert not (tmp_path / OVERLAP_FILE).exists()
