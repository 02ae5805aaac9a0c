"""Learner lives started fast: one process imports the learner's modules once (torch, transformers,
DeepSpeed: most of a `parley learner` start on the toy model), then forks a child per life that runs
the real command line (`parley.deploy.cli.run`), with its own environment (PARLEY_KILL_AT) and log.
A child is a whole learner process: killed by SIGKILL it leaves what a killed `parley learner` leaves.

Run as `python -m tests.faults.lives`; it reads one JSON line per life on stdin
({"argv": [...], "env": {...}, "log": path}) and answers one JSON line per life on stdout once the
child has started ({"started": pid}) and once it has ended: {"pid": ..., "code": exit code, or
-signal when a signal ended it}. `Lives` is the
test side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def serve() -> None:
    # the answers go on a copy of stdout; fd 1 goes to stderr, so what a library prints is no answer
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401 - imported before the forks, so no life pays for it
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 - deepspeed.initialize's optimizer check imports it, and with it torch._inductor
    import pyarrow.parquet  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    import parley.deploy.cli
    import parley.evaluation.evallog
    import parley.evaluation.leakage
    import parley.learner.lease
    import parley.learner.ranks
    import parley.learner.service
    import parley.learner.trainer
    import parley.rewards.diagnostics
    import parley.runtime.tracking  # noqa: F401 - the modules a learner life imports, found by listing them

    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        life = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: a learner process of its own
            try:
                out.close()
                _die_with_parent()
                os.environ.update(life["env"])
                if life["env"].get(JOURNAL_ENV):
                    journal_durability(life["env"][JOURNAL_ENV])
                fd = os.open(life["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdin.close()
                code = parley.deploy.cli.run(life["argv"])
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException as e:  # noqa: BLE001 - reported as the life's exit code
                import traceback

                print(f"life failed: {type(e).__name__}: {e}", file=sys.stderr)
                traceback.print_exc()
                sys.stderr.flush()
                code = 1
            os._exit(code)
        print(json.dumps({"started": pid}), file=out, flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"pid": pid, "code": code}), file=out, flush=True)


JOURNAL_ENV = "PARLEY_TEST_FSYNC_JOURNAL"


def journal_durability(path: str) -> None:
    """Record, in this process, what a power cut would keep: every fsync of a regular file (its path and
    size then) and every rename, appended to the journal at `path` as JSON lines, written straight to
    the file so a SIGKILL right after loses none (tests/faults/test_kill_power.py replays them)."""
    import stat

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def note(event: dict) -> None:
        os.write(fd, (json.dumps(event) + "\n").encode())

    def fsync(f) -> None:
        real_fsync(f)
        n = f if isinstance(f, int) else f.fileno()
        st = os.fstat(n)
        if stat.S_ISREG(st.st_mode):
            note({"fsync": os.readlink(f"/proc/self/fd/{n}"), "size": st.st_size})

    def replace(src, dst, **kw) -> None:
        real_replace(src, dst, **kw)
        note({"rename": os.path.abspath(src), "to": os.path.abspath(dst)})

    def rename(src, dst, **kw) -> None:
        real_rename(src, dst, **kw)
        note({"rename": os.path.abspath(src), "to": os.path.abspath(dst)})

    os.fsync, os.replace, os.rename = fsync, replace, rename


def _die_with_parent() -> None:
    """A life left behind by a test that failed is SIGKILLed with this process (Linux prctl)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9)


class Lives:
    """The test's handle on the forking process: start() once, then life(...) per learner life,
    awaited with wait(); close() at the end."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.lives"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
        )
        self.ready = False  # its imports run while the test prepares (start() waits for them)

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> int:
        """Start a life; its pid."""
        if not self.ready:
            if not self.proc.stdout.readline():
                raise RuntimeError(f"tests.faults.lives did not start (exit {self.proc.wait()})")
            self.ready = True
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["started"]

    def wait(self) -> int:
        """The exit code of the life started last (-9: SIGKILLed); blocks until it ends."""
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("tests.faults.lives ended")
        return json.loads(line)["code"]

    def close(self) -> None:
        """End the forking process; a life still running dies with it (_die_with_parent)."""
        self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    serve()
