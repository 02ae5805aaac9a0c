"""What the GPU did during `parley up`: a thread that asks nvidia-smi, every `interval_s`, for the
GPU's utilization and memory and for each process's memory, and appends them to
RUN_DIR/gpu/samples.csv and RUN_DIR/gpu/apps.csv with this machine's wall clock (the clock of the
learner's `ended_at` and of the role logs). A process is named by the `parley up` child whose
session it belongs to (a vLLM EngineCore counts for the actor that started it). `parley report`
draws the timeline (deploy/report.py, gpu.png). Started only when the config puts work on a GPU and
nvidia-smi is on PATH; a failing query is logged once and sampling goes on.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from parley.deploy.common import stamped

log = logging.getLogger(__name__)

SAMPLES_HEADER = "time,util_pct,mem_used_mib,mem_total_mib\n"
APPS_HEADER = "time,pid,role,used_mib\n"


def _query(args: list[str]) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def role_of(pid: int, sessions: dict[int, str]) -> str:
    """The child (name) whose session `pid` runs in, or "other"."""
    try:
        return sessions.get(os.getsid(pid), "other")
    except OSError:  # gone, or another container's process
        return "other"


class GpuSampler:
    def __init__(self, run_dir: Path, sessions: Callable[[], dict[int, str]], interval_s: float = 1.0):
        self.dir = Path(run_dir) / "gpu"
        self.sessions, self.interval_s = sessions, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    @classmethod
    def start_if_gpu(cls, uses_gpu: bool, run_dir: Path, sessions: Callable[[], dict[int, str]]) -> GpuSampler | None:
        if not uses_gpu or shutil.which("nvidia-smi") is None:
            return None
        sampler = cls(run_dir, sessions)
        sampler.start()
        print(
            stamped(
                f"GPU samples: {sampler.dir} (nvidia-smi every {sampler.interval_s:g} s; `parley report` draws them)"
            ),
            flush=True,
        )
        return sampler

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for name, header in (("samples.csv", SAMPLES_HEADER), ("apps.csv", APPS_HEADER)):
            path = self.dir / name
            if not path.exists():
                path.write_text(header)
        self._thread = threading.Thread(target=self._run, name="gpu-samples", daemon=True)
        self._thread.start()

    def sample_once(self) -> None:
        now = time.time()
        gpus = _query(["--query-gpu=utilization.gpu,memory.used,memory.total"])
        apps = _query(["--query-compute-apps=pid,used_memory"])
        sessions = self.sessions()
        with (self.dir / "samples.csv").open("a") as f:
            for util, used, total in gpus[:1]:  # the first GPU: the one-GPU deployment's
                f.write(f"{now:.3f},{util},{used},{total}\n")
        with (self.dir / "apps.csv").open("a") as f:
            for pid, used in apps:
                if pid.isdigit():
                    f.write(f"{now:.3f},{pid},{role_of(int(pid), sessions)},{used}\n")

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.sample_once()
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                if not self._warned:
                    log.warning("GPU samples: nvidia-smi failed (%s); will keep trying", e)
                    self._warned = True
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)


def read_samples(run_dir: Path) -> tuple[list[tuple[float, float, float]], dict[str, list[tuple[float, float]]]]:
    """([(time, util %, used GiB)], {role: [(time, GiB)]}) from RUN_DIR/gpu; empty when not sampled.
    A role's memory at a sample is the sum over its processes."""
    base = Path(run_dir) / "gpu"
    samples: list[tuple[float, float, float]] = []
    if (base / "samples.csv").exists():
        for line in (base / "samples.csv").read_text().splitlines()[1:]:
            parts = line.split(",")
            try:
                samples.append((float(parts[0]), float(parts[1]), float(parts[2]) / 1024))
            except (ValueError, IndexError):
                continue  # "[N/A]" or a line cut by a stop
    by_role: dict[str, dict[float, float]] = {}
    if (base / "apps.csv").exists():
        for line in (base / "apps.csv").read_text().splitlines()[1:]:
            parts = line.split(",")
            try:
                t, role, mib = float(parts[0]), parts[2], float(parts[3])
            except (ValueError, IndexError):
                continue
            by_role.setdefault(role, {})
            by_role[role][t] = by_role[role].get(t, 0.0) + mib / 1024
    return samples, {r: sorted(v.items()) for r, v in by_role.items()}
