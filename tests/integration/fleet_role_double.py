"""Test double for a role the eval fleet starts (`parley actor`, `parley scorer`): it plays and scores
nothing, it only says ready on the bus as that role does, so that a test can make it fail after it came
ready. The test itself publishes the work the roles would have done.

    python fleet_role_double.py URL RUN ROLE ID [MARKER CODE]

Sends a ready heartbeat as ROLE/ID on RUN's status subject every 0.1 s. Given MARKER and CODE, and
MARKER not there yet: after three heartbeats it creates MARKER and exits CODE (a failure after it came
ready). Otherwise it runs until it is stopped.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import nats

from parley.protocol import status
from parley.protocol.messages import Heartbeat


async def main(url: str, run: str, role: str, ident: str, marker: str = "", code: str = "0") -> int:
    nc = await nats.connect(url)
    fails = bool(marker) and not Path(marker).exists()
    print(f"{role} double {ident}: {'will fail' if fails else 'running'}", flush=True)
    beats = 0
    while True:
        await status.send(nc, run, Heartbeat(role=role, id=ident, state="ready"))
        await nc.flush()
        beats += 1
        if fails and beats == 3:
            Path(marker).write_text("failed once")
            print(f"{role} double {ident}: exiting with code {code}", flush=True)
            await nc.close()
            return int(code)
        await asyncio.sleep(0.1)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:])))
