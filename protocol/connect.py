"""Connecting a role to NATS: reconnect forever once up, but fail fast and clearly on first contact.

`connect()` is the low-level call: credentials come from its arguments or the environment
(PARLEY_NATS_USER / PARLEY_NATS_PASSWORD, PARLEY_NATS_CREDS for a .creds file, PARLEY_NATS_CA for TLS).
Processes open it through runtime/role.py's `role_connection`, which passes the run config's `[nats]`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import ssl
import weakref
from pathlib import Path

import nats

from parley.errors import Unavailable

log = logging.getLogger(__name__)

# What every role reads from its environment to log in (deploy/credentials.py writes them per role).
USER_ENV, PASSWORD_ENV = "PARLEY_NATS_USER", "PARLEY_NATS_PASSWORD"
CREDS_ENV, CA_ENV = "PARLEY_NATS_CREDS", "PARLEY_NATS_CA"


class NatsUnreachable(Unavailable, ConnectionError):
    """NATS cannot be reached or refuses this connection; a role exits 3 (runtime.process)."""


def inbox_prefix(user: str | None) -> str:
    """The reply-subject prefix of `user`'s connections: `_INBOX_<user>` (its characters outside
    A-Z a-z 0-9 _ - percent-encoded, so `parley-*-actor` and every run's users stay distinct).

    deploy/permissions.py lets each user subscribe to its own prefix only: no role can read the replies or
    pull-consumer deliveries of another. Without a user name (anonymous, a .creds file) it is nats.py's
    default `_INBOX`, which the server's own permissions then govern."""
    if not user:
        return "_INBOX"
    safe = "".join(
        c if c.isascii() and (c.isalnum() or c in "_-") else "".join(f"%{b:02X}" for b in c.encode()) for c in user
    )
    return f"_INBOX_{safe}"


class Reconnects:
    """The reconnects of one connection, for a wait that must start over when the server it waits on may
    be a new one (protocol.request: a restarted nats-server refuses the answers to requests the old one
    delivered). `next()`: a future done at the connection's next reconnect."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Future] = set()

    def next(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.add(fut)
        fut.add_done_callback(self._waiting.discard)
        return fut

    def fire(self) -> None:
        for fut in list(self._waiting):
            if not fut.done():
                fut.set_result(None)


_RECONNECTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reconnects(nc) -> Reconnects | None:
    """The Reconnects of a connection `connect()` opened; None for any other (a test double, a plain
    nats.connect), whose waits then do not start over."""
    try:
        return _RECONNECTS.get(nc)
    except TypeError:  # not weakly referenceable
        return None


def _tls_context(ca_file: str | None) -> ssl.SSLContext | None:
    if not ca_file:
        return None
    ctx = ssl.create_default_context(cafile=ca_file)
    return ctx


async def connect(
    url: str,
    *,
    name: str,
    first_timeout: float = 10.0,
    user: str | None = None,
    password: str | None = None,
    creds: str | None = None,
    ca_file: str | None = None,
):
    """Connect to `url`; the first attempt is bounded by `first_timeout` seconds, later drops reconnect forever."""
    user = user or os.environ.get(USER_ENV)
    password = password or os.environ.get(PASSWORD_ENV)
    creds = creds or os.environ.get(CREDS_ENV)
    ca_file = ca_file or os.environ.get(CA_ENV)
    if creds:
        _check_creds(creds, url, name)

    async def on_disconnect():
        log.warning("%s: disconnected from NATS %s", name, url)

    back = Reconnects()

    async def on_reconnect():
        log.warning("%s: reconnected to NATS %s", name, url)
        back.fire()

    errors: list[str] = []  # the server's reason when the first connect is refused (bad credentials)

    async def on_error(e):
        errors.append(str(e))
        del errors[:-4]  # only the latest few matter; the connection may live for days
        log.warning("%s: NATS error: %s", name, e)

    kwargs = dict(
        servers=[u.strip() for u in url.split(",")],
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1,
        connect_timeout=min(first_timeout, 5),
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        tls=_tls_context(ca_file),
        inbox_prefix=inbox_prefix(user if not creds else None),
    )
    if user and not creds:  # a .creds file is the identity: a user beside it would log in instead, silently
        kwargs.update(user=user, password=password or "")
    if creds:
        kwargs.update(user_credentials=creds)
    try:
        nc = await asyncio.wait_for(nats.connect(**kwargs), timeout=first_timeout)
        _RECONNECTS[nc] = back
        return nc
    except (TimeoutError, OSError, nats.errors.NoServersError) as e:
        if any("authorization violation" in err.lower() for err in errors):
            what = (
                f"the credentials file {creds} ([nats] creds / PARLEY_NATS_CREDS)"
                if creds
                else "PARLEY_NATS_USER / PARLEY_NATS_PASSWORD (or [nats] creds / PARLEY_NATS_CREDS)"
            )
            raise NatsUnreachable(
                f"NATS at {url} refused {name}: authorization violation; check {what} for this role"
            ) from None
        raise NatsUnreachable(
            f"could not connect to NATS at {url} within {first_timeout:.0f}s ({type(e).__name__}: {e}); "
            "start a server with `parley nats` or pass the right --nats URL"
        ) from None
    except nats.errors.Error as e:
        # Authorization errors and the like: say so, don't hang.
        using = f" (credentials file {creds})" if creds else ""
        raise NatsUnreachable(f"NATS at {url} refused {name}{using}: {e}") from None


def _check_creds(creds: str, url: str, name: str) -> None:
    """A .creds file that cannot be used is one line naming it, not a traceback from inside nats.py."""
    if not Path(creds).is_file():
        raise NatsUnreachable(
            f"{name}: the NATS credentials file {creds} ([nats] creds / PARLEY_NATS_CREDS) does not exist; "
            f"give the path of the .creds file for {url}, or leave creds empty to use PARLEY_NATS_USER / PASSWORD"
        )
    if importlib.util.find_spec("nkeys") is None:  # nats.py signs the server's nonce with it
        raise NatsUnreachable(
            f"{name}: the NATS credentials file {creds} ([nats] creds / PARLEY_NATS_CREDS) needs the nkeys "
            "package, which is not installed; pip install 'nats-py[nkeys]', or leave creds empty to use "
            "PARLEY_NATS_USER / PARLEY_NATS_PASSWORD"
        )


async def barrier(nc, timeout: float = 5.0) -> None:
    """Return once the server has processed every command `nc` sent so far (subscriptions, publishes).

    nats-py's `flush()` alone is no such barrier: it writes its PING straight to the socket, while
    SUB and PUB commands wait in the client's queue for its flusher task, so the PONG can come back
    before the server has seen them (a subscription not yet live, a permission error not yet
    reported). So: wait until the flusher has written the queue, then ping."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while nc.pending_data_size > 0 and nc.is_connected:
        if loop.time() > deadline:
            raise nats.errors.FlushTimeoutError
        await asyncio.sleep(0.001)
    await nc.flush(timeout=max(0.1, deadline - loop.time()))
