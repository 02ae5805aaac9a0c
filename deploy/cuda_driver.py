"""Questions `parley up` asks of the GPU before anything starts, put to the CUDA driver (libcuda,
through ctypes) in a short child process instead of to torch.cuda: the answer is the same number
(torch's total_memory is the driver's cuDeviceTotalMem), without the child's import of torch, which
was most of the seconds each question cost. Called by deploy/memory.detect_gpu_gib (the GPU's total)
and deploy/mps.MpsDaemon (a CUDA context and a little work under the run's MPS daemon).

A child process, as before, so that `parley up` itself initializes no CUDA for the whole run.
Where the driver cannot answer for another reason than "no driver" or "no device", the callers ask
torch as they did before: a driver of an odd build costs the old seconds, never another answer.
"""

from __future__ import annotations

import os
import subprocess
import sys

# The child's program: argv[1] is "total" (print "total BYTES") or "context" (print "ok"), exit code 0.
# Else it prints "nodriver" without libcuda or "nodevice" where the driver sees no GPU (exit code 2),
# or "error CALL CODE NAME" (exit code 3). Device 0 is the first of CUDA_VISIBLE_DEVICES, as for torch.
PROGRAM = r"""
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print("nodriver")
    raise SystemExit(2)
def check(rc, call):
    if rc:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        print("error", call, rc, (name.value or b"?").decode())
        raise SystemExit(3)
u64, size = ctypes.c_uint64, ctypes.c_size_t
rc = cuda.cuInit(0)
if rc == 100:  # CUDA_ERROR_NO_DEVICE
    print("nodevice")
    raise SystemExit(2)
check(rc, "cuInit")
dev = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
if sys.argv[1] == "total":
    total = size()
    check(cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev), "cuDeviceTotalMem_v2")
    print("total", total.value)
else:  # the device's primary context (the one torch makes), 1 MiB allocated, set, synchronized, freed
    ctx, ptr = ctypes.c_void_p(), u64()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), size(1 << 20)), "cuMemAlloc_v2")
    check(cuda.cuMemsetD8_v2(ptr, ctypes.c_ubyte(1), size(1 << 20)), "cuMemsetD8_v2")
    check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    check(cuda.cuMemFree_v2(ptr), "cuMemFree_v2")
    check(cuda.cuDevicePrimaryCtxRelease_v2(dev), "cuDevicePrimaryCtxRelease_v2")
    print("ok")
"""


def argv(question: str) -> list[str]:
    """The child's command line for `question` ("total" or "context"); -I: none of the caller's
    site or path settings are needed (ctypes only)."""
    return [sys.executable, "-I", "-c", PROGRAM, question]


def ask(question: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> str:
    """The child's answer line for `question` ("total BYTES", "ok", "nodriver", "nodevice" or
    "error ..."); "error ..." too where it could not run or ended otherwise."""
    try:
        out = subprocess.run(
            argv(question),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=os.environ if env is None else env,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"error {type(e).__name__}: {e}"
    lines = out.stdout.strip().splitlines()
    if not lines:
        return f"error exit code {out.returncode}: {out.stderr.strip()[-300:]}"
    return lines[-1]


def total_bytes(timeout_s: float = 120.0) -> int | None | str:
    """The first visible GPU's total memory in bytes; None where there is no driver or no GPU; the
    answer line ("error ...") where the driver could not say."""
    answer = ask("total", timeout_s)
    if answer in ("nodriver", "nodevice"):
        return None
    head, _, value = answer.partition(" ")
    if head == "total" and value.isdigit():
        return int(value)
    return answer
