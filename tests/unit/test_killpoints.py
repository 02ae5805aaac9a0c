"""runtime.killpoints: PARLEY_KILL_AT names a point of the table or is refused with one line; a
process armed for a point dies by SIGKILL there (the n-th time), and nowhere else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from parley.runtime import killpoints

REPO = Path(__file__).resolve().parents[2]


def test_a_value_names_a_point_and_a_count():
    assert killpoints.parse("") is None
    assert killpoints.parse("ledger") == ("ledger", 1)
    assert killpoints.parse("held:3") == ("held", 3)


@pytest.mark.parametrize(("value", "says"), [("ledgr", "no kill point 'ledgr'"), ("held:0", "positive integer")])
def test_a_bad_value_is_refused_with_one_line_naming_it(value, says):
    with pytest.raises(killpoints.KillPointError) as e:
        killpoints.parse(value)
    assert says in str(e.value) and value in str(e.value) and "\n" not in str(e.value)


def test_an_unlisted_point_in_the_code_is_a_bug():
    with pytest.raises(KeyError):
        killpoints.reached("nowhere")


def run_to(points: str, env: str) -> subprocess.CompletedProcess:
    code = (
        "from parley.runtime import killpoints\n"
        "killpoints.arm()\n"
        f"for p in {points.split(',')!r}:\n"
        "    killpoints.reached(p)\n"
        "    print('past', p, flush=True)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PARLEY_KILL_AT": env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_process_dies_by_sigkill_at_the_nth_time_and_not_before():
    p = run_to("held,acks,held,held", "held:2")
    assert p.returncode == -signal.SIGKILL
    assert p.stdout.split("\n")[:2] == ["past held", "past acks"]
    assert "PARLEY_KILL_AT: killed at held" in p.stderr


def test_unset_every_point_is_passed():
    p = run_to(",".join(killpoints.POINTS), "")
    assert p.returncode == 0 and p.stdout.count("past") == len(killpoints.POINTS)
