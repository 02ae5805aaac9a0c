"""How a role process runs: `run_async(main, *args)` drives `main(stop, *args)` on uvloop with
SIGINT/SIGTERM setting `stop`, and turns an unreachable NATS into exit code 3 and a run topology
that is missing or cannot be made (protocol.topology.TopologyError: no such stream yet, no
permission, no room on the server's store) into exit code 4, each with one line on stderr. Each
role's plain entry function (config in, exit code out) calls it; deploy/ calls those."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from parley.errors import ParleyError

EXIT_NATS_UNREACHABLE = 3
EXIT_TOPOLOGY = 4


class Stopped(ParleyError):
    """unless_stopped: the stop came first; the work was cancelled and has ended."""


async def unless_stopped(aw, stop: asyncio.Event):
    """`aw`'s result, unless `stop` (run_async's SIGINT/SIGTERM event) is set first: then `aw` is
    cancelled, waited for until it has ended, and Stopped is raised."""
    work = asyncio.ensure_future(aw)
    stopping = asyncio.ensure_future(stop.wait())
    cut = False
    try:
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this task is cancelled: the work does not outlive it
        stopping.cancel()
        if not work.done():
            cut = True
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if cut:  # whatever the work made of its cancellation
        raise Stopped
    return work.result()


def setup_logging(role: str, level: str | None = None) -> None:
    level = level or os.environ.get("PARLEY_LOG", "INFO")
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("nats", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _forget_parents_wakeup_fd() -> None:
    """In a forked child: let go of the parent's signal wakeup fd. Python keeps it across a fork (3.11;
    asyncio drops it from 3.12), so every signal the child then got was also written to the parent's
    event loop, which ran its own handler: vLLM's SIGTERM to a forked engine core as the engine shuts
    down set the parent's stop (on a GPU, where the first engine of a process is forked: a `parley eval`
    that closes one engine to open another, for a second model shape, would end as if interrupted)."""
    with contextlib.suppress(ValueError):  # not the main thread: no wakeup fd to drop
        signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forget_parents_wakeup_fd)  # once, as this module is imported


def run_async(main, *args) -> int:
    """Run `main(stop, *args)` to completion; its return value (None = 0) is the exit code. A child
    forked meanwhile does not pass its signals on to this process (_forget_parents_wakeup_fd, registered
    when this module is imported)."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep Windows-like envs working
        runner = asyncio.run

    async def wrapper():
        from parley.runtime.metrics import COLLECTOR

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopping() -> None:
            COLLECTOR.begin_stop()  # /healthz stays live while the role drains (its heartbeats end)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping)
        return await main(stop, *args)

    from parley.protocol.connect import NatsUnreachable
    from parley.protocol.topology import TopologyError

    try:
        code = runner(wrapper())
    except NatsUnreachable as e:
        print(f"parley: {e}", file=sys.stderr)
        return EXIT_NATS_UNREACHABLE
    except TopologyError as e:  # says what is missing or full and what to do: a traceback adds nothing
        print(f"parley: {e}", file=sys.stderr)
        return EXIT_TOPOLOGY
    return int(code or 0)
