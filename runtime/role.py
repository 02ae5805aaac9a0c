"""The frame of every process that talks to NATS: `role_connection` connects with the run config's
`[nats]` section, sets up the run's topology when asked, sends the first heartbeats and drains on
the way out; `connect_nats` is its bare connect, for a command whose connection is optional.
Every role's `main` and every `parley` command that uses the bus open one of them (inside
`parley.runtime.process.run_async`, which gives the signal-driven stop and exit code 3 for an unreachable
NATS). This is the only place that maps the config to credentials: protocol.connect.connect is the
low-level call, which also reads PARLEY_NATS_USER / PASSWORD / CREDS / CA from the environment.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Protocol


class NatsSettings(Protocol):
    """What the frame reads of the run config's `[nats]` section."""

    url: str
    creds: str  # a .creds file ("" = none: PARLEY_NATS_CREDS, else user/password or anonymous)
    ca_file: str  # the TLS CA ("" = none: PARLEY_NATS_CA, else the system's)
    connect_timeout_s: float


async def connect_nats(nats: NatsSettings, *, name: str, user: str | None = None, password: str | None = None):
    """Connect with `nats` (the `[nats]` section): its URL, .creds file, TLS CA and first-contact
    timeout; `name` is the connection's name on the server. The caller drains it."""
    from parley.protocol.connect import connect

    return await connect(
        nats.url, name=name, first_timeout=nats.connect_timeout_s, user=user, password=password,
        creds=nats.creds or None, ca_file=nats.ca_file or None,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def role_connection(
    nats: NatsSettings,
    *,
    name: str,
    run: str | None = None,
    bus=None,
    topology: bool = False,
    hello: Iterable = (),
    user: str | None = None,
    password: str | None = None,
) -> AsyncIterator[tuple[object, object]]:
    """`async with role_connection(cfg.nats, name="parley-actor-1", run=..., bus=cfg.bus, topology=True) as (nc, js):`

    name: the connection's name on the server (`parley-<id>`). topology: ensure_topology(js, run, bus)
    before the body (roles that may only verify it do just that). hello: Heartbeats sent on run's
    status subjects once connected (a role's "starting"). user/password: a user of the process's own
    (`parley up` as its server's admin); otherwise PARLEY_NATS_USER / PASSWORD as connect() reads them.
    The connection is drained when the body ends, however it ends.
    """
    from parley.protocol import status
    from parley.protocol import topology as topo

    nc = await connect_nats(nats, name=name, user=user, password=password)
    try:
        js = nc.jetstream()
        if topology:
            if run is None or bus is None:
                raise ValueError(
                    f"{name}: role_connection(topology=True) needs run= and bus= (the run's name and [bus])"
                )
            await topo.ensure_topology(js, run, bus)
        for hb in hello:
            await status.send(nc, run, hb)
        yield nc, js
    finally:
        with contextlib.suppress(Exception):  # a connection already closed or lost has nothing to flush
            await nc.drain()
