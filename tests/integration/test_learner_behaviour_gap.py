"""A step whose behaviour log-probs cannot be the trained model's is flagged ([learner]
behaviour_gap_alarm): the learner's log warns once for it, metrics.jsonl marks it, and the heartbeat,
Prometheus and the live view carry it; at [learner] behaviour_gap_stop flagged steps the learner stops
with that reason (a config error: `parley up` does not restart it). On an H100 (2026-12-07) an actor
engine that computed the model wrongly gave steps 1.6-3.8 nats apart, which trained on in silence.
The real Learner on a real nats-server, with a test-double trainer that reports such gaps."""

from __future__ import annotations

import json
import logging

import pytest

from parley.deploy.live import Snapshot, render
from parley.errors import ConfigError
from parley.protocol import topology
from parley.runtime import metrics
from tests.integration.test_learner_fates import BUS, TrainerDouble, drive, make_cfg
from tests.integration.test_learner_step_failure import run_once

pytestmark = [pytest.mark.integration]


class WrongEngineTrainerDouble(TrainerDouble):
    """Test double of learner.ranks.Driver: its train_step reports the mean |learner - behaviour|
    log-prob of `gaps[k]` on its k-th call, as the real trainer measures it."""

    def __init__(self, gaps: list[float]):
        super().__init__()
        self.gaps = gaps

    def __call__(self, op, *args):
        out = super().__call__(op, *args)
        if op == "train_step":
            out["logp_mismatch"] = self.gaps[self.calls.count("train_step") - 1]
        return out


async def test_a_step_far_from_the_behaviour_log_probs_is_flagged_everywhere(js, nc, tmp_path, caplog):
    run, run_dir = "gap", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=2, groups_per_step=1, max_staleness=1)
    await topology.ensure_topology(js, run, BUS)
    with caplog.at_level(logging.WARNING, logger="parley.learner.stepper"):
        learner, _ = await drive(js, nc, cfg, lambda i: "answer", trainer=WrongEngineTrainerDouble([0.52, 3.1]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("behaviour_gap", False) for r in rows] == [False, True]
    warned = [r.getMessage() for r in caplog.records if "behaviour log-probs" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 2: ") and "by 3.10 nats" in warned[0]
    assert "kv_cache_dtype" in warned[0] and "\n" not in warned[0]
    # the last step's flag and its gap reach the heartbeat, Prometheus and the live view
    beat = learner.heartbeat()
    assert beat.counters["train.behaviour_gap"] == 1.0 and beat.counters["train.logp_mismatch"] == 3.1
    families = {metrics.family_of("learner", k)[0].name for k in ("train.behaviour_gap", "train.logp_mismatch")}
    assert families == {"parley_learner_behaviour_gap", "parley_learner_logp_mismatch"}
    caption = render(Snapshot(roles={f"learner/{beat.id}": beat}), "unit").renderables[2].caption
    assert caption.startswith("BEHAVIOUR GAP") and "3.1 nats" in caption


async def test_the_alarm_at_zero_is_off(js, nc, tmp_path, caplog):
    run, run_dir = "gapoff", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=1, groups_per_step=1, max_staleness=1, behaviour_gap_alarm=0.0)
    await topology.ensure_topology(js, run, BUS)
    with caplog.at_level(logging.WARNING, logger="parley.learner.stepper"):
        learner, _ = await drive(js, nc, cfg, lambda i: "answer", trainer=WrongEngineTrainerDouble([3.1]))
    assert "behaviour_gap" not in json.loads((run_dir / "metrics.jsonl").read_text())
    assert not [r for r in caplog.records if "behaviour log-probs" in r.getMessage()]
    assert learner.heartbeat().counters["train.behaviour_gap"] == 0.0


async def test_the_learner_stops_at_behaviour_gap_stop_flagged_steps_after_the_last_is_durable(js, nc, tmp_path):
    run, run_dir = "gapstop", tmp_path / "run"
    cfg = make_cfg(run, run_dir, steps=6, groups_per_step=1, max_staleness=1, behaviour_gap_stop=2)
    await topology.ensure_topology(js, run, BUS)
    ended = await run_once(js, nc, cfg, WrongEngineTrainerDouble([3.1, 0.2, 2.4, 0.1, 0.1, 0.1]), resume=False)
    assert isinstance(ended, ConfigError) and ended.exit_code == 2
    text = str(ended)
    assert text.startswith("2 steps (the last: step 3) had behaviour log-probs more than 1 nats")
    assert "behaviour_gap_stop = 0 (now 2)" in text and "\n" not in text
    # the third step's lines were written before the stop
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("behaviour_gap", False) for r in rows] == [True, False, True]
    assert len((run_dir / "trained.jsonl").read_text().splitlines()) == 3
