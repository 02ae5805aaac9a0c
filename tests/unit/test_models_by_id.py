"""Models by Hugging Face Hub id (issue 59, item 1): a model field resolves through the local HF cache
with no network (HF_HUB_OFFLINE=1 throughout: nothing here touches the network); an id that is in
no cache is one line naming it and how to fetch it. The cache is laid out by the test from the
embedded tiny model, in the Hub's layout (models--ORG--NAME/snapshots/<rev>/ + refs/main)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REV = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(hf_home: Path, repo: str, files: Path, rev: str = REV) -> Path:
    """A Hub cache holding `files` as `repo` at commit `rev`, refs/main pointing at it."""
    d = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = d / "snapshots" / rev
    shutil.copytree(files, snap)
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(rev)
    return snap


def parley(*args: str, hf_home: Path, timeout: float = 90.0):
    code = "import sys; sys.argv[0] = 'parley'; from parley.deploy.cli import main; main()"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"PYTHONPATH": str(REPO), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


UP = ["up", "--config", "deploy/configs/default.toml", "--set", 'policy.model="Qwen/Qwen3-0.6B"', "--dry-run"]


def test_an_id_in_no_cache_is_one_line_naming_it_and_the_fix(tmp_path):
    out = parley(*UP, hf_home=tmp_path / "empty")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    assert "'Qwen/Qwen3-0.6B' is not in the local Hugging Face cache" in lines[0]
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in lines[0] and "HF_HOME" in lines[0]
    assert out.stdout == ""


def test_an_id_in_the_cache_resolves_offline(tmp_path, tiny_model):
    lay_out_cache(tmp_path / "hf", "Qwen/Qwen3-0.6B", tiny_model)
    out = parley(*UP, hf_home=tmp_path / "hf")
    assert out.returncode == 0, out.stderr
    assert 'model = "Qwen/Qwen3-0.6B"' in out.stdout  # the run keeps the id; each role resolves it


def test_ensure_model_finds_the_snapshot_by_id_and_by_revision(tmp_path, tiny_model, monkeypatch):
    snap = lay_out_cache(tmp_path / "hf", "Qwen/Qwen3-0.6B", tiny_model)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    # huggingface_hub reads its cache location and offline switch at import: read them afresh
    code = (
        "from parley.engines.models import ensure_model, check_model\n"
        "print(ensure_model('Qwen/Qwen3-0.6B'))\n"
        f"print(ensure_model('Qwen/Qwen3-0.6B@{REV}'))\n"
        "print(check_model('Qwen/Qwen3-0.6B@main'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(snap)] * 3
    assert (snap / "model.safetensors").is_file()


def test_a_local_directory_wins_over_an_id_of_the_same_spelling(tmp_path, monkeypatch):
    from parley.engines.models import ensure_model, hub_id

    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id("Qwen/Qwen3-0.6B") is None
    assert ensure_model("Qwen/Qwen3-0.6B") == Path("Qwen/Qwen3-0.6B")


@pytest.mark.parametrize(
    "value,expected",
    [
        ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None)),
        ("Qwen/Qwen3-0.6B@main", ("Qwen/Qwen3-0.6B", "main")),
        ("org/name@v1.0", ("org/name", "v1.0")),
        ("smol", None),
        ("/abs/path", None),
        ("a/b/c", None),
        ("./rel", None),
    ],
)
def test_what_reads_as_a_hub_id(value, expected):
    from parley.engines.models import hub_id

    assert hub_id(value) == expected


def test_every_preset_plans_its_gpu_from_an_offline_cache(tmp_path):
    """deploy/configs/qwen3-*.toml: the cache holds each preset's published config.json (no weights);
    the plan is made from it, and fits the GPU its header names, except 8B (LoRA, which the plan does
    not count yet: it plans Adam over all 8.2B weights and refuses)."""
    import json

    from parley.engines.models import MODEL_SHAPES

    for repo, shape in MODEL_SHAPES.items():
        if repo.startswith("Qwen/"):
            src = tmp_path / "src" / repo
            src.mkdir(parents=True)
            (src / "config.json").write_text(json.dumps(shape))
            lay_out_cache(tmp_path / "hf", repo, src)
    for name, gib, fits in (("0.6b", 80, True), ("1.7b", 80, True), ("4b", 141, True), ("8b", 141, False)):
        out = parley(
            "up",
            "--config",
            f"deploy/configs/qwen3-{name}.toml",
            "--set",
            f"up.gpu_memory_gib={gib}",
            "--dry-run",
            hf_home=tmp_path / "hf",
        )
        assert ("to spare" in out.stdout + out.stderr) is fits, (name, out.stdout[-2000:], out.stderr[-2000:])
        assert out.returncode == (0 if fits else 2), (name, out.stderr[-2000:])
