"""The ledger's fence (learner.intake.Intake.flush with Intake.fence = learner.lease.Lease.holds): while
the run's lease is not known to be held, a flush writes no ledger and acks nothing; once it is held
again the same messages are written and acked. Lease.holds turns stale once the last renewal is older
than the TTL less one renewal period."""

from __future__ import annotations

import asyncio
import time

from parley.learner.lease import Lease
from tests.unit.test_intake_foreign import intake


class LeaseDouble:
    """Stands in for learner.lease.Lease: only `holds`, switched by the test."""

    def __init__(self):
        self.held = False

    def holds(self) -> bool:
        return self.held


class AckedMsgDouble:
    """Stands in for a nats Msg: records its ack."""

    def __init__(self):
        self.acked = False

    async def ack(self):
        self.acked = True


def test_a_flush_without_the_lease_writes_nothing_and_acks_nothing(tmp_path):
    i = intake(tmp_path)
    lease = LeaseDouble()
    i.fence = lease.holds
    msgs = [AckedMsgDouble(), AckedMsgDouble()]
    i.pending = list(msgs)

    assert asyncio.run(i.flush()) is False
    assert i.ledger.bytes_written == 0 and not list(tmp_path.glob("**/state.msgpack*"))
    assert i.pending == msgs and not any(m.acked for m in msgs)  # kept for a write once the lease is held

    lease.held = True
    assert asyncio.run(i.flush()) is True
    assert i.ledger.bytes_written > 0 and all(m.acked for m in msgs) and i.pending == []


def test_a_lease_holds_until_its_last_renewal_is_older_than_three_quarters_of_the_ttl():
    lease = Lease(None, "r1", "holder", ttl_s=8.0)
    assert not lease.holds()  # never taken
    lease.revision, lease.renewed = 5, time.monotonic()
    assert lease.holds()
    lease.renewed = time.monotonic() - 5.9
    assert lease.holds()
    lease.renewed = time.monotonic() - 6.1
    assert not lease.holds()
