"""engines.engine.start_stacks: with PARLEY_START_STACKS_S set, an engine's start writes every thread's
Python stack to the role's log every N seconds (where a minute-long start on a GPU waits), and stops
when the engine is made; unset, nothing; a bad value is a one-line ConfigError."""

from __future__ import annotations

import time

import pytest

from parley.engines.engine import START_STACKS_ENV, start_stacks
from parley.errors import ConfigError


def waiting_inside_the_engine_start(seconds: float) -> None:
    time.sleep(seconds)


def test_stacks_are_written_while_the_engine_starts_and_stop_after(tmp_path):
    log = tmp_path / "role.log"
    with log.open("w") as f:
        with start_stacks({START_STACKS_ENV: "0.05"}, file=f):
            waiting_inside_the_engine_start(0.3)
        f.flush()
        during = log.read_text()
        time.sleep(0.3)
        f.flush()
    assert "waiting_inside_the_engine_start" in during  # the frame it waits in
    assert during.count("Timeout (0:00:00.050000)!") >= 2, during  # one dump each 0.05 s, not one alone
    assert log.read_text() == during  # none after the start


def test_unset_or_empty_writes_nothing(tmp_path):
    log = tmp_path / "role.log"
    with log.open("w") as f:
        for environ in ({}, {START_STACKS_ENV: ""}):
            with start_stacks(environ, file=f):
                waiting_inside_the_engine_start(0.1)
    assert log.read_text() == ""


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "nan"])
def test_a_bad_interval_is_refused_naming_the_variable(raw, tmp_path):
    with pytest.raises(ConfigError, match=rf"^{START_STACKS_ENV}='{raw}': seconds between stack dumps"):
        with (tmp_path / "log").open("w") as f, start_stacks({START_STACKS_ENV: raw}, file=f):
            pass
