"""Encoding, typed decoding and message identity for every channel.

One msgpack Decoder per channel is built once here; consumers and replay decode through
`decode(key, data)`. `msg_id` derives the Nats-Msg-Id from a message's identity, so a
republish after a crash or a timed-out publish is stored once.
"""

from __future__ import annotations

import msgspec

from parley.protocol.messages import (
    BudgetUpdate,
    DeadLetter,
    EvalRecord,
    Heartbeat,
    JudgeReply,
    JudgeRequest,
    ReferenceReply,
    ReferenceRequest,
    Scored,
    SimReply,
    SimRequest,
    Task,
    Trajectory,
    WeightVersion,
)

CHANNEL_TYPES: dict[str, type] = {
    "tasks": Task,
    "traj": Trajectory,
    "scored": Scored,
    "eval": EvalRecord,
    "dead": DeadLetter,
}
# Request/reply and KV payloads that are not stored in a channel stream.
OTHER_TYPES: dict[str, type] = {
    "sim.request": SimRequest,
    "sim.reply": SimReply,
    "judge.request": JudgeRequest,
    "judge.reply": JudgeReply,
    "reference.request": ReferenceRequest,
    "reference.reply": ReferenceReply,
    "weights": WeightVersion,
    "status": Heartbeat,
    "control.budget": BudgetUpdate,
}

_encoder = msgspec.msgpack.Encoder()
_decoders = {key: msgspec.msgpack.Decoder(t) for key, t in {**CHANNEL_TYPES, **OTHER_TYPES}.items()}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(key: str, data: bytes):
    """Decode bytes of channel/payload `key`; raises msgspec.DecodeError / ValidationError with a path."""
    try:
        decoder = _decoders[key]
    except KeyError:
        raise ValueError(f"no decoder for {key!r}; known: {sorted(_decoders)}") from None
    return decoder.decode(data)


def msg_id(msg: msgspec.Struct) -> str:
    """The Nats-Msg-Id of a stored message: its identity, never a random value."""
    match msg:
        case Task():
            return f"task:{msg.task_id}"
        case Trajectory():
            return f"traj:{msg.traj_id}"
        case Scored():
            return f"scored:{msg.traj_id}"
        case EvalRecord():
            return f"eval:{msg.eval_id}"
        case DeadLetter():
            # The same poison message seen twice (redelivery) is one dead letter.
            import hashlib

            return f"dead:{msg.subject}:{hashlib.sha256(msg.payload).hexdigest()[:32]}"
    raise TypeError(f"{type(msg).__name__} is not stored in a stream")
