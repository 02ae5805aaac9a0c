"""How close each channel's unconsumed messages are to its stream's byte limit. With LIMITS retention
and DiscardPolicy.OLD (protocol.topology) a full stream drops its oldest messages whether or not its
consumer has had them: that work is lost without a word. The live view shows the share of every
channel; the learner logs a warning once one passes WARN_SHARE. `consumers` also gives each shared
consumer's waiting and in-progress counts: the learner's heartbeat carries those of TASKS, the signal
actors scale on (docs/operations.md, "Scaling actors").
"""

from __future__ import annotations

from dataclasses import dataclass

from parley.protocol import topology

WARN_SHARE = 0.8  # of the stream's max_bytes held by messages its consumer has not finished


def unconsumed_share(stored_msgs: int, stored_bytes: int, unconsumed_msgs: int, max_bytes: int) -> float:
    """The share of `max_bytes` taken by `unconsumed_msgs` messages of the stream's average size."""
    if max_bytes <= 0 or stored_msgs <= 0:
        return 0.0
    return unconsumed_msgs * (stored_bytes / stored_msgs) / max_bytes


def warning(key: str, share: float, max_bytes: int) -> str:
    return (
        f"stream {key}: unconsumed messages fill {share:.0%} of its max_bytes={max_bytes}; when it is full the "
        f"oldest are dropped unread: add consumers of {key}, or raise [bus] max_bytes"
    )


@dataclass(frozen=True)
class ConsumerBacklog:
    waiting: int  # not delivered to any reader yet (the consumer's num_pending)
    in_progress: int  # delivered, not acked yet (num_ack_pending)
    share: float  # of the stream's max_bytes held by both (unconsumed_share)
    max_bytes: int


async def consumers(js, run: str) -> dict[str, ConsumerBacklog]:
    """channel -> its shared consumer's backlog, for every channel with a shared consumer."""
    out = {}
    for key, channel in topology.CHANNELS.items():
        if channel.durable is None:
            continue
        name = topology.stream_name(run, key)
        info = await js.stream_info(name)
        ci = await js.consumer_info(name, channel.durable)
        waiting, held = ci.num_pending or 0, ci.num_ack_pending or 0
        max_bytes = info.config.max_bytes or 0
        out[key] = ConsumerBacklog(
            waiting, held, unconsumed_share(info.state.messages, info.state.bytes, waiting + held, max_bytes), max_bytes
        )
    return out


async def shares(js, run: str) -> dict[str, tuple[float, int]]:
    """channel -> (unconsumed share, the stream's max_bytes), for every channel with a shared consumer."""
    return {key: (c.share, c.max_bytes) for key, c in (await consumers(js, run)).items()}
