"""`parley replay --deterministic` (evaluation.replay) on a tiny run of the embedded default's
environment and scoring: samples played by the conversation loop with the toy model (real weights and
tokenizer, in transformers: `TransformersEngineDouble`, a test double of the vLLM PolicyEngine that
samples each request with its own seeded generator, as vLLM seeds a request), a simulator test double
and the embedded default's judge test double; scored, archived by the learner's own writer, read back.
The replay needs neither simulator nor judge: it matches token for token with the same reward; other
weights are caught at the first differing token; a request the log does not hold is named."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from parley.config.run import load_config
from parley.engines.engine import GenOut
from parley.evaluation.replay import logged_samples, replay_deterministic
from parley.learner import checkpoint as ckpt
from parley.protocol.messages import ChatMessage, Sampling, SimReply, Task
from parley.rollout.conversation import PolicySettings, run_conversation
from parley.rollout.score import score_trajectory
from tests.unit.test_trace import JudgeExpectedDouble

EMBEDDED = load_config()
ROLLOUT = SimpleNamespace(max_new_turns=4, max_tokens=10, future_turns=2)
MAX_MODEL_LEN = 1024


class TransformersEngineDouble:
    """Test double of engines.engine.PolicyEngine.generate: the model in transformers, each token
    sampled at `temperature` from a torch generator seeded with the request's seed."""

    def __init__(self, model, version: int = 0):
        self.model, self.version = model, version

    async def reload_weights(self, weights_dir, version=None):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype="float32").eval()
        self.version = self.version if version is None else version

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop_token_ids=None):
        import torch

        gen = torch.Generator().manual_seed(int(seed or 0))
        x, past, out, lps = torch.tensor([list(prompt_ids)]), None, [], []
        with torch.no_grad():
            for _ in range(max_tokens):
                o = self.model(x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                logp = torch.log_softmax(o.logits[0, -1].float() / temperature, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out.append(tok)
                lps.append(float(logp[tok]))
                if tok in (stop_token_ids or ()):
                    return GenOut(out, lps, "stop", "")
                x = torch.tensor([[tok]])
        return GenOut(out, lps, "length", "")


class SimulatorDouble:
    """Test double of the simulator client: a user who answers by the conversation's length and seed,
    and is done after five messages."""

    async def ask(self, req):
        n = len(req.messages)
        return SimReply(message=f"more detail please ({n}, {req.seed % 97})", done=n >= 5)


@pytest.fixture(scope="module")
def toy(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # one thread: a model this small runs an order of magnitude faster than on threads that contend
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype="float32").eval()
    yield model, AutoTokenizer.from_pretrained(tiny_model)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def logged(tmp_path_factory, toy):
    """The tiny run's archive, read back as `parley replay` reads it (a fresh copy for each test)."""
    model, tok = toy
    archive = ckpt.archive_dir(_run_dir(tmp_path_factory.mktemp("run"), TransformersEngineDouble(model), tok))
    return lambda: logged_samples(archive)


def _task(task_id: str, **kw) -> Task:
    base = dict(
        task_id=task_id,
        run="tiny",
        item_id=f"item/{task_id}",
        n=2,
        prefix=[ChatMessage("user", "help me write a toast for my sister")],
        reference="A toast for my sister: may your days be long and your tea always warm.",
        system_prompt="You help people write.",
        sim_prompt="lazy_full",
        max_new_turns=ROLLOUT.max_new_turns,
        max_tokens=ROLLOUT.max_tokens,
        future_turns=ROLLOUT.future_turns,
        seed=7,
    )
    return Task(**{**base, **kw})


def _run_dir(tmp_path, engine, tok, tasks=None):
    """The tiny run: 2 conversations and a next_turn sample with 2 futures, scored and archived."""
    policy = PolicySettings(max_model_len=MAX_MODEL_LEN, sampling=Sampling(temperature=1.0))
    reward = EMBEDDED.env.load().reward
    tasks = tasks or (_task("t-0001"), _task("t-0002", mode="next_turn", futures=2, n=1))

    async def main():
        scored = []
        for t in tasks:
            for i in range(t.n):
                traj = await run_conversation(
                    engine, SimulatorDouble(), t, i, lambda: engine.version, tokenizer=tok, policy=policy
                )
                scored.append(await score_trajectory(traj, JudgeExpectedDouble(), EMBEDDED.scorer, reward=reward))
        return scored

    scored = asyncio.run(main())
    ckpt.write_archive(tmp_path, 1, scored)
    return tmp_path


def _replay(records, engine, tok, weights_of=None):
    return asyncio.run(
        replay_deterministic(
            records,
            engine,
            tok,
            max_model_len=MAX_MODEL_LEN,
            rollout=ROLLOUT,
            reward=EMBEDDED.env.load().reward,
            weights_of=weights_of,
        )
    )


def test_a_logged_run_replays_token_for_token_without_simulator_or_judge(logged, toy):
    model, tok = toy
    records = logged()
    assert len(records) == 3 and all(r.trajectory.sim_calls for r in records)
    assert any(r.trajectory.futures for r in records) and all(r.metrics for r in records)
    report = _replay(records, TransformersEngineDouble(model), tok)
    assert report.ok, report.describe()
    assert report.count("match") == 3


def test_other_weights_are_caught_at_the_first_differing_token(logged, toy, tiny_model):
    from tests.factories import perturbed_model

    _, tok = toy
    records = logged()
    report = _replay(records, TransformersEngineDouble(perturbed_model(tiny_model, seed=3, scale=0.5)), tok)
    # a differing turn is caught at its tokens, or (the user's answer depending on it) when the simulator is
    # next asked about a conversation the log does not hold
    assert not report.ok and report.count("mismatch") == 3, report.describe()
    assert "differs from the log before the simulator was asked again" in report.describe()


def test_a_request_the_log_does_not_hold_is_named(logged, toy):
    model, tok = toy
    r = next(r for r in logged() if r.trajectory.futures)
    r.trajectory.sim_calls = r.trajectory.sim_calls[:1]  # the log lost one of the futures' simulator answers
    report = _replay([r], TransformersEngineDouble(model), tok)
    assert report.count("miss") == 1
    assert "t-0002/0: simulator call " in report.describe() and "(prompt 'lazy_full', seed " in report.describe()
    assert "is not in the log of its 1 recorded call(s)" in report.describe()


def test_a_sample_generated_over_a_stale_prefix_is_skipped(logged, toy):
    """[actor.engine] prefix_cache_across_versions: a turn that attended over KV older weights computed
    (AssistantTurn.stale_prefix_tokens) is not reproduced by a replay, which says so instead of a mismatch."""
    model, tok = toy
    records = logged()
    records[0].trajectory.turns[-1].stale_prefix_tokens = 16
    report = _replay(records, TransformersEngineDouble(model), tok)
    assert report.count("match") == 2 and report.count("skipped") == 1, report.describe()
    assert "generated over a prefix cached by older weights" in report.describe()


def test_replay_cli_refuses_what_it_cannot_replay(tmp_path):
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    res = CliRunner().invoke(app, ["replay", "--deterministic", str(tmp_path)])
    assert res.exit_code == 2 and "--deterministic takes one run directory (holding learner/archive/)" in res.output
    res = CliRunner().invoke(app, ["replay", str(tmp_path), "--judge-url", "http://127.0.0.1:9/v1"])
    assert res.exit_code == 2 and "--judge-url and --judge-model go together" in res.output


def test_a_later_versions_samples_replay_with_the_weights_the_run_kept(logged, toy, tiny_model, tmp_path):
    from tests.factories import perturbed_model

    model, tok = toy
    v1 = tmp_path / "weights" / "v000001"
    perturbed_model(tiny_model, seed=5, scale=0.5).save_pretrained(v1)
    engine_v1 = TransformersEngineDouble(model, version=0)
    asyncio.run(engine_v1.reload_weights(v1, version=1))  # what an actor serving version 1 played with
    later = logged_samples(ckpt.archive_dir(_run_dir(tmp_path / "run", engine_v1, tok, tasks=[_task("t-0009", n=1)])))
    assert {t.version for t in later[0].trajectory.turns} == {1}
    records = [*later, *logged()]  # the order of the log, not of the versions
    report = _replay(records, TransformersEngineDouble(model), tok, weights_of=lambda v: v1 if v == 1 else None)
    assert report.ok and report.count("match") == 4, report.describe()
    assert [o.traj_id for o in report.outcomes] == [r.traj_id for r in records]
    report = _replay(records, TransformersEngineDouble(model), tok)  # the run kept no weights of version 1
    assert report.count("match") == 3 and report.count("skipped") == 1
    assert "t-0009/0: SKIPPED: the weights of version 1 are not in the run directory" in report.describe()


def test_another_judge_on_an_openai_endpoint_is_built_from_the_runs_judge_settings():
    from parley.deploy.cli_eval import _openai_judge
    from parley.services.judge.client import LocalJudge

    judge = _openai_judge(EMBEDDED, "http://127.0.0.1:9/v1", "other-judge")
    assert isinstance(judge, LocalJudge)
    backend = judge.judge.backend
    assert backend.model_name == "other-judge" and str(backend.client.base_url).startswith("http://127.0.0.1:9/v1")
    assert judge.judge.cfg.temperature == EMBEDDED.judge.temperature  # the run's [judge] settings, prompts
