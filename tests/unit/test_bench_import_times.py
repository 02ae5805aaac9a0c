"""bench/import_times.py: where a role's imports went, from its log written under PYTHONPROFILEIMPORTTIME=1."""

from __future__ import annotations

import os
import subprocess
import sys

from bench import import_times

# hand-written: the actor imports a (which imports b) then c; vLLM's engine core, prefixed, imports d
LOG = """\
2026-12-07 09:00:43,238 actor-0 INFO parley.actors.actor: actor-0: started
import time: self [us] | cumulative | imported package
import time:    300000 |     300000 |   b
import time:   1000000 |    1300000 | a
import time:   2500000 |    2500000 | c
(EngineCore pid=8535) import time:    700000 |     700000 | d
some other line | with | bars
"""


def test_a_log_is_read_by_process_and_level():
    by = import_times.parse(LOG.splitlines())
    assert sorted(by) == ["", "(EngineCore pid=8535)"]
    assert [(i.name, i.level, i.self_us, i.cumulative_us) for i in by[""]] == [
        ("b", 1, 300000, 300000),
        ("a", 0, 1000000, 1300000),
        ("c", 0, 2500000, 2500000),
    ]
    s = import_times.summary(by[""], top=2)
    # top level: c 2.5 s, a 1.3 s -> 3.8 s; own time: c 2.5, a 1.0
    assert s == {
        "modules": 3,
        "top_level_s": 3.8,
        "top_level": [("c", 2.5), ("a", 1.3)],
        "own_time": [("c", 2.5), ("a", 1.0)],
    }


def test_pythons_own_lines_are_read(tmp_path, capsys):
    """A real interpreter's import-time lines (not hand-written) parse, and the command prints them."""
    res = subprocess.run(
        [sys.executable, "-c", "import json, csv"],
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    log = tmp_path / "role.log"
    log.write_text(res.stderr)
    by = import_times.parse(res.stderr.splitlines())
    names = {i.name for i in by[""] if i.level == 0}
    assert {"json", "csv"} <= names
    assert import_times.main([str(log), "--top", "3"]) == 0
    assert "the process:" in capsys.readouterr().out
    (tmp_path / "plain.log").write_text("no imports here\n")
    assert import_times.main([str(tmp_path / "plain.log")]) == 1
    assert "PYTHONPROFILEIMPORTTIME" in capsys.readouterr().err
