"""The scorer's message handler with test doubles (no NATS): what it acks, naks and dead-letters."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from nats.js.api import PubAck

from parley.config.scorer import ScorerConfig
from parley.protocol import bus, codec, examples, topology
from parley.protocol.messages import ABANDONED_STALE, JudgeReply
from parley.scorer.scorer import Scorer
from parley.services.judge.client import JudgeUnavailable
from tests.factories import JudgeDouble

CFG = ScorerConfig(retry_delay_s=0.01, retry_max_delay_s=0.02, judge_wait_s=0.05)


def judge_double(**kw) -> JudgeDouble:
    """A fixed document and levels, or a failure reply, or unreachable."""
    return JudgeDouble(
        model="fake",
        document="A Week in Lisbon",
        levels={"understanding": 2, "clarification": 2, "suggestions": 2},
        **kw,
    )


def _traj(**kw):
    traj = examples.trajectory("unit")
    for k, v in kw.items():
        setattr(traj, k, v)
    return traj


class FakeMsg:
    """Stands in for a nats JetStream message: records acks and in_progress calls."""

    def __init__(self, delivered: int = 1):
        self.metadata = SimpleNamespace(num_delivered=delivered)
        self.acked = 0
        self.progress = 0

    async def ack(self):
        self.acked += 1

    async def in_progress(self):
        self.progress += 1


class FakeJetStream:
    """Stands in for JetStream publish: stores by Msg-Id and reports duplicates like the server."""

    def __init__(self):
        self.stored: dict[str, bytes] = {}

    async def publish(self, subject, data, headers, timeout):
        msg_id = headers["Nats-Msg-Id"]
        duplicate = msg_id in self.stored
        self.stored.setdefault(msg_id, data)
        return PubAck(stream="SCORED", seq=list(self.stored).index(msg_id) + 1, duplicate=duplicate or None)


def _scorer(judge, cfg=CFG):
    js = FakeJetStream()
    nc = SimpleNamespace(jetstream=lambda: js)
    return Scorer(nc, "unit", judge, cfg, topology.BusSettings(ack_wait_s=1.5), "scorer-u"), js


async def test_scored_is_stored_then_acked_and_a_redelivery_is_a_duplicate():
    scorer, js = _scorer(judge_double())
    msg = FakeMsg()
    await scorer.handle(_traj(), msg)
    assert msg.acked == 1 and list(js.stored) == ["scored:t-0001/0"]
    assert codec.decode("scored", js.stored["scored:t-0001/0"]).scorer == "scorer-u"
    again = FakeMsg(delivered=2)
    await scorer.handle(_traj(), again)
    assert again.acked == 1 and len(js.stored) == 1
    assert scorer.counters["scored"] == 1 and scorer.counters["duplicate"] == 1


async def test_judge_failure_is_nakked_with_back_off_not_scored():
    scorer, js = _scorer(judge_double(fail_op="interactivity"))
    msg = FakeMsg(delivered=3)
    with pytest.raises(bus.Retry) as e:
        await scorer.handle(_traj(), msg)
    assert e.value.delay == CFG.retry_delay(3) and "after 4 attempt" in str(e.value)
    assert msg.acked == 0 and not js.stored and scorer.counters["judge_retry"] == 1


class FlakyJudgeDouble(JudgeDouble):
    """Unreachable for the first `down` calls, then answers as judge_double()."""

    def __init__(self, down: int):
        super().__init__(
            model="fake", document="A Week in Lisbon", levels={"understanding": 2, "clarification": 2, "suggestions": 2}
        )
        self.down = down

    async def extract(self, messages, *, seed=0):
        if self.down > 0:
            self.down -= 1
            raise JudgeUnavailable("no judge service answers")
        return await super().extract(messages, seed=seed)


async def test_an_outage_is_waited_out_without_spending_a_delivery():
    cfg = ScorerConfig(retry_delay_s=0.01, retry_max_delay_s=0.02, judge_wait_s=60.0)
    scorer, js = _scorer(FlakyJudgeDouble(down=3), cfg)
    msg = FakeMsg()
    await scorer.handle(_traj(), msg)
    assert msg.acked == 1 and len(js.stored) == 1
    assert scorer.counters["judge_wait"] == 3 and scorer.counters["judge_retry"] == 0


async def test_a_long_outage_is_handed_back_with_back_off():
    scorer, js = _scorer(judge_double(unavailable=True))
    msg = FakeMsg(delivered=2)
    with pytest.raises(bus.Retry, match="JudgeUnavailable") as e:
        await scorer.handle(_traj(), msg)
    assert e.value.delay == CFG.retry_delay(2) and msg.acked == 0 and not js.stored


async def test_unscorable_trajectory_is_poison():
    scorer, _ = _scorer(judge_double())
    with pytest.raises(bus.Poison, match="no reference"):
        await scorer.handle(_traj(reference=""), FakeMsg())


async def test_stopping_hands_a_waiting_message_back_at_once():
    cfg = ScorerConfig(retry_delay_s=5.0, retry_max_delay_s=5.0, judge_wait_s=600.0)
    scorer, js = _scorer(judge_double(unavailable=True), cfg)
    scorer._stop = stop = asyncio.Event()
    msg = FakeMsg()
    task = asyncio.create_task(scorer.handle(_traj(), msg))
    await asyncio.sleep(0.05)
    stop.set()
    with pytest.raises(bus.Retry, match="stopping") as e:
        await asyncio.wait_for(task, 1.0)
    assert e.value.delay == 0.0 and msg.acked == 0


async def test_slow_judging_keeps_the_message_alive():
    class SlowJudgeDouble(JudgeDouble):
        async def interactivity(self, messages, *, seed=0):
            await asyncio.sleep(1.2)
            return JudgeReply(ok=True, levels={"understanding": 1, "clarification": 1, "suggestions": 1}, model="slow")

    scorer, _ = _scorer(SlowJudgeDouble(document="A Week in Lisbon"))  # ack_wait 1.5 s -> in_progress every 0.5 s
    msg = FakeMsg()
    await scorer.handle(_traj(), msg)
    assert msg.acked == 1 and msg.progress >= 2


async def test_a_conversation_its_actor_abandoned_is_passed_on_unjudged():
    """An actor stops a conversation whose group can no longer be trained (ABANDONED_STALE); judging
    half a conversation would spend the judge on a reward nobody uses: it is stored with total 0 and
    no metrics, and the judge is never asked (a judge that fails every call would make it a retry)."""
    scorer, js = _scorer(judge_double(fail_op="extract"))
    msg = FakeMsg()
    await scorer.handle(_traj(terminated=ABANDONED_STALE), msg)
    out = codec.decode("scored", js.stored["scored:t-0001/0"])
    assert msg.acked == 1 and out.total == 0.0 and out.metrics == {} and out.judge == []
    assert out.trajectory.terminated == ABANDONED_STALE and scorer.counters["abandoned_stale"] == 1
