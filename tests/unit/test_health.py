"""/healthz and /readyz beside /metrics (runtime.metrics.serve): read from the heartbeats the process
sends (protocol.status.send), so ready = connected to NATS (the "starting" hello went out) and the work
loop started (a later state); live unless a running role fell silent."""

import asyncio
import time
import urllib.error
import urllib.request

import pytest

from parley.protocol import status
from parley.protocol.messages import Heartbeat
from parley.runtime.metrics import STALE_S, HeartbeatCollector, serve


class BusDouble:
    """Stands in for a NATS connection: takes the heartbeat's publish."""

    def __init__(self):
        self.subjects = []

    async def publish(self, subject, data):
        self.subjects.append(subject)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def endpoint():
    collector = HeartbeatCollector()
    port = serve(0, "127.0.0.1", collector)
    yield port, collector
    status.OBSERVERS.remove(collector.observe)


def beat(state: str, role: str = "actor", ident: str = "actor-0") -> None:
    asyncio.run(status.send(BusDouble(), "run1", Heartbeat(role=role, id=ident, state=state)))


def test_not_ready_before_nats_then_ready_once_the_work_loop_runs(endpoint):
    port, _ = endpoint
    assert get(port, "/healthz")[0] == 200
    code, body = get(port, "/readyz")
    assert code == 503 and "not connected to NATS" in body
    beat("starting")  # role_connection's hello: connected, loading the model
    assert get(port, "/readyz")[0] == 503 and get(port, "/healthz")[0] == 200
    beat("ready")
    code, body = get(port, "/readyz")
    assert code == 200 and "actor actor-0: ready" in body
    beat("busy")
    assert get(port, "/readyz")[0] == 200
    # the metrics are still served on the same port
    code, body = get(port, "/metrics")
    assert code == 200 and 'parley_role_state{instance="actor-0",role="actor",run="run1",state="busy"} 1.0' in body


def test_every_role_of_the_process_must_be_ready(endpoint):
    port, _ = endpoint
    beat("ready", "sim", "svc-0")
    beat("starting", "judge", "svc-0")
    assert get(port, "/readyz")[0] == 503
    beat("ready", "judge", "svc-0")
    assert get(port, "/readyz")[0] == 200
    beat("stopping", "judge", "svc-0")  # draining: take it out of service, it is still alive
    assert get(port, "/readyz")[0] == 503 and get(port, "/healthz")[0] == 200


def test_a_running_role_that_falls_silent_is_not_live():
    c = HeartbeatCollector()
    now = time.time()
    c.observe("run1", Heartbeat(role="learner", id="learner", state="ready", created=now - STALE_S - 1))
    live, ready, detail = c.health(now)
    assert not live and not ready and "stuck" in detail
    # a role still loading its model (state "starting") may block its event loop that long
    c.observe("run1", Heartbeat(role="learner", id="learner", state="starting", created=now - STALE_S - 1))
    assert c.health(now)[:2] == (True, False)


def test_a_role_draining_after_a_stop_signal_stays_live_and_is_not_ready():
    """After SIGTERM the heartbeats end while the learner may still upload for minutes: a liveness
    probe must not kill it for that."""
    c = HeartbeatCollector()
    now = time.time()
    c.observe("run1", Heartbeat(role="learner", id="learner", state="ready", created=now - 10 * STALE_S))
    c.begin_stop()
    live, ready, detail = c.health(now)
    assert live and not ready and "stopping" in detail
