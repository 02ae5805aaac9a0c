"""deploy/gpu_samples.py and the report's GPU timeline, without a GPU: an nvidia-smi test double on
PATH (a shell script printing fixed query answers) stands in for the real one. Shown: samples and
per-process rows land in RUN_DIR/gpu with this machine's clock; a process is named by the child
whose session it runs in; `parley report` draws gpu.png from them with the steps' ends; a run
without samples gets no timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from parley.deploy.gpu_samples import GpuSampler, read_samples, role_of
from parley.deploy.report import write_report


def fake_smi(bin_dir: Path, pid: int) -> None:
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu=*) echo "37, 81920, 143771" ;;\n'
        f'  --query-compute-apps=*) echo "{pid}, 40960"; echo "{os.getpid()}, 1024" ;;\n'
        "esac\n"
    )
    script.chmod(0o755)


def test_samples_name_each_process_by_its_childs_session(tmp_path, monkeypatch):
    # a child in a session of its own, as runtime.supervisor starts them, and a grandchild in it (a vLLM
    # EngineCore counts for the actor that started it)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
            "print(p.pid, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        grandchild = int(child.stdout.readline())
        (tmp_path / "bin").mkdir()
        fake_smi(tmp_path / "bin", grandchild)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        assert role_of(grandchild, {child.pid: "actor-0"}) == "actor-0"
        sampler = GpuSampler.start_if_gpu(True, tmp_path, lambda: {child.pid: "actor-0"})
        assert sampler is not None
        time.sleep(2.5)
        sampler.stop()
    finally:
        child.kill()
    samples, by_role = read_samples(tmp_path)
    assert len(samples) >= 2 and all(s[1] == 37.0 and s[2] == 80.0 for s in samples)
    assert abs(samples[-1][0] - time.time()) < 10
    assert set(by_role) == {"actor-0", "other"} and by_role["actor-0"][0][1] == 40.0

    rows = [{"step": i, "reward_mean": 0.1 * i, "ended_at": samples[0][0] + i} for i in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = write_report(tmp_path, tmp_path / "report")
    assert tmp_path / "report" / "gpu.png" in written and (tmp_path / "report" / "gpu.png").stat().st_size > 10_000


def test_no_gpu_no_sampler_and_no_timeline(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert GpuSampler.start_if_gpu(True, tmp_path, dict) is None
    assert GpuSampler.start_if_gpu(False, tmp_path, dict) is None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    assert [p.name for p in write_report(tmp_path, tmp_path / "report")] == ["rewards.png", "kl.png"]
