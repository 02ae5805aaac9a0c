"""A sample longer than the learner's memory plan holds in one micro-batch is refused at the intake
with a dead letter naming its length and the setting to raise (issue 57: the sequence length was
bounded by the policy's positions only). The plan (deploy.memory.micro_batch_tokens) sizes a
micro-batch for the larger of [learner] micro_batch_tokens and [actor.engine] max_model_len, because
learner.packing.pack_by_tokens gives a longer sequence a micro-batch of its own: before this bound a
sample of up to the policy's positions reached the GPU alone, and ran the step out of memory at each
of its attempts."""

from __future__ import annotations

import asyncio

import pytest

from parley.config.run import load_config
from parley.learner import checkpoint as ckpt
from parley.learner.feeder import Issued, task_id
from parley.learner.groups import Grouper
from parley.learner.intake import Intake, memory_bound
from parley.learner.packing import pack_by_tokens
from parley.learner.runstate import RunState
from parley.protocol.bus import Poison
from tests.unit.test_groups import scored
from tests.unit.test_learner_clock import feeder

N_TOKENS = 6  # tests.unit.test_groups.scored's conversation


class MsgDouble:
    """Stands in for a nats Msg: the intake only keeps it for the ack."""


def intake(tmp_path, bound) -> Intake:
    g = Grouper(2, max_staleness=0, stale_policy="drop", timeout_s=600.0)
    g.done.prefix = "r1-g"
    i = Intake(
        RunState(steps=0),
        g,
        feeder(None),
        ckpt.Ledger(tmp_path),
        limits=(100, None),  # no position limit: only the memory bound holds
        reference_service=False,
        ack_wait_s=30.0,
        flush_s=1.0,
        started=0.0,
        memory_bound=bound,
    )
    i.feeder.state.in_flight[task_id("r1", 0)] = Issued(at=0.0, version=0)
    return i


def test_the_bound_is_the_memory_plans_longest_micro_batch():
    cfg = load_config(None, ["learner.micro_batch_tokens=1024", "actor.engine.max_model_len=4096"])
    assert memory_bound(cfg)[0] == 4096
    cfg = load_config(None, ["learner.micro_batch_tokens=8192", "actor.engine.max_model_len=4096"])
    limit, source = memory_bound(cfg)
    assert limit == 8192 and "micro_batch_tokens=8192" in source and "max_model_len=4096" in source
    # why the bound is the larger of the two: a sequence over the budget is packed alone, whatever its length
    assert pack_by_tokens([9000, 10, 10], 4096) == [[0], [1, 2]]


def test_a_sample_longer_than_the_memory_plan_is_a_dead_letter(tmp_path):
    i = intake(tmp_path, (N_TOKENS - 1, "the larger of [learner] micro_batch_tokens=5 and ..."))
    with pytest.raises(Poison) as e:
        asyncio.run(i.on_scored(scored(task_id("r1", 0), 0, 0.1), MsgDouble()))
    why = str(e.value)
    assert f"{N_TOKENS} tokens, more than the {N_TOKENS - 1} one micro-batch" in why
    assert f"raise learner.micro_batch_tokens to at least {N_TOKENS}" in why
    assert not i.grouper.buffer and not i.pending  # never buffered, never trained

    i = intake(tmp_path, (N_TOKENS, "exactly"))
    asyncio.run(i.on_scored(scored(task_id("r1", 0), 0, 0.1), MsgDouble()))
    assert task_id("r1", 0) in i.grouper.buffer and len(i.pending) == 1
