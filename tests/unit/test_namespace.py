"""One import name: installing parley adds `parley` to site-packages and nothing else of ours, its
packages live under it, and `import parley` gives the Python API. The install is real (pip, the
project's own pyproject, no dependencies) into a folder of the test's, from a copy of the sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAPPED = {
    k.removeprefix("parley."): v for k, v in PYPROJECT["tool"]["setuptools"]["package-dir"].items() if k != "parley"
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("parley", *MAPPED.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def test_one_top_level_name(installed):
    names = {p.name for p in installed.iterdir()} - {"bin"}
    assert names == {"parley", "parley_grpo-0.1.0.dist-info"}, names
    top = installed / "parley_grpo-0.1.0.dist-info" / "top_level.txt"
    assert not top.exists() or top.read_text().split() == ["parley"]


def test_every_package_is_under_parley(installed):
    for name in MAPPED:
        assert (installed / "parley" / name / "__init__.py").is_file(), name
    assert (installed / "parley" / "deploy" / "configs" / "default.toml").is_file()
    # each service's prompts travel with it
    assert (installed / "parley" / "services" / "sim" / "prompts" / "cooperative.txt").is_file()
    assert (installed / "parley" / "services" / "sim" / "opening.txt").is_file()
    assert (installed / "parley" / "services" / "judge" / "prompts" / "interactivity.txt").is_file()


def test_the_package_list_names_every_folder():
    """pyproject's `packages` is written out (the folders are mapped, so find cannot name them):
    every folder with an __init__.py is in it, and nothing else."""
    found = {"parley"} | {
        "parley." + str(p.parent.relative_to(ROOT)).replace("/", ".")
        for k in MAPPED
        for p in (ROOT / k).rglob("__init__.py")
    }
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == found


def test_import_parley_from_the_install(installed, tmp_path):
    """From another folder, with only the installed copy on the path (the dependencies are the
    venv's): the API is there, the old bare names are not, and the command's help answers."""
    code = (
        "import importlib.util, parley; assert callable(parley.up) and callable(parley.eval); "
        "assert parley.Environment.__module__ == 'parley.environments.base'; "
        "assert parley.load_config().learner.steps >= 1; "
        "assert all(importlib.util.find_spec(n) is None for n in ('config', 'tasks', 'deploy', 'learner')); "
        "print(parley.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(installed), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(installed / "parley" / "__init__.py")


def test_command_returns_the_exit_code(tmp_path):
    """parley.command runs a command line in process; a bad value is a non-zero code, not an exit."""
    import parley

    assert parley.command("up", "--actors", "many", "--dry-run") == 2
    assert parley.command("--help") == 0
