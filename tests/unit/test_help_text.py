"""Help text as written (issue 59, item 6): section names in brackets survive (Rich markup ate
"[policy]" and "[scorer]"), and short flags mean what they usually mean (-h is help; `export -v`
was --version)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def help_of(*argv: str) -> subprocess.CompletedProcess:
    code = "import sys; sys.argv[0] = 'parley'; from parley.deploy.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "COLUMNS": "100", "PATH": "/usr/bin:/bin"},
    )


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_section_names_in_brackets_survive():
    out = help_of("reference", "--help")
    assert out.returncode == 0, out.stderr
    assert '([policy] reference = "service")' in flat(out.stdout)
    out = help_of("replay", "--help")
    assert "default: the config's [scorer]." in flat(out.stdout)


def test_short_flags_mean_what_users_expect():
    out = help_of("export", "-h")
    assert out.returncode == 0 and "--version" in out.stdout, out.stderr
    assert "-v," not in out.stdout
    out = help_of("export", "run", "out", "-v", "3")
    assert out.returncode == 2 and "No such option: -v" in out.stderr
    assert help_of("-h").returncode == 0
