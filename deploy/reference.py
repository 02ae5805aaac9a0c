"""`parley reference`: the reference service, a frozen copy of the policy's initial weights that
answers per-token log-probs of whole trajectories ([policy] reference = "service"; the backend is
engines/reference.py). It loads what the learner loads: [policy] model through ensure_model, in
[learner] dtype, lm_head in chunks of [learner] logit_chunk_tokens. Started by `parley up` when the
run uses it, or by hand on any machine that reaches the bus (a GPU of its own, or the CPU).
"""

from __future__ import annotations

import asyncio
import logging

from parley.config.run import RunConfig

log = logging.getLogger("parley.reference")


async def main(stop: asyncio.Event, cfg: RunConfig, ident: str) -> int:
    from parley.engines.models import ensure_model
    from parley.engines.reference import ReferenceModel, reference_service
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


def run(cfg: RunConfig, ident: str) -> int:
    """`parley reference`'s entry: serve until SIGINT/SIGTERM; returns the exit code."""
    from parley.runtime.process import run_async

    return run_async(main, cfg, ident)
