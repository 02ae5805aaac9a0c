"""services.budget: a spent simulator/judge call budget makes calls wait (never fail) and they resume
once it is raised; a rate limit holds calls back and releases them; the actor's share of a run's
budget; and a next_turn sample's futures observed playing at the same time (each future's simulator
call is in flight together). The simulator is `SimulatorDouble`, a test double of the simulator
client; the policy is tests/unit/test_rollout.py's engine double."""

from __future__ import annotations

import asyncio

import pytest

from parley.protocol.messages import ChatMessage, JudgeReply, SimReply, SimRequest
from parley.services.budget import BudgetedJudge, BudgetedUser, CallBudget
from tests.unit.test_rollout import EngineDouble, play, task


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


class SimulatorDouble:
    """Test double of the simulator client: answers after `delay` seconds, counts the calls in
    flight at once (the most seen is `peak`)."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.calls, self.in_flight, self.peak = delay, 0, 0, 0

    async def ask(self, req: SimRequest) -> SimReply:
        self.calls += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return SimReply(message=f"answer {self.calls}")


def _req(i: int) -> SimRequest:
    return SimRequest(prompt="lazy_full", messages=[ChatMessage("assistant", f"q{i}")], seed=i)


def test_a_spent_budget_holds_calls_until_it_is_raised():
    async def main():
        sim = SimulatorDouble()
        budget = CallBudget("sim_budget", budget=2)
        user = BudgetedUser(sim, budget)
        assert [r.message for r in [await user.ask(_req(0)), await user.ask(_req(1))]] == ["answer 1", "answer 2"]
        assert budget.spent
        third = asyncio.create_task(user.ask(_req(2)))
        gate = asyncio.create_task(budget.wait_open())  # the actor's gate before it takes a task
        await asyncio.sleep(0.05)
        assert not third.done() and not gate.done() and sim.calls == 2  # waiting, not failed
        budget.raise_to(4)
        assert (await asyncio.wait_for(third, 1)).message == "answer 3"
        await asyncio.wait_for(gate, 1)
        assert budget.counters()["sim_budget.waits"] == 1 and budget.counters()["sim_budget.left"] == 1

    asyncio.run(main())


def test_a_rate_limit_holds_calls_back_and_releases_them():
    async def main():
        judged = []

        class JudgeDouble:
            async def ask(self, op, messages, *, seed=0):
                judged.append(asyncio.get_running_loop().time())
                return JudgeReply(ok=True, score=1.0)

        budget = CallBudget("judge_budget", per_s=20.0)  # a burst of 20, then one per 50 ms
        judge = BudgetedJudge(JudgeDouble(), budget)
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(*(judge.ask("interactivity", [], seed=i) for i in range(25)))
        assert len(judged) == 25 and budget.calls == 25
        # the 5 past the burst waited their turn: about 5 x 50 ms, not failed
        assert judged[-1] - t0 >= 0.2 and budget.waits >= 5
        assert budget.counters()["judge_budget.left"] == -1.0  # no count limit

    asyncio.run(main())


def test_a_runs_budget_is_split_over_its_processes():
    assert CallBudget.share(100, 4) == 25 and CallBudget.share(3, 4) == 1 and CallBudget.share(0, 4) == 0
    assert CallBudget.share(10.0, 4) == 2.5
    with pytest.raises(ValueError, match="must be >= 0"):
        CallBudget("sim_budget", budget=-1)


def test_futures_of_a_next_turn_sample_play_concurrently_under_the_budget(tok):
    prefix = [ChatMessage("user", "help me"), ChatMessage("assistant", "With what?"), ChatMessage("user", "a toast")]
    sim = SimulatorDouble(delay=0.2)
    budget = CallBudget("sim_budget", budget=100)
    engine = EngineDouble(tok, ["Who is it for?", "Draft."])
    traj = play(
        tok, engine, BudgetedUser(sim, budget), task(mode="next_turn", prefix=prefix, futures=4, future_turns=2)
    )
    assert len(traj.futures) == 4 and all(len(f.messages) == len(traj.messages) + 2 for f in traj.futures)
    assert sim.peak == 4  # every future's simulator call was in flight at once
    assert budget.calls == 4


def test_futures_wait_on_a_spent_budget_and_finish_once_it_is_raised(tok):
    prefix = [ChatMessage("user", "help me"), ChatMessage("assistant", "With what?"), ChatMessage("user", "a toast")]

    async def main():
        from parley.rollout.conversation import PolicySettings, run_conversation

        sim = SimulatorDouble()
        budget = CallBudget("sim_budget", budget=2)
        engine = EngineDouble(tok, ["Who is it for?", "Draft."])
        play_task = asyncio.create_task(
            run_conversation(
                engine,
                BudgetedUser(sim, budget),
                task(mode="next_turn", prefix=prefix, futures=4, future_turns=2),
                0,
                lambda: 0,
                tokenizer=tok,
                policy=PolicySettings(max_model_len=2048),
            )
        )
        await asyncio.sleep(0.2)
        assert sim.calls == 2 and not play_task.done()  # two futures asked; two wait on the budget
        budget.raise_to(4)
        traj = await asyncio.wait_for(play_task, 5)
        assert sim.calls == 4 and len(traj.futures) == 4
        assert all(len(f.messages) == len(traj.messages) + 2 for f in traj.futures)

    asyncio.run(main())


def test_openai_calls_are_counted_in_tokens_and_cost():
    """The usage fields of an OpenAI-compatible response (a stand-in object of its shape) become the
    backend's counters, which the service's heartbeat carries as backend.*."""
    from types import SimpleNamespace

    from parley.engines.backend import OpenAIBackend
    from parley.engines.config import ServiceBackend
    from parley.engines.service import Service

    cfg = ServiceBackend(
        backend="openai", base_url="http://127.0.0.1:9/v1", model_name="m", usd_per_mtok_in=0.5, usd_per_mtok_out=2.0
    )
    backend = OpenAIBackend(cfg)
    backend.account(SimpleNamespace(prompt_tokens=3000, completion_tokens=1000))
    backend.account(SimpleNamespace(prompt_tokens=1000, completion_tokens=500))
    backend.account(None)
    assert backend.usage["calls"] == 3 and backend.usage["calls_without_usage"] == 1
    assert backend.usage["prompt_tokens"] == 4000 and backend.usage["completion_tokens"] == 1500
    assert backend.usage["usd"] == pytest.approx((4000 * 0.5 + 1500 * 2.0) / 1e6)
    svc = Service(None, {}, queue="q")
    svc.usage = backend.usage
    beat = svc.heartbeat("sim", "sim-0")
    assert beat.counters["backend.prompt_tokens"] == 4000 and beat.counters["backend.usd"] == pytest.approx(0.005)


def test_budget_and_usage_counters_are_named_metric_families():
    from parley.runtime.metrics import family_of

    family, labels = family_of("actor", "sim_budget.waits")
    assert family.name == "parley_call_budget_waits_total" and labels == {"budget": "sim_budget"}
    assert family_of("scorer", "judge_budget.left")[0].name == "parley_call_budget_left"
    assert family_of("judge", "backend.prompt_tokens")[0].name == "parley_backend_tokens_total"
    assert family_of("sim", "backend.usd")[0].name == "parley_backend_cost_usd_total"


def test_an_actor_whose_simulator_share_is_spent_takes_no_new_task(tmp_path):
    """Actor.handle waits before it plays a task while the actor's share of [rollout] sim_call_budget
    (over [up] actors) is spent, and plays it once the share is raised. The engine, the message and the
    sample are test doubles; nothing is asked of NATS."""
    from parley.actors.actor import Actor
    from parley.config.run import load_config
    from parley.protocol.messages import Task

    cfg = load_config(None, ["rollout.sim_call_budget=4", "up.actors=2"])
    engine = SimpleEngineDouble()
    played, acked = [], []

    class MsgDouble:
        async def ack(self):
            acked.append(True)

        async def in_progress(self):
            pass

    async def main():
        actor = Actor(None, None, cfg, engine, tokenizer=None, ident="actor-0", weights_dir=tmp_path)
        assert actor.sim_budget.budget == 2  # its share of the run's 4 calls

        async def sample(task, i, watch=None):
            played.append(i)
            await actor.sim.ask(_req(i))
            return {}

        actor._sample = sample
        actor.sim.user = SimulatorDouble()
        t = Task(task_id="t-1", run=cfg.run.name, item_id="i", n=2)
        await actor.handle(t, MsgDouble())  # spends the share
        assert played == [0, 1] and actor.sim_budget.spent
        second = asyncio.create_task(actor.handle(Task(task_id="t-2", run=cfg.run.name, item_id="i", n=2), MsgDouble()))
        await asyncio.sleep(0.1)
        assert played == [0, 1] and not second.done()  # not started: no sample of it is playing
        assert actor.heartbeat().counters["sim_budget.left"] == 0
        actor.sim_budget.raise_to(4)
        await asyncio.wait_for(second, 2)
        assert played == [0, 1, 0, 1] and len(acked) == 2

    asyncio.run(main())


class SimpleEngineDouble:
    """Test double of the policy engine, for an Actor that plays no conversation itself."""

    version = 0
    settings = type("Settings", (), {"model": "tiny"})()
