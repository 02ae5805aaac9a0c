"""The judge's reliability watched while training ([scorer] audit_*, rewards.reliability): a share of
trajectories judged a second time at another seed; agreement, tie share and drift across policy
versions in the scorer's heartbeat (Prometheus, live view); flagged when agreement falls below the
bar. The scorer's handler runs with test doubles (no NATS), on the embedded default's reward."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
from nats.js.api import PubAck

from parley.config.scorer import ScorerConfig
from parley.deploy.live import Snapshot, judge_reliability, render
from parley.protocol import codec, topology
from parley.protocol.messages import Heartbeat, JudgeRequest
from parley.rewards.reliability import JudgeReliability, audited
from parley.runtime import metrics
from parley.scorer.scorer import AUDIT_SEED_SHIFT, Scorer
from tests.factories import JudgeDouble, trajectory, turn

AUDIT = ScorerConfig(audit_fraction=1.0, audit_min_samples=6, audit_window=50, audit_min_agreement=0.8)


class JudgeDriftingDouble(JudgeDouble):
    """Test double of a judge that drifts: for its first `steady` interactivity calls it answers
    the levels it was given, after that each verdict follows the seed it is asked at, so a second
    verdict at another seed disagrees with the first."""

    def __init__(self, steady: int = 0, **kw):
        super().__init__(document="A Week in Lisbon", **kw)
        self.steady, self.n = steady, 0

    async def interactivity(self, messages, *, seed=0):
        self.n += 1
        reply = await super().interactivity(messages, seed=seed)
        if self.n > self.steady:
            reply.levels = {k: seed % 4 for k in reply.levels}
        return reply


class FakeMsg:
    """Stands in for a nats JetStream message (acks only)."""

    def __init__(self):
        self.metadata = SimpleNamespace(num_delivered=1)

    async def ack(self):
        pass

    async def in_progress(self):
        pass


class FakeJetStream:
    """Stands in for JetStream publish: stores by Msg-Id and reports duplicates like the server."""

    def __init__(self):
        self.stored: dict[str, bytes] = {}

    async def publish(self, subject, data, headers, timeout):
        duplicate = headers["Nats-Msg-Id"] in self.stored
        self.stored.setdefault(headers["Nats-Msg-Id"], data)
        return PubAck(
            stream="SCORED", seq=list(self.stored).index(headers["Nats-Msg-Id"]) + 1, duplicate=duplicate or None
        )


def _scorer(judge, cfg=AUDIT):
    js = FakeJetStream()
    nc = SimpleNamespace(jetstream=lambda: js)
    return Scorer(nc, "unit", judge, cfg, topology.BusSettings(ack_wait_s=1.5), "scorer-u"), js


async def _score_groups(scorer, groups: int, n: int = 2, version=lambda g: 0):
    for g in range(groups):
        for i in range(n):
            traj = trajectory(
                task_id=f"t-{g:04d}", sample=i, seed=100 * g + i, turns=[turn(4, [-0.5] * 3, version=version(g))]
            )
            await scorer.handle(traj, FakeMsg())


async def test_a_drifting_judge_is_flagged_in_the_heartbeat_and_the_log(caplog):
    scorer, js = _scorer(JudgeDriftingDouble())
    with caplog.at_level(logging.WARNING, logger="parley.rewards.reliability"):
        await _score_groups(scorer, 5)
    hb = scorer.heartbeat().counters
    assert hb["judge_audit.audited"] == 10
    # the extracted document (bleu) agrees; interactivity follows the seed, so it does not
    assert hb["judge_audit.agreement.bleu"] == 1.0 and hb["judge_audit.agreement.interactivity"] < 0.5
    assert hb["judge_audit.agreement"] < AUDIT.audit_min_agreement
    assert hb["judge_audit.flagged"] == 1.0 and hb["judge_audit.flags"] == 1.0
    flagged = [r for r in caplog.records if "JUDGE UNRELIABLE" in r.message]
    assert len(flagged) == 1, "logged once when agreement falls, not at every sample"
    assert "audit_min_agreement 0.800" in flagged[0].message
    # the second verdict is stored beside the first, at its own seed, and never rewarded
    s = codec.decode("scored", js.stored["scored:t-0000/0"])
    assert [o.seed for o in s.audit] == [AUDIT_SEED_SHIFT, AUDIT_SEED_SHIFT]
    assert set(s.audit_metrics) == {"bleu", "interactivity"}
    assert s.audit_metrics["interactivity"] != s.metrics["interactivity"]
    # the Prometheus series and the live view show it
    families = {metrics.family_of("scorer", k)[0].name for k in hb}
    assert {"parley_scorer_judge_agreement", "parley_scorer_judge_flagged", "parley_scorer_judge_tie_share"} <= families
    snap = Snapshot(roles={"scorer/scorer-u": Heartbeat(role="scorer", id="scorer-u", state="ready", counters=hb)})
    rows, lines = judge_reliability(snap)
    assert ("judge_audit.agreement (scorer-u)", f"{hb['judge_audit.agreement']:.4g}") in rows
    assert lines and lines[0].startswith("JUDGE UNRELIABLE on scorer-u")
    assert render(snap, "unit").renderables[2].caption == lines[0]


async def test_a_consistent_judge_is_not_flagged(caplog):
    scorer, js = _scorer(JudgeDouble(document="A Week in Lisbon"))
    with caplog.at_level(logging.WARNING, logger="parley.rewards.reliability"):
        await _score_groups(scorer, 5)
    hb = scorer.heartbeat().counters
    assert hb["judge_audit.audited"] == 10
    assert hb["judge_audit.agreement"] == 1.0 and hb["judge_audit.flagged"] == 0.0 and hb["judge_audit.flags"] == 0
    assert hb["judge_audit.gap"] == 0.0
    # every sample of a group got the same verdicts: each same-group pair ties
    assert hb["judge.tie_share"] == 1.0
    assert not [r for r in caplog.records if "JUDGE UNRELIABLE" in r.message]
    _, lines = judge_reliability(Snapshot(roles={"s": Heartbeat(role="scorer", id="s", state="ready", counters=hb)}))
    assert lines == []


async def test_drift_across_versions_shows_the_judge_failing_on_later_policy_versions():
    """Consistent on the first groups (version 0), drifting on the later ones (version 5)."""
    scorer, _ = _scorer(JudgeDriftingDouble(steady=8))
    await _score_groups(scorer, 8, version=lambda g: 0 if g < 2 else 5)
    hb = scorer.heartbeat().counters
    assert scorer.reliability.by_version[0] == [8, 8]
    assert hb["judge_audit.drift"] < -0.3


async def test_no_second_verdict_without_audit_fraction_and_none_for_a_failed_audit():
    scorer, js = _scorer(JudgeDouble(document="A Week in Lisbon"), ScorerConfig())
    await _score_groups(scorer, 2)
    hb = scorer.heartbeat().counters
    assert hb["judge_audit.audited"] == 0 and "judge_audit.agreement" not in hb
    assert "judge.tie_share" in hb  # the tie share needs no second verdict
    assert codec.decode("scored", js.stored["scored:t-0000/0"]).audit == []
    # the audit judge fails: the trajectory is scored and stored all the same
    scorer, js = _scorer(JudgeDouble(document="A Week in Lisbon"))
    scorer.audit_judge = JudgeDouble(fail_op="interactivity")
    await _score_groups(scorer, 1)
    assert len(js.stored) == 2 and scorer.counters["judge_audit.failed"] == 2


def test_audited_share_is_about_the_fraction_and_stable():
    ids = [f"t-{i:05d}/{j}" for i in range(2000) for j in range(2)]
    share = sum(audited(t, 0.1) for t in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [audited(t, 0.1) for t in ids[:50]] == [audited(t, 0.1) for t in ids[:50]]
    assert not any(audited(t, 0.0) for t in ids) and all(audited(t, 1.0) for t in ids)


def test_the_flag_waits_for_min_samples_and_clears_when_agreement_recovers(caplog):
    mon = JudgeReliability(["x"], tolerance=0.1, min_agreement=0.8, window=10, min_samples=4)
    for i in range(3):
        mon.observe(f"t{i}", 0, {"x": 0.0}, {"x": 1.0})
    assert not mon.flagged and math.isnan(mon.drift())
    mon.observe("t3", 0, {"x": 0.0}, {"x": 1.0})
    assert mon.flagged and mon.flags == 1
    with caplog.at_level(logging.INFO, logger="parley.rewards.reliability"):
        for i in range(10):
            mon.observe(f"u{i}", 1, {"x": 0.5}, {"x": 0.55})
    assert not mon.flagged and mon.agreement() == 1.0
    assert any("back to" in r.message for r in caplog.records)
    assert mon.drift() == pytest.approx(1.0)  # version 1 agrees fully, version 0 never did


def test_the_judge_service_samples_a_second_verdict_at_the_requested_temperature():
    """JudgeRequest.temperature (the scorer's audit_temperature) reaches the judge's first attempt;
    -1, the default, keeps the service's own."""
    assert JudgeRequest(op="extract", messages=[]).temperature == -1.0
    decoded = codec.decode("judge.request", codec.encode(JudgeRequest(op="extract", messages=[], temperature=0.7)))
    assert decoded.temperature == 0.7
