"""`parley services`: the user simulator and the judge in one process, sharing one local engine.

On the embedded default both are the same small model on CPU, and a second engine would cost a
minute of start-up and its own KV cache for nothing. Each service keeps its own subjects, queue
group, concurrency and heartbeats, exactly as `parley sim` and `parley judge` run them apart.
"""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger("parley.services")


def check_shareable(cfg) -> None:
    """One engine can serve both only if both want the same local model."""
    if cfg.sim.backend != "vllm" or cfg.judge.backend != "vllm":
        raise ValueError("parley services shares a local engine; with an openai backend run `parley sim` and `parley judge`")
    if cfg.sim.engine.model != cfg.judge.engine.model:
        raise ValueError(
            f"sim.engine.model={cfg.sim.engine.model!r} and judge.engine.model={cfg.judge.engine.model!r} differ; "
            "run `parley sim` and `parley judge` separately"
        )


async def main(stop: asyncio.Event, cfg, ident: str) -> int:
    from actors.backend import make_backend
    from actors.sim import Simulator
    from protocol import status
    from protocol.connect import connect
    from protocol.messages import Heartbeat
    from scorer.judge import Judge, judge_service

    nc = await connect(
        cfg.nats.url, name=f"parley-{ident}", first_timeout=cfg.nats.connect_timeout_s,
        creds=cfg.nats.creds or None, ca_file=cfg.nats.ca_file or None,
    )
    for role in ("sim", "judge"):
        await status.send(nc, cfg.run.name, Heartbeat(role=role, id=f"{ident}-{role}", state="starting"))
    # The engine must hold both workloads' context: the longer max_model_len of the two.
    engine_cfg = cfg.sim.engine
    if cfg.judge.engine.max_model_len > engine_cfg.max_model_len:
        engine_cfg = cfg.judge.engine
    backend_cfg = type(cfg.sim)(**{**{f: getattr(cfg.sim, f) for f in cfg.sim.__struct_fields__}, "engine": engine_cfg})
    backend = make_backend(backend_cfg)
    log.info("services %s: one %s engine serves sim and judge (pid %d)", ident, backend.model_name, os.getpid())
    try:
        sim = Simulator(backend, cfg.sim)
        judge = Judge(backend, cfg.judge)
        services = [
            asyncio.create_task(
                sim.service(nc).run_until(stop, run=cfg.run.name, role="sim", ident=f"{ident}-sim", grace_s=cfg.sim.timeout_s)
            ),
            asyncio.create_task(
                judge_service(nc, judge, name=f"{ident}-judge").run_until(
                    stop, run=cfg.run.name, role="judge", ident=f"{ident}-judge", grace_s=cfg.judge.timeout_s
                )
            ),
        ]
        # One service failing (its engine died) takes the other down with it: the process exits non-zero.
        done, _ = await asyncio.wait(services, return_when=asyncio.FIRST_EXCEPTION)
        stop.set()
        await asyncio.gather(*services, return_exceptions=True)
        for t in done:
            if t.exception():
                raise t.exception()
    finally:
        await backend.close()
        await nc.drain()
    return 0
