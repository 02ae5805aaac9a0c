"""The reference service over NATS request/reply, as the scorer asks it ([policy] reference =
"service"): one request per trajectory, its reply turned into Scored.ref_logp_f32. The service is
services/reference/server.py behind `parley reference`."""

from __future__ import annotations

import asyncio

import numpy as np

from parley.errors import Refused, Unavailable
from parley.protocol import arrays
from parley.protocol.messages import Trajectory


class ReferenceUnavailable(Unavailable, RuntimeError):
    """Nobody answered (no service, or it timed out): wait and ask again; spends no delivery."""


class ReferenceFailed(Refused, RuntimeError):
    """The service answered but gave no usable log-probs (wrong model, a refused request)."""


class ReferenceClient:
    """Asks the reference service for a trajectory's per-token log-probs under `model` (the
    run's [policy] model), with at most `concurrency` requests in flight."""

    def __init__(self, nc, *, model: str, timeout: float, concurrency: int = 16):
        self.nc, self.model, self.timeout = nc, model, timeout
        self._slots = asyncio.Semaphore(concurrency)

    async def logprobs(self, traj: Trajectory) -> bytes:
        """Scored.ref_logp_f32 of `traj`: (T,) float32, 0.0 at token 0 and the reference log-prob of
        every later token given its prefix."""
        import msgspec
        import nats.errors

        from parley.protocol import codec, topology
        from parley.protocol.messages import ReferenceRequest
        from parley.protocol.request import request

        ids = arrays.token_ids(traj)
        subject = topology.reference_subject(self.model)  # only services of this model hear it
        data = codec.encode(ReferenceRequest(model=self.model, token_ids_i32=arrays.pack_ids(ids)))
        async with self._slots:
            try:
                msg = await request(self.nc, subject, data, timeout=self.timeout)
            except nats.errors.NoRespondersError:
                raise ReferenceUnavailable(
                    f"no reference service answers on {subject}; is `parley reference` running?"
                ) from None
            except nats.errors.TimeoutError:
                raise ReferenceUnavailable(
                    f"reference on {subject} did not answer within {self.timeout:.0f}s"
                ) from None
        try:
            reply = codec.decode("reference.reply", msg.data)
            lp = arrays.reference_logprobs(reply.logp_f32, traj.traj_id) if reply.ok else None
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            raise ReferenceFailed(f"reference on {subject} sent a reply that is not a ReferenceReply: {e}") from None
        if lp is None:
            raise ReferenceFailed(f"reference refused {traj.traj_id}: {reply.error or 'no error given'}")
        if lp.size != ids.size - 1:
            raise ReferenceFailed(
                f"reference sent {lp.size} log-probs for the {ids.size} tokens of {traj.traj_id} "
                f"(want {ids.size - 1}: every token after the first)"
            )
        return arrays.pack_logprobs(np.concatenate([np.zeros(1, np.float32), lp]))
