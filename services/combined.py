"""`parley services`: the user simulator and the judge in one process, sharing one local engine.

On the embedded default both are the same small model on CPU, and a second engine would cost a
minute of start-up and its own KV cache for nothing. Each service keeps its own subjects, queue
group, concurrency and heartbeats, exactly as `parley sim` and `parley judge` run them apart.
"""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)


def check_shareable(cfg) -> None:
    """One engine can serve both only if both want the same local model."""
    if cfg.sim.backend != "vllm" or cfg.judge.backend != "vllm":
        raise ValueError(
            "parley services shares a local engine; with an openai backend run `parley sim` and `parley judge`"
        )
    if cfg.sim.engine.model != cfg.judge.engine.model:
        raise ValueError(
            f"sim.engine.model={cfg.sim.engine.model!r} and judge.engine.model={cfg.judge.engine.model!r} differ; "
            "run `parley sim` and `parley judge` separately"
        )


def shared_engine(cfg):
    """(section, its engine settings) of the one engine: the sim's, or the judge's when its
    max_model_len is longer (the engine must hold both workloads' context). deploy.memory plans it."""
    if cfg.judge.engine.max_model_len > cfg.sim.engine.max_model_len:
        return "judge", cfg.judge.engine
    return "sim", cfg.sim.engine


def service_children(cfg) -> list[str]:
    """The services `parley up` starts, in start order: "services" (sim and judge in one process, one
    engine, when both are local engines of one model) or "sim" and/or "judge" (each only if the
    environment needs it), then "reference" when [policy] reference = "service". deploy.up starts them,
    deploy.memory plans them."""
    env = cfg.env.load()
    shared = (
        env.needs_simulator
        and env.needs_judge
        and cfg.sim.backend == "vllm"
        and cfg.judge.backend == "vllm"
        and cfg.sim.engine.model == cfg.judge.engine.model
    )
    names = ["services"] if shared else ["sim"] * env.needs_simulator + ["judge"] * env.needs_judge
    if cfg.policy.reference == "service":  # the scorers ask it for every trajectory's reference log-probs
        names.append("reference")
    return names


async def main(stop: asyncio.Event, cfg, ident: str) -> int:
    from parley.engines.service import serve_backend
    from parley.services.judge.server import Judge, judge_service
    from parley.services.sim.server import Simulator

    _, engine_cfg = shared_engine(cfg)
    backend_cfg = type(cfg.sim)(**{**{f: getattr(cfg.sim, f) for f in cfg.sim.__struct_fields__}, "engine": engine_cfg})

    def build(nc, backend):
        log.info("services %s: one %s engine serves sim and judge (pid %d)", ident, backend.model_name, os.getpid())
        sim, judge = Simulator(backend, cfg.sim), Judge(backend, cfg.judge)
        return [
            (sim.service(nc), "sim", f"{ident}-sim", cfg.sim.timeout_s),
            (judge_service(nc, judge, name=f"{ident}-judge"), "judge", f"{ident}-judge", cfg.judge.timeout_s),
        ]

    roles = [("sim", f"{ident}-sim"), ("judge", f"{ident}-judge")]
    return await serve_backend(stop, cfg, ident=ident, roles=roles, backend_cfg=backend_cfg, build=build)


def run(cfg, ident: str) -> int:
    from parley.runtime.process import run_async

    return run_async(main, cfg, ident)
