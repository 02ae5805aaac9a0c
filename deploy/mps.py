"""CUDA MPS for `parley up` on one GPU (`[up] gpu_share = "mps"`, or "auto", the default).

Without MPS the GPU time-slices the kernels of the processes that share it: while the learner's step
runs, an actor's decode step waits for its turn, which is why a group took longer to play beside the
learner than TRL's in one process (docs/gpu.md, "Time to target against TRL"). Under MPS the processes'
kernels go through one server and may run side by side.

`parley up` starts a control daemon of its own for the run (`nvidia-cuda-mps-control -d`, the NVIDIA
driver's utility), with its pipe folder in a short temporary folder (a UNIX socket's path has a length
limit) and its logs in RUN_DIR/mps; every child gets the two variables that lead its CUDA calls to it;
at the end the daemon is told to quit. Before any role starts, a short CUDA process is run under the
daemon, so that an image where MPS cannot serve (a container without the needed IPC, a GPU in
exclusive mode) is refused at start with the error, not found later in a role's log.

Under "auto" a GPU run takes MPS where the daemon's binary is on PATH and the probe runs, and plain
sharing otherwise (unless deploy/gpu_share.py's rule takes phased sharing), with one line saying why
(`start_for`): at the 4B shape with a LoRA learner the
learner's step beside the actor went from 16.1 s time-sliced to 9.7 s under MPS (docs/gpu.md,
"Throughput against the floor"), and on SmolLM2 MPS changed nothing measurable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from parley.deploy import cuda_driver
from parley.errors import Unavailable

BINARY = "nvidia-cuda-mps-control"
FIX = 'set [up] gpu_share = "plain" (the GPU time-slices the processes instead)'
MISSING = (
    f'[up] gpu_share = "mps" needs {BINARY} (the NVIDIA driver\'s utilities) on PATH, and it is not there; '
    f"install them or {FIX}"
)
# a CUDA process of our own under the daemon: its server starts with the first client. First a context
# and a little work through the driver (deploy/cuda_driver: no import of torch); where that fails, the
# torch process that was the only probe before has the last word, so the driver's probe costs no
# verdict, only seconds saved where it passes
DRIVER_PROBE = cuda_driver.argv("context")
CUDA_PROBE = [sys.executable, "-c", "import torch; torch.zeros(1, device='cuda').sum().item()"]


class MpsError(Unavailable, RuntimeError):
    """MPS cannot serve this run; the message names what failed and the fix."""


def binary() -> str:
    """The daemon's path, or MpsError naming what is missing and the fix."""
    found = shutil.which(BINARY)
    if found is None:
        raise MpsError(MISSING)
    return found


class MpsDaemon:
    """One run's MPS control daemon: `start()`, `env()` for the children, `stop()` (idempotent)."""

    def __init__(self, run_dir: Path, probe: list[str] | None = None, timeout_s: float = 120.0):
        self.binary = binary()
        self.log_dir = Path(run_dir) / "mps"
        self.pipe_dir: Path | None = None
        self.probes = [DRIVER_PROBE, CUDA_PROBE] if probe is None else [probe]  # the first that passes
        self.timeout_s = timeout_s

    def env(self) -> dict[str, str]:
        """What a child needs for its CUDA calls to go through this daemon."""
        if self.pipe_dir is None:
            raise MpsError("the MPS daemon was not started")
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _run(self, argv: list[str], what: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        try:
            # nothing to say: the child reads an empty input, not up's own (a terminal or an open pipe)
            feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
            return subprocess.run(
                argv, env=os.environ | self.env(), capture_output=True, text=True, timeout=self.timeout_s, **feed
            )
        except subprocess.TimeoutExpired:
            raise MpsError(f"{what} did not end within {self.timeout_s:.0f} s; {FIX}") from None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pipe_dir = Path(tempfile.mkdtemp(prefix="parley-mps-"))
        started = self._run([self.binary, "-d"], f"{BINARY} -d")
        if started.returncode != 0:
            self.stop()
            raise MpsError(
                f"{BINARY} -d exited with code {started.returncode}: "
                f"{(started.stderr or started.stdout).strip()[-400:]}; {FIX}"
            )
        for argv in self.probes:
            probe = self._run(argv, "a CUDA process under MPS")
            if probe.returncode == 0:
                break
        if probe.returncode != 0:
            tail = (probe.stderr or probe.stdout).strip().splitlines()[-3:]
            self.stop()
            raise MpsError(
                f"the MPS daemon started, but a CUDA process could not run under it (exit code "
                f"{probe.returncode}: {' | '.join(tail)}; the daemon's log: {self.log_dir}); {FIX}"
            )

    def stop(self) -> None:
        """Tell the daemon to quit (it stops its server once the last client is gone) and remove the pipes."""
        if self.pipe_dir is None:
            return
        try:
            self._run([self.binary], "quitting the MPS daemon", stdin="quit\n")
        except MpsError:
            pass
        shutil.rmtree(self.pipe_dir, ignore_errors=True)
        self.pipe_dir = None


def start_for(
    share: str, run_dir: Path, gpu: bool, probe: list[str] | None = None, sleep_level: int | None = None
) -> tuple[MpsDaemon | None, str]:
    """The run's daemon, started, and a line for the operator; (None, line) where the GPU time-slices
    or is taken in turns. Which sharing is deploy/gpu_share.decide's (the same rule the check before
    start applied, which also resolved "auto" to "phased" where that wins): "mps" refuses with
    MpsError where MPS cannot serve; "auto" falls back to plain sharing then, and so does a run that
    puts nothing on a GPU; "plain" starts nothing, nor does "phased" (the learner and the actor take
    the GPU in turns, actors/phases.py: their kernels never overlap)."""
    from parley.deploy.gpu_share import Facts, decide

    chosen = decide(Facts(share=share, uses_gpu=gpu, mps_binary=shutil.which(BINARY), sleep_level=sleep_level))
    if chosen.mode != "mps":
        return None, chosen.line
    mps = MpsDaemon(run_dir, probe=probe)
    try:
        mps.start()
    except MpsError as e:
        if not chosen.fallback:
            raise
        return None, f'GPU sharing: plain (gpu_share = "auto" and MPS cannot serve: {e})'
    how = ' (gpu_share = "auto")' if share == "auto" else ""
    return mps, f"CUDA MPS{how}: daemon started (pipes {mps.pipe_dir}, logs {mps.log_dir}); every child runs under it"
