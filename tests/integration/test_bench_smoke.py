"""The bench/ scripts still run: each is started with tiny sizes (a real nats-server inside) and must
print its table. Figures are not checked here; docs/benchmarks.md holds the measured ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# extended tier (make test-extended): the scripts measure, the product does not import them; each is
# started whole with its own nats-server, about a minute together
pytestmark = [pytest.mark.integration, pytest.mark.extended]
ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, tmp_path: Path) -> str:
    # PARLEY_CACHE under tmp_path would rebuild the tiny model; the user's cache is shared on purpose.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bus_capacity_prints_its_table(tmp_path):
    out = run_bench(
        "bus_capacity.py",
        "--sizes-kb",
        "4",
        "--trajectories",
        "16",
        "--n",
        "2",
        "--slots",
        "4",
        "--repeats",
        "1",
        tmp_path=tmp_path,
    )
    assert "| parley / raw 3-hop | parley / raw 1-hop |" in out
    row = next(line for line in out.splitlines() if line.startswith("| 4."))
    assert row.count("|") == 11  # 10 filled columns: every figure is there


def test_bus_capacity_runs_an_old_checkout_beside_it(tmp_path):
    # this very commit stands in for "the previous code": what is checked is the child-process route
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    out = run_bench(
        "bus_capacity.py",
        "--sizes-kb",
        "4",
        "--trajectories",
        "8",
        "--n",
        "2",
        "--slots",
        "4",
        "--repeats",
        "1",
        "--old",
        str(old),
        tmp_path=tmp_path,
    )
    assert "| old / raw 3-hop | new / raw 3-hop |" in out


def test_async_vs_sync_prints_its_table(tmp_path):
    out = run_bench(
        "async_vs_sync.py",
        "--staleness",
        "0",
        "1",
        "--seconds",
        "3",
        "--step-s",
        "0.05",
        "--median-s",
        "0.02",
        "--groups-per-step",
        "2",
        "--n",
        "2",
        "--slots",
        "4",
        tmp_path=tmp_path,
    )
    assert "| max_staleness | steps | steps/hour | vs sync |" in out
    assert any(line.startswith("| 1 |") for line in out.splitlines())
    assert "speedup bound" in out


def test_gpu_delta_rebuilds_each_version_through_the_object_store(tmp_path):
    # the bench asserts the actor's rebuilt buffer equals the learner's bit for bit (exit 1 otherwise)
    out = run_bench(
        "gpu_delta.py",
        "--model",
        "tiny",
        "--lrs",
        "1e-5",
        "--steps",
        "2",
        "--json",
        str(tmp_path / "out.json"),
        tmp_path=tmp_path,
    )
    assert '"1e-05"' in out
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [r["step"] for r in rows if r["delta"]] == [1, 2]
    assert all(0 < r["delta_bytes"] < r["packed_bytes"] for r in rows)
