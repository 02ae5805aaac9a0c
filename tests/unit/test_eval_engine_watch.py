"""`parley eval` watches the local engines it plays on (evaluation.commands.watch_engines over
engines.engine.PolicyEngine.watch): a policy engine that hangs while a condition is played ends the eval
with EngineFailed's exit code, 4, and the reason on standard error, instead of the eval waiting for good.
The real run_eval with test doubles for vLLM's engine (open_engine) and for the per-condition play."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from parley.config.run import load_config
from parley.engines import backend
from parley.engines.engine import EngineFailed
from parley.evaluation import commands, runner
from parley.evaluation.runner import Condition


class StallingEngineDouble:
    """Test double of PolicyEngine whose watch finds it stalled a moment after it opened."""

    def __init__(self):
        self.closed = False

    async def watch(self, stop):
        await asyncio.sleep(0.2)
        raise EngineFailed("test double: held 4 requests for 300 s without taking a step")

    def shutdown(self):
        self.closed = True


async def eval_base(cfg, out):
    """`parley eval` of the policy model alone, in this process, in an environment that asks no simulator
    or judge (a programmatic user); its exit code, or TimeoutError past 10 s."""
    no_services = SimpleNamespace(needs_simulator=False, needs_judge=False)
    conds = [Condition(name="base", model=cfg.policy.model)]
    run = commands.run_eval(
        asyncio.Event(), cfg, conds, [], None, "local", "base", out, env=no_services, in_process=object()
    )
    return await asyncio.wait_for(run, 10)


async def test_a_policy_engine_found_stalled_ends_the_eval_with_exit_4(monkeypatch, tmp_path, capsys):
    cfg = load_config(None, [])
    engines = []

    def open_engine_double(engine_cfg, version=0, sampled_logprobs=False, sleep_mode=False):
        engines.append(StallingEngineDouble())
        return engines[-1], object(), "path"

    async def hung_play(conds, held, settings, svc, on_record, on_missing):
        """Test double of evaluation.runner.run_eval on a hung engine: opens the policy, finishes nothing."""
        await svc.open_policy(conds[0].model)
        await asyncio.Event().wait()

    monkeypatch.setattr(backend, "open_engine", open_engine_double)
    monkeypatch.setattr(runner, "run_eval", hung_play)
    code = await eval_base(cfg, tmp_path)
    assert code == 4
    assert len(engines) == 1 and engines[0].closed
    err = capsys.readouterr().err
    assert "parley eval: test double: held 4 requests for 300 s without taking a step; exiting" in err


async def test_an_engine_that_dies_under_a_conversation_ends_the_eval_with_exit_4(monkeypatch, tmp_path, capsys):
    """The in-process judge no longer answers a dead engine with failed verdicts (it stops, as the service
    does): the error reaches run_eval before the watch's next look, and ends the eval the same way."""

    class EngineDeadError(RuntimeError):
        """Stands in for vllm.v1.engine.exceptions.EngineDeadError (backend.is_fatal matches by name)."""

    async def dying_play(conds, held, settings, svc, on_record, on_missing):
        """Test double of evaluation.runner.run_eval whose judge's engine died under the first conversation."""
        raise EngineDeadError("EngineCore encountered an issue")

    monkeypatch.setattr(runner, "run_eval", dying_play)
    cfg = load_config(None, [])
    code = await eval_base(cfg, tmp_path)
    assert code == 4
    assert "parley eval: EngineDeadError: EngineCore encountered an issue; exiting" in capsys.readouterr().err
