"""A child forked by a role process (vLLM's engine core under the "fork" start method) does not pass its
signals on to the role: Python keeps the parent's signal wakeup fd across a fork (3.11; asyncio drops it
from 3.12), so a SIGTERM the child got ran the parent's handler too. runtime.process.run_async makes its
forked children let go of it. In a fresh interpreter: the at-fork hook is registered once a process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD_SIGNALLED = textwrap.dedent(
    """
    import asyncio, multiprocessing, os, signal, sys, time
    from parley.runtime.process import run_async

    def engine_core():  # as vLLM's engine core: its own SIGTERM handler, ended by the parent's terminate()
        signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
        time.sleep(30)

    async def main(stop):
        core = multiprocessing.get_context("fork").Process(target=engine_core)
        core.start()
        await asyncio.sleep(0.3)
        core.terminate()  # SIGTERM, as vLLM's shutdown sends it
        await asyncio.to_thread(core.join)
        await asyncio.sleep(0.3)
        print("stopped" if stop.is_set() else "running")
        return 0

    sys.exit(run_async(main))
    """
)


def test_a_forked_childs_sigterm_does_not_stop_the_role():
    out = subprocess.run([sys.executable, "-c", CHILD_SIGNALLED], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "running", out.stdout + out.stderr


def test_the_roles_own_sigterm_still_stops_it():
    code = textwrap.dedent(
        """
        import asyncio, os, signal, sys
        from parley.runtime.process import run_async

        async def main(stop):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 5)
            print("stopped")
            return 0

        sys.exit(run_async(main))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "stopped", out.stdout + out.stderr
