"""The learner's periodic eval and early stop, in process over a real nats-server: a test-double trainer
(no DeepSpeed; it writes weight files and sleeps a little per step) and a test-double eval launcher that
plants per-version benchmark records (v0 < v1, then v2 far below v1). The learner evaluates versions
0, 1, 2, ..., notices v2's significant regression of MR and stops before its step budget, with the reason
in RUN_DIR/eval/early_stop.json; `parley select` then names v1."""

from __future__ import annotations

import asyncio
import json

import pytest

from parley.config.learner import LearnerConfig, RolloutConfig
from parley.config.run import RunConfig
from parley.evaluation.selection import select_best
from parley.protocol import topology
from parley.protocol.bus import publish
from tests.integration.test_learner_fates import TrainerDouble
from tests.integration.test_learner_resume import BUS, make_scored, toy  # noqa: F401 (toy: the fixture)
from tests.unit.test_periodic_eval import PlantedEval

pytestmark = [pytest.mark.integration]
RUN, N, STEPS = "earlystop", 3, 8


async def test_learner_stops_early_on_a_significant_regression(js, nc, toy, tmp_path):
    from parley.learner.service import Learner

    model, tok, hf = toy
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text((model / "config.json").read_text())  # the learner reads vocab_size
    (base / "tokenizer.json").write_text("{}")
    run_dir = tmp_path / "run"
    cfg = RunConfig(
        bus=BUS,
        rollout=RolloutConfig(n=N),
        learner=LearnerConfig(
            steps=STEPS,
            groups_per_step=1,
            max_staleness=STEPS,
            eval_every=1,
            eval_items=12,
            early_stop=True,
            ledger_flush_s=0.5,
            accept_foreign_scored=True,  # its samples are synthetic: no feeder issued their tasks
        ),
    )
    cfg.run.name, cfg.run.dir = RUN, str(run_dir)
    await topology.ensure_topology(js, RUN, BUS)
    for g in range(STEPS):
        for s in range(N):
            await publish(js, RUN, "scored", make_scored(tok, hf, RUN, g, s))

    plan = {0: (0.45, 0.80, 2.0), 1: (0.50, 0.82, 2.0), 2: (0.38, 0.55, 2.0)}
    plan |= {v: (0.38, 0.55, 2.0) for v in range(3, STEPS + 1)}
    evals = PlantedEval(plan)
    trainer = TrainerDouble(step_s=1.0)
    learner = Learner(cfg, js, nc, trainer, model_dir=base, resume=False, steps=STEPS, eval_launch=evals)
    code = await asyncio.wait_for(learner.run(asyncio.Event()), timeout=120)

    assert code == 0
    assert 2 <= learner.state.step < STEPS  # stopped once v2's eval was in, well before the budget
    assert [j.version for j in evals.jobs][:3] == [0, 1, 2]
    saved = json.loads((run_dir / "eval" / "early_stop.json").read_text())
    assert saved["version"] == 2 and saved["metric"] == "mr"
    assert saved["reason"].startswith("mr of version 2 is below version 1's")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == learner.state.step
    assert select_best(run_dir, "mr").version == 1
