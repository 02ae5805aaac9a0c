"""The reference service: a frozen copy of the policy's initial weights that answers "the log-prob
of each token given its prefix" for whole trajectories, so the learner's training GPUs run no
reference forward ([policy] reference = "service"). `parley reference` runs `run` below, serving it
on its model's subject (topology.reference_subject) through engines.service; scorers ask it once per
trajectory through services.reference.client. Started by `parley up` when the run uses it, or by
hand on any machine that reaches the bus (a GPU of its own, or the CPU).

The log-probs come from engines.logprobs, the function the learner computes its own (local)
reference with, on a plain transformers model loaded from the same checkpoint the learner loads:
fp32 on CPU, [learner] dtype ("auto": bf16) on CUDA.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np

from parley.protocol import arrays, codec, topology
from parley.protocol.messages import ReferenceReply

log = logging.getLogger(__name__)


class ReferenceModel:
    """The frozen initial policy and its per-token log-probs. `model_name` is the name requests
    must give ([policy] model as written in the config), `model_dir` the checkpoint it resolves to."""

    def __init__(
        self,
        model_name: str,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        chunk: int = 1024,
        device: str | None = None,
    ):
        import torch
        from transformers import AutoModelForCausalLM

        self.model_name, self.model_dir, self.chunk = model_name, Path(model_dir), chunk
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype, attn_implementation="sdpa")
        self.model = model.to(self.device).eval().requires_grad_(False)
        conf = self.model.config
        self.vocab_size = int(conf.vocab_size)
        self.max_positions = getattr(conf, "max_position_embeddings", None)
        self._lock = asyncio.Lock()  # one forward at a time: they share the device (and on CPU its cores)

    def check(self, ids: np.ndarray) -> str:
        """Why these token ids cannot be scored, or "" when they can."""
        if ids.size < 2:
            return f"{ids.size} token(s): a log-prob needs a token and a prefix"
        if self.max_positions and ids.size > self.max_positions:
            return f"{ids.size} tokens, more than the model's {self.max_positions} positions"
        outside = (ids < 0) | (ids >= self.vocab_size)
        if outside.any():
            return f"token id {int(ids[int(np.argmax(outside))])} is outside the vocabulary 0..{self.vocab_size - 1}"
        return ""

    def logprobs(self, ids: np.ndarray) -> np.ndarray:
        """(T-1,) float32: the log-prob of tokens 1..T-1 of `ids` (T,), each given its prefix."""
        import torch

        from parley.engines.logprobs import sequence_logprobs

        lp = sequence_logprobs(
            self.model, torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.device), self.chunk
        )
        return lp.cpu().numpy().astype(np.float32, copy=False)

    async def answer(self, model: str, version: int, ids: np.ndarray) -> ReferenceReply:
        if model != self.model_name:
            return ReferenceReply(
                ok=False,
                model=self.model_name,
                error=f"this reference service holds model {self.model_name!r}, not {model!r}; "
                "start `parley reference` with the run's [policy] model",
            )
        if version != 0:
            return ReferenceReply(
                ok=False,
                model=self.model_name,
                error=f"version {version} asked; the reference is the initial weights, version 0",
            )
        why = self.check(ids)
        if why:
            return ReferenceReply(ok=False, model=self.model_name, error=why)
        async with self._lock:
            # A forward cannot be stopped once begun. When this request is cancelled meanwhile (its
            # requester withdrew it: engines/service.py cancels the computation), the device and the
            # lock stay taken until the forward ends, so the next request's does not start beside it.
            forward = asyncio.ensure_future(asyncio.to_thread(self.logprobs, ids))
            try:
                lp = await asyncio.shield(forward)
            except asyncio.CancelledError:
                await asyncio.wait([forward])
                if not forward.cancelled():
                    forward.exception()  # read: its error answers nobody
                raise
        return ReferenceReply(ok=True, logp_f32=arrays.pack_logprobs(lp), model=self.model_name)

    async def close(self) -> None:
        self.model = None


def reference_routes(ref: ReferenceModel, counters: Counter | None = None) -> dict:
    """The service route: subject -> handler(bytes) -> encoded ReferenceReply. A request that does
    not decode gets an ok=False reply naming the error."""
    counters = counters if counters is not None else Counter()

    async def handler(data: bytes) -> bytes:
        try:
            req = codec.decode("reference.request", data)
            ids = arrays.request_ids(req.token_ids_i32)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            counters["bad_request"] += 1
            return codec.encode(
                ReferenceReply(ok=False, error=f"request is not a ReferenceRequest: {e}", model=ref.model_name)
            )
        reply = await ref.answer(req.model, req.version, ids)
        counters["ok" if reply.ok else "refused"] += 1
        counters["tokens"] += int(ids.size) if reply.ok else 0
        return codec.encode(reply)

    return {topology.reference_subject(ref.model_name): handler}


def error_reply(subject: str, data: bytes, exc: BaseException) -> bytes:
    """What a requester gets when the handler crashed: a failure it retries, never log-probs."""
    return codec.encode(ReferenceReply(ok=False, error=f"reference crashed on {subject}: {type(exc).__name__}: {exc}"))


def reference_service(nc, ref: ReferenceModel, *, name: str = "reference", concurrency: int = 2):
    """A Service (engines/service.py) answering its model's subject in the REFERENCE_QUEUE group.
    Forwards run one at a time (ReferenceModel's lock); a second slot decodes and checks the next
    request meanwhile. More replicas share the queue group."""
    from parley.engines.service import Service

    counters: Counter = Counter()
    return Service(
        nc,
        reference_routes(ref, counters),
        queue=topology.REFERENCE_QUEUE,
        concurrency=concurrency,
        on_error=error_reply,
        name=name,
        counters=counters,
    )


async def main(stop: asyncio.Event, cfg, ident: str) -> int:
    """Serve until `stop`. It loads what the learner loads: [policy] model through ensure_model, in
    [learner] dtype, lm_head in chunks of [learner] logit_chunk_tokens."""
    from parley.engines.models import ensure_model
    from parley.engines.service import serve_backend

    lc, model = cfg.learner, cfg.policy.model

    def make():
        ref = ReferenceModel(model, ensure_model(model), dtype=lc.dtype, chunk=lc.logit_chunk_tokens)
        log.info("%s: reference %s (%s) on %s in %s", ident, model, ref.model_dir, ref.device, ref.dtype)
        return ref

    def build(nc, ref):
        return [(reference_service(nc, ref, name=ident), "reference", ident, 30.0)]

    return await serve_backend(
        stop, cfg, ident=ident, roles=[("reference", ident)], backend_cfg=None, build=build, make=make
    )


def run(cfg, ident: str) -> int:
    """`parley reference`'s entry: serve until SIGINT/SIGTERM; returns the exit code."""
    from parley.runtime.process import run_async

    return run_async(main, cfg, ident)
