"""deploy/cuda_driver.py: what `parley up` asks of the GPU before anything starts (its total memory for
the memory plan, a context under the run's MPS daemon), put to the CUDA driver through ctypes in a short
child process instead of a child that imports torch. The driver here is a test double: a small
libcuda.so.1 built with gcc on the spot, whose answers an environment variable picks (no GPU on this
machine); where the driver cannot answer, torch is asked as before."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time

import pytest

from parley.deploy import cuda_driver, memory, mps

# the test double of the driver: FAKE_CUDA = ok | nodevice | totalfail | ctxfail
FAKE_LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
static const char *mode(void) { const char *m = getenv("FAKE_CUDA"); return m ? m : "ok"; }
int cuInit(unsigned flags) { return strcmp(mode(), "nodevice") == 0 ? 100 : 0; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return 0; }
int cuDeviceTotalMem_v2(size_t *bytes, int dev) {
    if (strcmp(mode(), "totalfail") == 0) return 999;
    *bytes = 85024112640ULL; return 0;  /* an H100 80GB HBM3's, as torch's total_memory gives it */
}
int cuGetErrorName(int rc, const char **name) {
    *name = rc == 805 ? "CUDA_ERROR_MPS_CONNECTION_FAILED" : "CUDA_ERROR_UNKNOWN"; return 0;
}
static char device_memory[1 << 20];
int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (strcmp(mode(), "ctxfail") == 0) return 805;
    *ctx = (void *)1; return 0;
}
int cuCtxSetCurrent(void *ctx) { return ctx ? 0 : 201; }
int cuMemAlloc_v2(unsigned long long *ptr, size_t bytes) { *ptr = (unsigned long long)device_memory; return bytes == sizeof device_memory ? 0 : 2; }
int cuMemsetD8_v2(unsigned long long ptr, unsigned char value, size_t n) { memset((void *)ptr, value, n); return 0; }
int cuCtxSynchronize(void) { return device_memory[(1 << 20) - 1] == 1 ? 0 : 999; }
int cuMemFree_v2(unsigned long long ptr) { return ptr == (unsigned long long)device_memory ? 0 : 1; }
int cuDevicePrimaryCtxRelease_v2(int dev) { return 0; }
"""


def _real_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture
def fake_driver(tmp_path, monkeypatch):
    """The double's folder first on LD_LIBRARY_PATH; set FAKE_CUDA to pick its answers."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the test double of libcuda")
    if _real_driver():
        pytest.skip("a real CUDA driver is here: the double would not be the one loaded")
    (tmp_path / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "fake.c")],
        check=True,
        timeout=60,
    )
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    memory.detect_gpu_gib.cache_clear()
    yield monkeypatch
    memory.detect_gpu_gib.cache_clear()


def _no_torch(*_):
    raise AssertionError("torch was asked although the driver answered")


def test_the_gpu_total_comes_from_the_driver_without_torch(fake_driver):
    fake_driver.setattr(memory, "_torch_gpu_gib", _no_torch)
    assert cuda_driver.total_bytes() == 85024112640
    assert memory.detect_gpu_gib() == pytest.approx(85024112640 / 1024**3)  # 79.18 GiB, torch's figure


def test_no_device_is_no_gpu_and_a_driver_that_cannot_say_leaves_it_to_torch(fake_driver):
    fake_driver.setattr(memory, "_torch_gpu_gib", _no_torch)
    fake_driver.setenv("FAKE_CUDA", "nodevice")
    assert memory.detect_gpu_gib() is None
    memory.detect_gpu_gib.cache_clear()
    fake_driver.setenv("FAKE_CUDA", "totalfail")
    assert cuda_driver.total_bytes() == "error cuDeviceTotalMem_v2 999 CUDA_ERROR_UNKNOWN"
    fake_driver.setattr(memory, "_torch_gpu_gib", lambda: 79.0)  # test double of torch's answer
    assert memory.detect_gpu_gib() == 79.0


def test_the_context_probe_passes_or_names_the_failing_call(fake_driver):
    ok = subprocess.run(mps.DRIVER_PROBE, capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.strip()) == (0, "ok"), ok.stderr
    fake_driver.setenv("FAKE_CUDA", "ctxfail")
    bad = subprocess.run(mps.DRIVER_PROBE, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 3 and bad.stdout.strip() == (
        "error cuDevicePrimaryCtxRetain 805 CUDA_ERROR_MPS_CONNECTION_FAILED"
    )


@pytest.mark.skipif(_real_driver(), reason="a real CUDA driver is here")
def test_without_a_driver_the_answer_is_quick_and_none():
    memory.detect_gpu_gib.cache_clear()
    t0 = time.monotonic()
    assert cuda_driver.total_bytes() is None and cuda_driver.ask("context") == "nodriver"
    assert time.monotonic() - t0 < 5.0  # no torch import (seconds on this machine)
    memory.detect_gpu_gib.cache_clear()


def test_the_mps_daemon_asks_torch_only_where_the_drivers_probe_fails(tmp_path, monkeypatch):
    from tests.unit.test_mps import calls_of, double

    calls = double(tmp_path, monkeypatch)
    marks = tmp_path / "probes"
    driver = [sys.executable, "-c", f"open({str(marks)!r}, 'a').write('driver\\n'); raise SystemExit(3)"]
    torch_ = [sys.executable, "-c", f"open({str(marks)!r}, 'a').write('torch\\n')"]
    monkeypatch.setattr(mps, "DRIVER_PROBE", driver)
    monkeypatch.setattr(mps, "CUDA_PROBE", torch_)
    daemon = mps.MpsDaemon(tmp_path / "run")
    daemon.start()  # the driver's probe failed, torch's passed: MPS serves
    assert marks.read_text().split() == ["driver", "torch"]
    daemon.stop()
    assert [c["stdin"] for c in calls_of(calls)] == ["", "quit\n"]
    marks.unlink()
    monkeypatch.setattr(mps, "DRIVER_PROBE", torch_)  # the driver's probe passing: torch not asked
    again = mps.MpsDaemon(tmp_path / "run2")
    again.start()
    again.stop()
    assert marks.read_text().split() == ["torch"]
