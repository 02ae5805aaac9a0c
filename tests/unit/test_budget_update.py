"""An operator's live change of a run's call limits (services.budget.follow_updates, `parley auth budget`):
the new run totals become this process's share at once, calls waiting on a spent budget or on a slow
rate go on, an update that does not decode is ignored; and by construction of deploy/permissions.py
only the admin may publish on the control subject the actors and scorers hear it on. The NATS
connection is `NatsDouble`, a test double that hands the subscription's callback to the test."""

from __future__ import annotations

import asyncio
import logging

import pytest

from parley.deploy import permissions
from parley.deploy.permissions import CONTROL_PUBLISHERS, ROLES, role_permissions, subject_matches
from parley.protocol import codec, topology
from parley.protocol.messages import BudgetUpdate
from parley.services.budget import CallBudget, follow_updates


def test_new_run_totals_become_this_processes_share_and_waiting_calls_go_on():
    async def main():
        budget = CallBudget.of_run("sim_budget", 4, 0.0, processes=2)
        assert budget.budget == 2
        await budget.acquire()
        await budget.acquire()
        waiting = asyncio.create_task(budget.acquire())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert budget.update(total=None, total_per_s=None) is False  # nothing asked: nothing changes
        assert budget.update(total=10) is True  # the run's 10 calls: 5 for this one of 2 processes
        await asyncio.wait_for(waiting, 1)
        assert budget.budget == 5 and budget.calls == 3 and budget.counters()["sim_budget.left"] == 2
        assert budget.update(total=0) and not budget.spent  # 0: unlimited

    asyncio.run(main())


def test_a_call_held_by_a_slow_rate_goes_on_when_the_rate_is_raised():
    async def main():
        budget = CallBudget("judge_budget", per_s=0.1)  # one call, then the next in 10 s
        await budget.acquire()
        waiting = asyncio.create_task(budget.acquire())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        t0 = asyncio.get_running_loop().time()
        budget.update(total_per_s=50.0)
        await asyncio.wait_for(waiting, 1)  # woken by the change, not after the old rate's 10 s
        assert asyncio.get_running_loop().time() - t0 < 0.5 and budget.per_s == 50.0
        budget.update(total_per_s=0.0)  # unlimited
        await asyncio.wait_for(asyncio.gather(*(budget.acquire() for _ in range(100))), 1)

    asyncio.run(main())


class NatsDouble:
    """Test double of a NATS connection: records each subscription and its callback."""

    def __init__(self):
        self.subs: dict[str, object] = {}

    async def subscribe(self, subject, cb):
        self.subs[subject] = cb
        return self


class MsgDouble:
    def __init__(self, subject: str, data: bytes):
        self.subject, self.data = subject, data


def test_follow_updates_applies_its_kinds_fields_and_ignores_what_does_not_decode(caplog):
    async def main():
        nc = NatsDouble()
        sim = CallBudget.of_run("sim_budget", 100, 2.0, processes=4)
        judge = CallBudget.of_run("judge_budget", 100, 0.0, processes=2)
        await follow_updates(nc, "r1", "sim", sim)
        subject = topology.control_subject("r1", "budget")
        on_update = nc.subs[subject]
        judge_nc = NatsDouble()
        await follow_updates(judge_nc, "r1", "judge", judge)
        update = BudgetUpdate(sim_call_budget=400, judge_call_budget=60, judge_calls_per_s=3.0)
        for cb in (on_update, judge_nc.subs[subject]):
            await cb(MsgDouble(subject, codec.encode(update)))
        assert (sim.budget, sim.per_s) == (100, 0.5)  # its share of 400; the rate not named stays
        assert (judge.budget, judge.per_s) == (30, 1.5)
        with caplog.at_level(logging.WARNING, logger="parley.services.budget"):
            await on_update(MsgDouble(subject, b"\x93not a budget"))
            await on_update(MsgDouble(subject, codec.encode({"sim_call_budget": -5})))
        assert sim.budget == 100
        assert sum("not understood and is ignored" in r.getMessage() for r in caplog.records) == 2

    asyncio.run(main())
    with pytest.raises(ValueError, match="budget kind 'learner'"):
        asyncio.run(follow_updates(NatsDouble(), "r1", "learner", CallBudget("x")))


@pytest.mark.parametrize("run", ["r1", "*"])
def test_only_the_admin_may_publish_the_control_and_the_budget_holders_hear_it(run):
    perms = role_permissions(run)
    concrete = topology.control_subject("r1", "budget")
    for role in ROLES:
        publish = perms[role]["publish"]["allow"]
        may = any(subject_matches(p, concrete) for p in publish)
        assert may == (role in CONTROL_PUBLISHERS), (role, publish)
    for role in permissions.BUDGET_FOLLOWERS:
        assert any(subject_matches(s, concrete) for s in perms[role]["subscribe"]["allow"]), role


def test_a_table_that_would_let_a_role_publish_a_control_is_refused(monkeypatch):
    real = permissions._role_rules

    def loose(run, role, user):
        rules = real(run, role, user)
        if role == "scorer":
            rules["publish"]["allow"].append("parley.*.control.>")
        return rules

    monkeypatch.setattr(permissions, "_role_rules", loose)
    with pytest.raises(AssertionError, match="role 'scorer' would be allowed to publish operator controls"):
        role_permissions("r1")
