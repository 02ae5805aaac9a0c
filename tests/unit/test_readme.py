"""The README is the newcomer's two-minute read: what it links exists, its layout names every package
folder, and its command list is the CLI's (no command missing, none invented)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_links_resolve():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    assert [x for x in links if not (ROOT / x).exists()] == []


def test_layout_names_every_package_folder():
    block = README.split("## Layout", 1)[1].split("```")[1]
    named = set(re.findall(r"([a-z_]+)/", block))
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(mapped.values()) <= named
    assert {x for x in named if not (ROOT / x).is_dir()} == set()


def test_command_list_is_the_cli():
    from parley.deploy.cli import app

    section = README.split("## Commands", 1)[1].split("##", 1)[0]
    listed = set(re.findall(r"`parley ([a-z-]+)", section)) - {"COMMAND"}
    registered = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert listed == registered


def test_short_enough_to_read_in_two_minutes():
    words = len(re.sub(r"```.*?```", "", README, flags=re.S).split())
    assert words < 1000, words


def test_ci_runs_the_readmes_test_command():
    """The second of the README's two commands is the one .ci/run runs, word for word."""
    section = README.split("## Two commands", 1)[1].split("##", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert [b.strip() for b in blocks] == ["make run", "make test"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert blocks[1].strip() in ci
