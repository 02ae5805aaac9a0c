"""Datasets by Hugging Face Hub id (issues 59 item 1, 60 item 2): `data.path = "ORG/NAME[@REV][#SPLIT]"`
reads a Hub dataset's Parquet files (the public collabllm-multiturn-medium schema) through the local
HF cache with no network (HF_HUB_OFFLINE=1 throughout), one row per reference document, and the
leakage guard refuses a train and an eval id that share a document. The cache is laid out by the test
(datasets--ORG--NAME/snapshots/<rev>/data/<split>-00000-of-00001.parquet + refs/main) around a
Parquet file it writes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
REV = "89abcdef0123456789abcdef0123456789abcdef"
DATASET = "collabllm/collabllm-multiturn-medium"
DOC_A = "Dear team,\nThe launch moves to Friday. Please send your slides by Thursday noon."
DOC_B = "The mill was built beside the river in 1852 and is a museum today."


def row(conv: str, turn: int, doc: str, turns: int) -> dict:
    """One row of the public schema: the conversation's first `turns` messages as the prefix."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{conv} message {i}"} for i in range(turns)]
    return {
        "prompt": msgs,
        "single_turn_prompt": f"write it ({conv})",
        "single_turn_completion": doc,
        "single_turn_metadata": json.dumps({"title": conv}),
        "conv_id": conv,
        "turn_id": turn,
    }


def lay_out_dataset(hf_home: Path, repo: str, splits: dict[str, list[dict]], rev: str = REV) -> Path:
    """A Hub cache holding `repo` as a dataset repository at commit `rev` (refs/main pointing at it),
    one Parquet file per split in the Hub's layout."""
    d = hf_home / "hub" / f"datasets--{repo.replace('/', '--')}"
    snap = d / "snapshots" / rev
    (snap / "data").mkdir(parents=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), snap / "data" / f"{split}-00000-of-00001.parquet")
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(rev)
    return snap


# Document A's conversation has three rows (one per turn prefix, listed longest first so that row
# order cannot pick the kept one); document B's has one.
TRAIN = [row("a", 2, DOC_A, 5), row("a", 1, DOC_A, 3), row("a", 0, DOC_A, 1), row("b", 0, DOC_B, 1)]
TEST = [row("c", 0, "A different document entirely, about bread.", 1), row("c", 1, DOC_B, 3)]


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """HF_HOME at a fresh folder, offline; huggingface_hub reads its cache folder from constants."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home


def test_an_id_in_the_cache_loads_one_item_per_document(hf_cache, caplog):
    from parley.tasks.data import load_items

    lay_out_dataset(hf_cache, DATASET, {"train": TRAIN, "test": TEST})
    with caplog.at_level(logging.INFO, logger="parley.tasks.data"):
        items = load_items(DATASET)
    assert [it.item_id for it in items] == ["a/0", "b/0"]  # the shortest prefix of A's conversation
    assert [len(it.prefix) for it in items] == [1, 1]
    assert items[0].reference == DOC_A and items[0].title == "a"
    assert "4 rows, 2 reference documents: dropped 2 rows" in caplog.text
    # a revision and a split by name
    assert [it.item_id for it in load_items(f"{DATASET}@{REV}#test")] == ["c/0", "c/1"]
    assert len(load_items(DATASET, dedupe=False)) == 4


def test_an_id_in_no_cache_is_one_line_naming_it_and_the_fix(hf_cache):
    from parley.tasks.data import DataNotFound, load_items

    with pytest.raises(DataNotFound) as e:
        load_items(DATASET)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"dataset {DATASET!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in msg
    assert f"huggingface-cli download --repo-type dataset {DATASET}" in msg


def test_an_unknown_split_names_the_splits_there(hf_cache):
    from parley.tasks.data import DataNotFound, load_items

    lay_out_dataset(hf_cache, DATASET, {"train": TRAIN})
    with pytest.raises(DataNotFound, match=r"no Parquet files of split 'validation' \(its splits: \['train'\]\)"):
        load_items(f"{DATASET}#validation")


def test_paths_stay_paths(tmp_path, monkeypatch):
    from parley.tasks.data import hub_dataset

    monkeypatch.chdir(tmp_path)
    assert hub_dataset("org/name") == ("org/name", None, "train")
    assert hub_dataset("org/name@v1#test") == ("org/name", "v1", "test")
    assert hub_dataset("data/medium.parquet") is None  # a missing file is told as a missing file
    assert hub_dataset("bundled") is None and hub_dataset("/abs/x") is None
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").write_text("")
    assert hub_dataset("org/name") is None  # a local path of the same spelling wins


def test_a_train_and_an_eval_id_sharing_a_document_are_refused(hf_cache):
    """The learner's start check (learner.service.check_leakage -> evaluation.leakage.guard_environment),
    unchanged, on data loaded by id: document B is in both splits."""
    from parley.config.run import load_config
    from parley.learner.service import check_leakage

    lay_out_dataset(hf_cache, DATASET, {"train": TRAIN, "test": TEST})
    cfg = load_config(None, [f'data.path="{DATASET}"', f'data.eval_path="{DATASET}#test"'])
    problem = check_leakage(cfg)
    assert problem is not None and "share 1 reference targets" in problem and "train b/0 = eval c/1" in problem


def parley(*args: str, hf_home: Path, timeout: float = 90.0):
    code = "import sys; sys.argv[0] = 'parley'; from parley.deploy.cli import main; main()"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"PYTHONPATH": str(REPO), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_data_check_refuses_ids_sharing_a_document(tmp_path):
    lay_out_dataset(tmp_path / "hf", DATASET, {"train": TRAIN, "test": TEST})
    out = parley("data", "check", "--train", DATASET, "--eval", f"{DATASET}#test", hf_home=tmp_path / "hf")
    assert out.returncode == 1, out.stderr
    assert "train 2 items, eval 2 items: 1 shared reference targets" in out.stdout


UP = ["up", "--config", "deploy/configs/default.toml", "--set", f'data.path="{DATASET}"', "--dry-run"]


def test_up_dry_run_resolves_a_cached_id(tmp_path):
    lay_out_dataset(tmp_path / "hf", DATASET, {"train": TRAIN})
    out = parley(*UP, hf_home=tmp_path / "hf")
    assert out.returncode == 0, out.stderr
    assert f'path = "{DATASET}"' in out.stdout  # the run keeps the id; the learner resolves it


def test_up_dry_run_refuses_an_id_in_no_cache_with_one_line(tmp_path):
    out = parley(*UP, hf_home=tmp_path / "empty")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"parley up: data.path: dataset {DATASET!r} is not in the local Hugging Face cache")
    assert f"huggingface-cli download --repo-type dataset {DATASET}" in lines[0]
    assert out.stdout == ""
