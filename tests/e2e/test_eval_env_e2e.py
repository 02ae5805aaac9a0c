"""The benchmark on hidden_goal with real vLLM and the toy model: the held-out goals of the run's split
are played from the user's opening line under the domain's system prompt, the programmatic user
answers in this process (no simulator service, no judge), every conversation is scored by the
environment's reward, and the table has hidden_goal's columns. The toy model writes no `FINAL:` line,
so its goal_match is 0; the point is the path, not the score (bench/env_learning.py measures that).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]  # 600 s in one run on the loaded 2-core machine


def test_the_benchmark_plays_hidden_goal_and_shows_its_columns(tiny_model, engines, tiny_engine):
    from transformers import AutoTokenizer

    from parley.config.env import EnvConfig
    from parley.config.learner import DataConfig
    from parley.config.scorer import ScorerConfig
    from parley.evaluation.benchmark import summarize, to_markdown
    from parley.evaluation.runner import Condition, EvalServices, EvalSettings, Policy, eval_items, run_eval

    env = EnvConfig(name="hidden_goal", options={"n_items": 20, "seed": 1}).load()
    _, held = eval_items(DataConfig(eval_fraction=0.2), None, env)
    held = held[:3]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    settings = EvalSettings(sim_prompt="", assistant_max_tokens=16, max_new_turns=4, concurrency=4)

    async def open_policy(model):
        return Policy(engine=tiny_engine, tokenizer=tok, version=0)  # the shared one: no chunked prefill

    services = EvalServices(open_policy=open_policy, sim=None, judge=None, scorer_cfg=ScorerConfig(), env=env)
    records = engines.run(run_eval([Condition(name="v0", model="tiny")], held, settings, services))
    assert sorted(r.item_id for r in records) == sorted(g.item_id for g in held)
    for rec, goal in zip(sorted(records, key=lambda r: r.item_id), sorted(held, key=lambda g: g.item_id)):
        assert rec.messages[0].role == "system" and "FINAL:" in rec.messages[0].content
        assert rec.messages[1].role == "user" and rec.messages[1].content.endswith(".")  # the user's opening line
        assert rec.sim_model == "programmatic:hidden_goal" and rec.judge_model == ""
        assert set(rec.metrics) == {"goal_match", "exact", "assistant_turns"}
        assert rec.metrics["assistant_turns"] == sum(m.role == "assistant" for m in rec.messages) >= 1
        assert rec.reference == goal.hidden()
    table = summarize(records, baseline="v0", env=env)
    assert table.metrics == ["goal_match", "exact", "assistant_turns"] and table.row("v0").n == len(held)
    print(to_markdown(table))
