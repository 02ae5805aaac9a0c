"""`python -m tests.faults.clock_ahead <parley args>`: the parley CLI in a process whose wall clock
(time.time, and so every heartbeat and wall-clock stamp it makes) is PARLEY_CLOCK_AHEAD_S (default
600) seconds ahead of the machine's, as on a service host with a skewed clock. Its monotonic clock
is untouched (no host shares it anyway). Used by tests/faults/test_faults28.py."""

import os
import runpy
import sys
import time

AHEAD_S = float(os.environ.get("PARLEY_CLOCK_AHEAD_S", "600"))
_real_time = time.time
time.time = lambda: _real_time() + AHEAD_S  # before any parley or vLLM module takes `from time import time`
_real_time_ns = time.time_ns
time.time_ns = lambda: _real_time_ns() + int(AHEAD_S * 1e9)

if __name__ == "__main__":
    sys.argv[0] = "parley"
    runpy.run_module("parley.deploy.cli", run_name="__main__", alter_sys=True)
