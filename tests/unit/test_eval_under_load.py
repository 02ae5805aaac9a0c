"""The eval side under load, with test doubles for the policy engine, the simulator and the judge:
a slow or absent judge is waited for within [scorer] judge_wait_s, a failed verdict is asked again with
a new seed, a simulator that never answers costs only its item, every conversation not scored is
reported with its reason, an eval that scored nothing ends with the reasons (exit 3), not a traceback,
and the periodic eval quotes them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from parley.config.scorer import ScorerConfig
from parley.evaluation.commands import report
from parley.evaluation.runner import (
    EvalServices,
    EvalSettings,
    NotScored,
    Policy,
    parse_condition,
    read_unscored,
    run_eval,
    score_within_bounds,
)
from parley.protocol.bus import Retry
from parley.protocol.messages import JudgeReply, SimReply
from parley.services.judge.client import JudgeFailed, JudgeUnavailable
from parley.tasks.data import load_items
from tests.unit.test_rollout import EngineDouble

DOC = "Three Days in Lisbon\n\nWe walked the hills of Alfama and ate too many custard tarts in Belem today."
# Back-off of a millisecond: the waits are real, but the test does not sit through seconds of them.
FAST = {"retry_delay_s": 0.001, "retry_max_delay_s": 0.001}


class SimDouble:
    """Test double of the simulator client: the user answers once and is done; items listed in
    `absent` raise Retry as SimClient does when the service stays unreachable."""

    def __init__(self, absent=()):
        self.absent = set(absent)

    async def ask(self, req):
        if req.reference in self.absent:
            raise Retry("user simulator unavailable on parley.svc.sim: TimeoutError after 180s", delay=10.0)
        return SimReply(message="thanks, that is all", done=True, model="sim-double")


class JudgeDouble:
    """Test double of the judge: unreachable for its first `unavailable` calls (or forever with None),
    an ok=False verdict for the first `failing` extract calls of each conversation, else a verdict."""

    def __init__(self, unavailable=0, failing=0):
        self.unavailable, self.failing = unavailable, failing
        self.calls, self.seeds = 0, []
        self.extracts: dict[int, int] = {}

    def _gate(self):
        self.calls += 1
        if self.unavailable is None or self.calls <= self.unavailable:
            raise JudgeUnavailable("judge on parley.svc.judge.extract did not answer within 300s")

    async def ask(self, op, messages, *, seed=0):  # services.judge.client.Judge: one entry, by op
        return await getattr(self, op)(messages, seed=seed)

    async def extract(self, messages, *, seed=0):
        self._gate()
        self.seeds.append(seed)
        key = id(messages[0])  # one conversation
        self.extracts[key] = self.extracts.get(key, 0) + 1
        if self.extracts[key] <= self.failing:
            return JudgeReply(ok=False, attempts=4, error="attempt 4: Unterminated string", model="judge-double")
        return JudgeReply(ok=True, document=DOC, raw="{}", model="judge-double")

    async def interactivity(self, messages, *, seed=0):
        await asyncio.sleep(0)
        return JudgeReply(
            ok=True, levels={"understanding": 2, "clarification": 2, "suggestions": 2}, raw="{}", model="judge-double"
        )


def evaluate(tok, judge, sim=None, scorer=None, attempts=3, n_items=3):
    items = load_items("bundled")[:n_items]
    engine = EngineDouble(tok, ["Here is a draft about your trip, with the days in order."])
    engine.settings = SimpleNamespace(max_model_len=2048)

    async def open_policy(model):
        return Policy(engine=engine, tokenizer=tok, version=0)

    services = EvalServices(
        open_policy=open_policy, sim=sim or SimDouble(), judge=judge, scorer_cfg=scorer or ScorerConfig(**FAST)
    )
    settings = EvalSettings(assistant_max_tokens=32, max_new_turns=4, concurrency=2, judge_attempts=attempts)
    missing: list[NotScored] = []
    records = asyncio.run(run_eval([parse_condition("v0=tiny")], items, settings, services, on_missing=missing.append))
    return items, records, missing


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_a_slow_judge_is_waited_for_and_every_item_scored(tok):
    judge = JudgeDouble(unavailable=5)
    items, records, missing = evaluate(tok, judge)
    assert len(records) == len(items) and all(r.metrics for r in records)
    assert missing == []


def test_a_judge_that_stays_away_is_reported_per_item_after_the_bound(tok):
    items, records, missing = evaluate(
        tok, JudgeDouble(unavailable=None), scorer=ScorerConfig(judge_wait_s=0.02, **FAST)
    )
    assert len(records) == len(items) and not any(r.metrics for r in records)  # played, kept, unscored
    assert sorted(m.item_id for m in missing) == sorted(i.item_id for i in items)
    assert all(m.stage == "judge" and "JudgeUnavailable" in m.reason and "judge_wait_s=0s" in m.reason for m in missing)


def test_a_failed_verdict_is_asked_again_with_a_new_seed(tok):
    judge = JudgeDouble(failing=2)
    _, records, missing = evaluate(tok, judge, attempts=3, n_items=1)
    assert records[0].metrics and missing == []
    assert len(set(judge.seeds)) == 3  # three verdicts, three seeds
    judge = JudgeDouble(failing=5)
    _, records, missing = evaluate(tok, judge, attempts=2, n_items=1)
    assert not records[0].metrics
    assert (
        "JudgeFailed" in missing[0].reason
        and "Unterminated string" in missing[0].reason
        and "verdict 2 of 2" in missing[0].reason
    )


def test_a_silent_simulator_costs_only_its_item(tok):
    items = load_items("bundled")[:3]
    _, records, missing = evaluate(tok, JudgeDouble(), sim=SimDouble(absent={items[1].reference}))
    assert [r.item_id for r in records] == [items[0].item_id, items[2].item_id]
    assert [(m.item_id, m.stage) for m in missing] == [(items[1].item_id, "conversation")]
    assert "the user simulator did not answer" in missing[0].reason


async def test_score_within_bounds_raises_the_last_error_with_the_bound():
    from parley.protocol import examples

    traj = examples.trajectory("unit")
    traj.futures = []
    with pytest.raises(JudgeUnavailable, match=r"waited \d+s, the bound is \[scorer\] judge_wait_s=0s"):
        await score_within_bounds(traj, JudgeDouble(unavailable=None), ScorerConfig(judge_wait_s=0.0, **FAST), 3)
    with pytest.raises(JudgeFailed, match="verdict 1 of 1"):
        await score_within_bounds(traj, JudgeDouble(failing=9), ScorerConfig(**FAST), 1)


def test_an_eval_that_scored_nothing_reports_why_and_exits_3(tok, tmp_path, capsys):
    items, records, missing = evaluate(
        tok, JudgeDouble(unavailable=None), scorer=ScorerConfig(judge_wait_s=0.0, **FAST)
    )
    code = report(records, missing, len(items), "v0", tmp_path)
    err = capsys.readouterr().err
    assert code == 3
    assert f"{len(items)} of {len(items)} conversations not scored" in err and "no conversation was scored" in err
    assert all(f"v0/{i.item_id}/0 (judge): JudgeUnavailable" in err for i in items)
    assert read_unscored(tmp_path) == missing and (tmp_path / "records.parquet").is_file()
    assert not (tmp_path / "table.md").exists()
    assert report([], [], 0, "v0", tmp_path / "empty") == 3  # nothing at all: still no traceback


def test_a_partly_scored_eval_has_a_table_and_names_the_rest(tok, tmp_path, capsys):
    items = load_items("bundled")[:3]
    _, records, missing = evaluate(tok, JudgeDouble(), sim=SimDouble(absent={items[0].reference}))
    assert report(records, missing, 3, "v0", tmp_path) == 0
    captured = capsys.readouterr()
    assert (
        "1 of 3 conversations not scored" in captured.err and f"v0/{items[0].item_id}/0 (conversation)" in captured.err
    )
    assert "| v0 |" in captured.out and (tmp_path / "table.md").is_file()


def test_periodic_eval_quotes_the_per_item_reasons(tmp_path):
    from parley.evaluation.runner import write_unscored
    from parley.learner import checkpoint as ckpt
    from tests.unit.test_periodic_eval import make_run

    cfg, run_dir = make_run(tmp_path)

    async def scored_nothing(job, out):
        write_unscored([NotScored("v0/item-1/0", "v0", "item-1", "judge", "JudgeUnavailable: no answer in 300s")], out)
        (out / "eval.log").write_text("...\n")
        return 3

    from parley.evaluation.periodic import EvalJob, PeriodicEval

    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=scored_nothing)
    outcome = asyncio.run(pe.evaluate(EvalJob(version=0, step=0, model="tiny")))
    assert not outcome.ok
    assert outcome.error.startswith(
        "no conversation scored (1 not): v0/item-1/0 (judge): JudgeUnavailable: no answer in 300s"
    )
    assert outcome.unscored == ["v0/item-1/0 (judge): JudgeUnavailable: no answer in 300s"]
    assert (run_dir / "eval" / "v0.failed" / "unscored.jsonl").is_file()
    assert json.loads((run_dir / "eval" / "v0.failed" / "unscored.jsonl").read_text())["stage"] == "judge"
