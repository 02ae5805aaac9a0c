"""What one NATS account per run would change, on the real nats-server: the facts docs/operations.md
("Runs share one account") rests on. parley does not use accounts (its runs share the server's global
account, kept apart by subject permissions: test_privilege.py); these pin what a switch would meet."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.errors import NoRespondersError

from parley.deploy.natsserver import NatsServer
from parley.protocol.connect import connect

pytestmark = pytest.mark.integration

# Two runs' accounts and the shared services' account, which exports parley.svc.> as a service and
# the services' heartbeats as a stream; run A imports both. The service user is restricted as parley's
# are: it may publish nothing but its answers (allow_responses).
CONF = """
accounts {
  SVC: {
    users: [{user: svc, password: s, permissions: {publish: {allow: ["parley.svc.none"]},
             subscribe: {allow: ["parley.svc.>"]}, allow_responses: {max: 1, expires: "60s"}}}]
    exports: [{service: "parley.svc.>"}]
  }
  RUNA: {
    jetstream: {max_file: 1MB, max_mem: 1MB}
    users: [{user: a, password: a}]
    imports: [{service: {account: SVC, subject: "parley.svc.>"}}]
  }
  RUNB: { jetstream: enabled, users: [{user: b, password: b}] }
}
"""


async def request_across(nc, subject: str):
    """A request through the import, asked again while the service's interest has not reached the
    importing account yet (the server answers "no responders" meanwhile)."""
    for _ in range(50):
        try:
            return await nc.request(subject, b"q", timeout=5)
        except NoRespondersError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"nobody answered {subject} through the import")


async def test_what_accounts_per_run_would_isolate_and_what_the_shared_services_would_meet(tmp_path):
    server = NatsServer(tmp_path / "nats", port=0, extra_conf=CONF)
    server.start()
    try:
        svc = await connect(server.url, name="svc", user="svc", password="s", first_timeout=5)
        a = await connect(server.url, name="a", user="a", password="a", first_timeout=5)
        b = await connect(server.url, name="b", user="b", password="b", first_timeout=5)
        seen = []

        async def service(msg) -> None:
            seen.append((msg.subject, msg.reply))
            if msg.reply:
                await msg.respond(b"answer")

        await svc.subscribe("parley.svc.>", cb=service)
        await svc.flush()

        # The import carries requests (answered by a user with allow_responses only) and plain
        # publishes (withdrawals), but the reply subject the service sees is the import's, not an inbox:
        # engines/service.py answers only _INBOX... replies.
        assert (await request_across(a, "parley.svc.sim")).data == b"answer"
        assert seen[-1][1].startswith("_R_.") and not seen[-1][1].startswith("_INBOX")
        await a.publish("parley.svc.sim.withdraw", b"w")
        await a.flush()
        for _ in range(100):  # the service's callback runs on its own task
            if ("parley.svc.sim.withdraw", "") in seen:
                break
            await asyncio.sleep(0.02)
        assert ("parley.svc.sim.withdraw", "") in seen, seen

        # Streams and subjects are per account: run B sees no stream of run A, and its publish on A's
        # subject stores nothing there.
        ja = a.jetstream()
        await ja.add_stream(name="PARLEY_runa_TASKS", subjects=["parley.runa.tasks"], max_bytes=512 * 1024)
        names = json.loads((await b.request("$JS.API.STREAM.NAMES", b"{}", timeout=5)).data)
        assert not names.get("streams"), names
        info = json.loads((await b.request("$JS.API.STREAM.INFO.PARLEY_runa_TASKS", b"", timeout=5)).data)
        assert info["error"]["code"] == 404, info
        await b.publish("parley.runa.tasks", b"x")
        await b.flush()
        assert (await ja.stream_info("PARLEY_runa_TASKS")).state.messages == 0

        # The account's JetStream limit caps the run's storage as a whole: a stream asking for more is refused.
        with pytest.raises(Exception, match="insufficient storage resources"):
            await ja.add_stream(name="PARLEY_runa_BIG", subjects=["parley.runa.big"], max_bytes=10 * 1024**2)
        for c in (svc, a, b):
            await c.close()
    finally:
        server.stop()
