"""The bus's settings and the run-name rule, without nats: `config.run` reads them to check a
config, and `parley --help` (which reads no bus) imports no NATS client through them.
protocol.topology builds the streams and subjects from them and names both as its own."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class BusSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Stream and consumer settings; the [bus] section of the run config."""

    max_age_s: float = 7 * 24 * 3600.0  # keep messages a week for replay
    max_bytes: int = 1024**3  # per stream; JetStream reserves it on disk up front
    replicas: Literal[1, 3, 5] = 1  # 3 on a 3-node cluster
    duplicate_window_s: float = 600.0  # Nats-Msg-Id dedupe horizon
    ack_wait_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # unacked work is redelivered after this
    max_deliver: Annotated[int, msgspec.Meta(ge=1)] = 5  # then dead-lettered by the consumer
    max_ack_pending: int = 256  # back-pressure: outstanding messages per consumer
    max_msg_bytes: int = 8 * 1024**2
    # One fetch asks for at most this many bytes of messages as well as at most its free slots: the
    # server cuts off a client whose unsent bytes pass its max_pending (64 MiB, deploy/natsserver.py)
    # as a slow consumer, and 64 slots of 2 MB trajectories would be twice that in one burst.
    fetch_max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 16 * 1024**2
    # The weights object store's limit (every stored version's files; a put beyond it is refused, so a
    # learner killed mid-upload cannot fill the server's disk). 0: the set-up command (`parley up`,
    # `parley auth topology`) derives it from the policy model's size x the versions kept
    # (deploy.common.topology_bus); DEFAULT_BLOBS_MAX_BYTES where nothing derived it.
    blobs_max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Each KV bucket's limit (the weights announcements, the held counts, the lease): small messages.
    kv_max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 8 * 1024**2
