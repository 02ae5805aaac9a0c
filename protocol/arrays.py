"""The one conversion between a Trajectory's token arrays and their wire form.

Token ids, the loss mask and behaviour log-probs travel as msgpack bin fields holding packed
little-endian arrays (int32 ids, uint8 mask, float32 log-probs): msgpack decodes a bin field with
one copy and numpy views it without another, where a list of Python numbers cost 3-9 bytes and
one Python object per token at every decode. Producers write `pack_*` and every consumer reads `token_ids` / `loss_mask` / `turn_logprobs`, never the fields themselves. The
reference log-probs ([policy] reference = "service": ReferenceRequest/Reply, Scored.ref_logp_f32)
travel the same way and are read with `request_ids`, `reference_logprobs` and `ref_logprobs`.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import numpy as np

from parley.protocol.messages import AssistantTurn, Scored, Trajectory

IDS = np.dtype("<i4")
MASK = np.dtype("u1")
LOGPROBS = np.dtype("<f4")


# Producers hold Python lists (what the engine returns): the stdlib's array converts those about
# a third faster than numpy does; arrays pass through numpy.
_TYPECODES = {IDS: next(c for c in "il" if array.array(c).itemsize == 4), LOGPROBS: "f"}


def _pack(values, dtype: np.dtype) -> bytes:
    if isinstance(values, list):
        if dtype == MASK:
            return bytes(values)  # ValueError for a value outside 0..255
        packed = array.array(_TYPECODES[dtype], values)
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()
    return np.asarray(values, dtype=dtype).tobytes()


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    return _pack(ids, IDS)


def pack_mask(mask: Sequence[int] | np.ndarray) -> bytes:
    return _pack(mask, MASK)


def pack_logprobs(logprobs: Sequence[float] | np.ndarray) -> bytes:
    return _pack(logprobs, LOGPROBS)


def _view(packed: bytes, dtype: np.dtype, owner: str, field: str) -> np.ndarray:
    """A read-only view of the packed field."""
    if len(packed) % dtype.itemsize:
        raise ValueError(
            f"{owner}: {field} holds {len(packed)} bytes, not a whole number of {dtype} "
            f"values; pack it with protocol.arrays"
        )
    return np.frombuffer(packed, dtype=dtype)


def token_ids(traj: Trajectory) -> np.ndarray:
    """(T,) int32: the whole conversation's token ids."""
    return _view(traj.token_ids_i32, IDS, traj.traj_id, "token_ids_i32")


def loss_mask(traj: Trajectory) -> np.ndarray:
    """(T,) uint8: 1 on trained tokens."""
    return _view(traj.loss_mask_u8, MASK, traj.traj_id, "loss_mask_u8")


def turn_logprobs(turn: AssistantTurn) -> np.ndarray:
    """(n,) float32: the behaviour log-prob of each token the turn generated."""
    return _view(turn.logprobs_f32, LOGPROBS, f"turn at {turn.start}", "logprobs_f32")


def generated(turn: AssistantTurn) -> int:
    """How many tokens the turn generated (one log-prob each)."""
    return len(turn.logprobs_f32) // LOGPROBS.itemsize


def ref_logprobs(scored: Scored) -> np.ndarray:
    """(T,) float32: the reference log-prob of each token given its prefix (0.0 at token 0); empty
    when the scorer sent none."""
    return _view(scored.ref_logp_f32, LOGPROBS, scored.traj_id, "ref_logp_f32")


def request_ids(packed: bytes) -> np.ndarray:
    """(T,) int32 of a ReferenceRequest's token_ids_i32."""
    return _view(packed, IDS, "reference request", "token_ids_i32")


def reference_logprobs(packed: bytes, owner: str) -> np.ndarray:
    """(T-1,) float32 of a ReferenceReply's logp_f32."""
    return _view(packed, LOGPROBS, owner, "logp_f32")
