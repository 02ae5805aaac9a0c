"""`parley eval --follow` (evaluation.commands.follow) opens its policy engine on the run's policy model
before it reads its first job: version 0's job (that model) then loads nothing and a later version loads
in place; an engine that does not open is reported once and the jobs are still answered; a SIGTERM while
it opens ends it at once. The real FollowingPolicy with test doubles for vLLM's engine (open_engine),
for the per-version eval (run_eval) and for standard input."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from parley.config.run import load_config
from parley.engines import backend
from parley.evaluation import commands
from parley.runtime.process import Stopped, unless_stopped


class EngineDouble:
    """Test double of engines.engine.PolicyEngine: records its in-place loads and its shutdown."""

    def __init__(self, events):
        self.events = events

    async def reload_weights(self, path, version, abort_inflight=False):
        self.events.append(("reload", str(path), version))

    def shutdown(self):
        self.events.append(("shutdown",))


def doubles(monkeypatch, events, lines, open_engine=None):
    """open_engine, run_eval and standard input replaced; `lines` are what read_line returns in turn."""

    def open_engine_recorder(cfg, version=0, sampled_logprobs=False, sleep_mode=False):
        events.append(("open", cfg.model))
        return EngineDouble(events), object(), "path"

    async def run_eval_double(stop, cfg, conds, held, settings, services, baseline, out, policy_version=-1, env=None, in_process=None, open_policy=None):  # fmt: skip
        policy = await open_policy(conds[0].model)  # what evaluation.runner does for each model
        events.append(("played", conds[0].model, policy.version))
        return 0

    async def read_line_double():
        events.append(("read",))
        return lines.pop(0)

    monkeypatch.setattr(backend, "open_engine", open_engine or open_engine_recorder)
    monkeypatch.setattr(commands, "run_eval", run_eval_double)
    return read_line_double


def job(version, model, out) -> str:
    return json.dumps({"version": version, "model": str(model), "out": str(out)}) + "\n"


async def test_the_engine_opens_before_the_first_line_and_version_0_loads_nothing(monkeypatch, tmp_path, capsys):
    cfg = load_config(None, [])
    v2 = tmp_path / "models" / "v2"
    v2.mkdir(parents=True)
    (v2 / "config.json").write_text("{}")
    events: list[tuple] = []
    lines = [job(0, cfg.policy.model, tmp_path / "o0"), job(2, v2, tmp_path / "o2"), ""]
    read_line = doubles(monkeypatch, events, lines)

    code = await commands.follow(asyncio.Event(), cfg, [], None, env=object(), read_line=read_line)

    assert code == 0
    assert events == [
        ("open", cfg.policy.model),  # before any line is read
        ("read",),
        ("played", cfg.policy.model, 0),  # version 0 is the model the engine holds: no load
        ("read",),
        ("reload", str(v2), 2),  # a later version: in place
        ("played", str(v2), 2),
        ("read",),
        ("shutdown",),
    ]
    out, err = capsys.readouterr()
    assert [json.loads(x.removeprefix(commands.DONE_MARK)) for x in out.splitlines()] == [
        {"version": 0, "code": 0},
        {"version": 2, "code": 0},
    ]
    assert f"policy engine on {cfg.policy.model} open in" in err
    assert "engine starts 1, in-place loads 0" in err and "engine starts 1, in-place loads 1" in err


async def test_an_engine_that_does_not_open_is_reported_once_and_the_job_is_still_answered(monkeypatch, tmp_path, capsys):  # fmt: skip
    cfg = load_config(None, [])
    events: list[tuple] = []
    tries = []

    def fails_once_double(engine_cfg, version=0, sampled_logprobs=False, sleep_mode=False):
        """Test double of open_engine: the first open fails (the GPU busy at start), the next works."""
        tries.append(engine_cfg.model)
        if len(tries) == 1:
            raise RuntimeError("test double: CUDA out of memory")
        return EngineDouble(events), object(), "path"

    lines = [job(0, cfg.policy.model, tmp_path / "o0"), ""]
    read_line = doubles(monkeypatch, events, lines, open_engine=fails_once_double)
    code = await commands.follow(asyncio.Event(), cfg, [], None, env=object(), read_line=read_line)
    assert code == 0 and tries == [cfg.policy.model, cfg.policy.model]
    out, err = capsys.readouterr()
    said = [x for x in err.splitlines() if "did not open" in x]
    assert len(said) == 1
    assert f"policy engine on {cfg.policy.model} did not open before the first version" in said[0]
    assert "RuntimeError: test double: CUDA out of memory" in said[0]
    assert json.loads(out.strip().removeprefix(commands.DONE_MARK)) == {"version": 0, "code": 0}


@pytest.fixture
def sigterm_guard():
    """SIGTERM to a no-op around the test, so a SIGTERM the code under test did not catch fails the
    test instead of ending pytest."""
    before = signal.signal(signal.SIGTERM, lambda *a: None)
    yield
    signal.signal(signal.SIGTERM, before)


async def test_a_sigterm_while_the_engine_opens_ends_follow_at_once(monkeypatch, tmp_path, capsys, sigterm_guard):
    cfg = load_config(None, [])
    events: list[tuple] = []

    def terminated_while_loading_double(engine_cfg, version=0, sampled_logprobs=False, sleep_mode=False):
        """Test double of a vLLM start that gets SIGTERM (its learner ends the child) in the middle."""
        events.append(("opening",))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        events.append(("opened",))
        return EngineDouble(events), object(), "path"

    read_line = doubles(monkeypatch, events, [""], open_engine=terminated_while_loading_double)
    t0 = time.monotonic()
    code = await commands.follow(asyncio.Event(), cfg, [], None, env=object(), read_line=read_line)
    assert code == 130
    assert time.monotonic() - t0 < 5  # interrupted, not waited out
    assert events == [("opening",)]  # no line read, no engine left
    assert "stopped while its policy engine opened" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is not commands._raise_interrupted  # put back


async def test_a_sigterm_while_it_waits_for_a_job_ends_follow_at_once(monkeypatch, tmp_path, capsys):
    """The learner has queued nothing yet (its first step is minutes away) and the child is stopped: it
    must not wait for a line that may never come."""
    cfg = load_config(None, [])
    events: list[tuple] = []
    doubles(monkeypatch, events, [])
    never = asyncio.Event()

    async def read_line_double():
        """Test double of standard input with no job on it yet."""
        events.append(("read",))
        await never.wait()
        return ""

    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)  # what run_async's SIGTERM handler does
    code = await asyncio.wait_for(
        commands.follow(stop, cfg, [], None, env=object(), read_line=read_line_double), timeout=5
    )
    assert code == 130
    assert events == [("open", cfg.policy.model), ("read",), ("shutdown",)]  # the engine is closed
    assert capsys.readouterr().out == ""  # no job answered


def test_standard_input_is_read_by_a_thread_that_does_not_hold_the_exit(monkeypatch):
    """The default read_line: a line comes back, and the thread that waits for one is a daemon."""
    import io
    import threading

    monkeypatch.setattr("sys.stdin", io.StringIO('{"version": 0}\n'))
    assert asyncio.run(commands._stdin_line()) == '{"version": 0}\n'
    entered = threading.Event()
    seen = []

    class Blocking(io.StringIO):
        def readline(self, *a):
            seen.append(threading.current_thread())
            entered.set()
            time.sleep(0.5)
            return ""

    monkeypatch.setattr("sys.stdin", Blocking())

    async def stopped_while_reading():
        stop = asyncio.Event()
        waiting = asyncio.ensure_future(unless_stopped(commands._stdin_line(), stop))
        assert await asyncio.to_thread(entered.wait, 5)
        t0 = time.monotonic()
        stop.set()
        with pytest.raises(Stopped):
            await waiting
        return time.monotonic() - t0

    seconds = asyncio.run(stopped_while_reading())
    assert seconds < 0.4  # returned while the read still waited
    assert seen[0].daemon and seen[0].name == "eval-follow-stdin"


async def test_an_engine_found_stalled_ends_the_version_and_the_child_with_exit_4(monkeypatch, tmp_path, capsys):
    """A policy engine that hangs while a version is played held that version (and every later one) until
    the learner's drain gave up: the engine's watch (engines.engine.PolicyEngine.watch) now ends the
    version and the child with EngineFailed's exit code, 4; the learner starts a fresh child for its next
    version (evaluation.periodic.FollowingChild)."""
    from parley.engines.engine import EngineFailed

    cfg = load_config(None, [])
    events: list[tuple] = []

    class StallingEngineDouble(EngineDouble):
        """Test double of PolicyEngine whose watch finds it stalled a moment into the first version."""

        async def watch(self, stop):
            await asyncio.sleep(0.2)
            raise EngineFailed("test double: held 1 requests for 300 s without taking a step")

    def open_stalling(engine_cfg, version=0, sampled_logprobs=False, sleep_mode=False):
        events.append(("open", engine_cfg.model))
        return StallingEngineDouble(events), object(), "path"

    async def hung_run_eval(stop, cfg, conds, *args, **kwargs):
        """Test double of run_eval on a hung engine: nothing finishes until it is stopped (then 130)."""
        events.append(("playing", conds[0].model))
        await stop.wait()
        return 130

    read_line = doubles(monkeypatch, events, [job(0, cfg.policy.model, tmp_path / "o0"), ""], open_engine=open_stalling)
    monkeypatch.setattr(commands, "run_eval", hung_run_eval)
    code = await asyncio.wait_for(
        commands.follow(asyncio.Event(), cfg, [], None, env=object(), read_line=read_line), 10
    )
    assert code == 4
    assert events == [("open", cfg.policy.model), ("read",), ("playing", cfg.policy.model), ("shutdown",)]
    out, err = capsys.readouterr()
    assert [json.loads(x.removeprefix(commands.DONE_MARK)) for x in out.splitlines()] == [{"version": 0, "code": 4}]
    assert "without taking a step; exiting" in err
