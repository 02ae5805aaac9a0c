"""The benchmark end to end on real vLLM with the toy model and a real nats-server: two conditions
(base, and the proactive system prompt) over the same items and simulator seeds, the user simulator and
the judge answering as NATS services, every record published to the run's EVAL stream, the table
written; then a replay of the log with other reward weights reproduces the BLEU and interactivity
columns exactly without generating. One engine (the toy model's shared one) serves policy, simulator and
judge to keep CI short.
"""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RUN = "evale2e"


def test_eval_two_conditions_then_replay_without_generation(tmp_path, tiny_model, nats_server, engines, tiny_engine):
    from transformers import AutoTokenizer

    from parley.config.actor import SimConfig
    from parley.config.scorer import JudgeConfig, ScorerConfig
    from parley.deploy.cli import app
    from parley.engines.backend import LocalBackend
    from parley.evaluation.benchmark import summarize, write_table
    from parley.evaluation.evallog import read_records, read_stream, reweight, write_parquet
    from parley.evaluation.runner import EvalServices, EvalSettings, Policy, parse_condition, run_eval
    from parley.protocol import topology
    from parley.protocol.bus import publish
    from parley.protocol.connect import connect
    from parley.services.judge.client import JudgeClient
    from parley.services.judge.server import Judge, judge_service
    from parley.services.sim.client import SimClient
    from parley.services.sim.server import Simulator
    from parley.tasks.data import load_items

    items = load_items("bundled")[:2]
    conditions = [parse_condition("base=tiny"), parse_condition("proactive=tiny,system_prompt=proactive")]
    settings = EvalSettings(assistant_max_tokens=24, max_new_turns=4, concurrency=4, run=RUN)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    opened = []

    async def main():
        engine = tiny_engine  # the shared one (tests/e2e/conftest.py): no chunked prefill
        backend = LocalBackend(engine, tok, model_name="tiny", owns_engine=False)
        nc = await connect(nats_server.url, name="eval-e2e")
        js = nc.jetstream()
        await topology.ensure_topology(js, RUN)
        sim_svc = Simulator(backend, SimConfig(max_tokens=40, max_retries=1)).service(nc)
        judge_svc = judge_service(nc, Judge(backend, JudgeConfig(max_tokens=200, max_retries=3)))
        await sim_svc.start()
        await judge_svc.start()

        async def open_policy(model):
            opened.append(model)
            return Policy(engine=engine, tokenizer=tok, version=0)

        async def on_record(rec):
            await publish(js, RUN, "eval", rec)

        services = EvalServices(
            open_policy=open_policy,
            sim=SimClient(nc, timeout_s=120, wait_s=600),
            judge=JudgeClient(nc, timeout=120),
            scorer_cfg=ScorerConfig(),
        )
        try:
            t0 = time.perf_counter()
            recs = await run_eval(conditions, items, settings, services, on_record)
            print(f"eval of {len(recs)} conversations: {time.perf_counter() - t0:.1f}s")
            return recs, await read_stream(js, RUN, "eval")
        finally:
            await sim_svc.stop(5)
            await judge_svc.stop(5)
            await nc.drain()

    records, stored = engines.run(main())
    assert opened == ["tiny"]  # both conditions share the model's engine
    assert [(r.condition, r.item_id) for r in records] == [(c.name, it.item_id) for c in conditions for it in items]
    assert sorted(stored, key=lambda r: r.eval_id) == sorted(records, key=lambda r: r.eval_id)
    by = {(r.condition, r.item_id): r for r in records}
    for it in items:
        base, pro = by["base", it.item_id], by["proactive", it.item_id]
        # The simulated user opens from scratch, with the same seed in both conditions.
        assert base.messages[0].role == "user" and pro.messages[0].role == "system"
        assert pro.messages[0].content == pro.system_prompt and base.system_prompt == ""
        assert base.messages[0].content == pro.messages[1].content
        assert base.sim_model == "tiny" and base.judge_model == "tiny"
        assert base.reference == it.reference and 0 < base.assistant_tokens <= 2 * 24
    unscored = [r.eval_id for r in records if not r.metrics]
    assert not unscored

    log = write_parquet(records, tmp_path / "bench" / "records.parquet")
    table = summarize(records, baseline="base")
    write_table(table, tmp_path / "bench")
    assert table.row("proactive").diffs["mr"].n == len(items)

    # Replay: other weights and no engine anywhere; the BLEU and interactivity columns are unchanged.
    replayed = reweight(read_records(log), {"bleu": 2.0, "interactivity": 0.5, "token_amount": -1.0})
    again = summarize(replayed, baseline="base", metrics=("bleu", "interactivity", "tokens_k", "mr", "reward"))
    for cond in ("base", "proactive"):
        for m in ("bleu", "interactivity", "tokens_k", "mr"):
            assert again.row(cond).means[m] == table.row(cond).means[m]
    # The records were scored with ScorerConfig()'s sacreBLEU; the embedded default config replays with
    # char BLEU unless told otherwise.
    res = CliRunner().invoke(
        app,
        ["replay", str(log), "--weights", "bleu=2,interactivity=0.5,token_amount=-1", "--bleu-variant", "sacrebleu"],
    )
    assert res.exit_code == 0, res.output
    original = (tmp_path / "bench" / "table.md").read_text().split("\n\n")[0]
    for line in original.splitlines()[2:]:
        assert line in res.stdout  # the same rows, plus the reward column
    print(res.stdout)
