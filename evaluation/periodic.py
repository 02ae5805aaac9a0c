"""The learner's periodic eval: version 0, every `eval_every`-th version and the last one are played on
the held-out split by `parley eval --follow` (the same runner, simulator and judge services as the
benchmark), one version at a time in one long-lived child process that loads each version's weights
into its engine in place, while training goes on. Results land in
RUN_DIR/eval/v<N>/records.parquet, which `parley select` reads; the best version's model is kept in
RUN_DIR/eval/models/v<N>. With `early_stop`, a significant regression of `eval_metric` stops training.

Layout and semantics: docs/benchmark.md ("Periodic eval and early stop").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from parley.evaluation.runner import read_unscored
from parley.runtime.durable import write_durable_text

log = logging.getLogger(__name__)

# A learner started by `parley up` gets the eval role's NATS credentials in these variables and hands
# them to its eval child as PARLEY_NATS_USER / PASSWORD (the learner's own user may not call sim/judge).
EVAL_USER_ENV, EVAL_PASSWORD_ENV = "PARLEY_EVAL_NATS_USER", "PARLEY_EVAL_NATS_PASSWORD"


@dataclass
class EvalJob:
    version: int
    step: int
    model: str  # model name or exported checkpoint dir


@dataclass
class EvalOutcome:
    version: int
    ok: bool
    means: dict[str, float] = field(default_factory=dict)
    n: int = 0
    seconds: float = 0.0
    error: str = ""
    unscored: list[str] = field(default_factory=list)  # per conversation not scored: "eval_id (stage): reason"


def eval_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "eval"


def version_dir(run_dir: str | Path, version: int) -> Path:
    return eval_root(run_dir) / f"v{version}"


def model_dir(run_dir: str | Path, version: int) -> Path:
    return eval_root(run_dir) / "models" / f"v{version}"


def owed_marker(run_dir: str | Path, version: int) -> Path:
    """A version whose eval was submitted while its export runs behind training (PeriodicEval.submit
    with `write`): durable until the export is in place, so a learner stopped meanwhile exports it at
    its next start (requeue_unfinished)."""
    return eval_root(run_dir) / "owed" / f"v{version}"


def failed_dir(run_dir: str | Path, version: int) -> Path:
    """Where a version's failed eval is set aside (its log), so that it is not played again."""
    return eval_root(run_dir) / f"v{version}.failed"


def exported_models(run_dir: str | Path) -> dict[int, Path]:
    """The exported models in eval/models by version (an export still being written is not one)."""
    root = eval_root(run_dir) / "models"
    out = {}
    for d in root.iterdir() if root.is_dir() else []:
        with contextlib.suppress(ValueError):
            if not d.name.startswith("."):
                out[int(d.name[1:])] = d
    return out


def evaluated(run_dir: str | Path, version: int) -> bool:
    return (version_dir(run_dir, version) / "records.parquet").is_file()


def eval_argv(cfg, config_path: Path, out: Path) -> list[str]:
    """`parley eval --follow` on the run's held-out split, through the sim/judge services (the run's
    environment comes with its config; an empty [rollout] sim_prompt is the environment's own): one
    child for the whole run, told each version on its standard input (`job_line`)."""
    lc = cfg.learner
    sim_prompt = ["--user-sim-prompt", cfg.rollout.sim_prompt] if cfg.rollout.sim_prompt else []
    return [
        sys.executable,
        "-m",
        "parley.deploy.cli",
        "eval",
        "--config",
        str(config_path),
        "--services",
        "nats",
        "--follow",
        "--n-items",
        str(lc.eval_items),
        "--assistant-max-tokens",
        str(cfg.rollout.max_tokens),
        "--max-new-turns",
        str(cfg.rollout.max_new_turns),
        *sim_prompt,
        "--out",
        str(out),
    ]


def job_line(job: EvalJob, out: Path) -> bytes:
    return (json.dumps({"version": job.version, "model": job.model, "out": str(out)}) + "\n").encode()


def _die_with_parent_hook():
    """A preexec_fn so that a SIGKILLed learner does not leave an eval child holding a policy engine
    (prctl PR_SET_PDEATHSIG). Everything is looked up here, in the parent: between fork and exec
    the child only makes the one C call (no imports, no locks)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        import signal

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
        sigterm = int(signal.SIGTERM)
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, sigterm)  # 1 = PR_SET_PDEATHSIG


class FollowingChild:
    """The learner's one `parley eval --follow` child: started with the learner (`start`; at the first
    eval where the learner did not, and again after it exits), it opens its policy engine at once,
    keeps it and loads each version's weights in place, so a version's eval
    costs its conversations and not an engine start (most of a version's eval before: docs/benchmarks.md,
    "Observations behind the code"). A reader drains its output all the time (a full pipe would stop it): what it prints
    while a job runs goes to that job's eval.log, the rest to `log_path`."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.reader: asyncio.Task | None = None
        self.sink = None  # the file the reader writes to now
        self.answer: asyncio.Future | None = None  # the running job's exit code
        self.starts = 0

    @property
    def running(self) -> bool:
        return not (self.proc is None or self.proc.returncode is not None or self.reader is None or self.reader.done())

    async def start(self) -> None:
        """Start the child unless it runs."""
        if not self.running:
            await self._start()

    async def _start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            preexec_fn=_die_with_parent_hook(),
        )
        self.starts += 1
        self.reader = asyncio.create_task(self._read(self.proc), name="eval-child-output")
        log.info("eval: started its child (pid %d): %s", self.proc.pid, " ".join(self.argv[2:]))

    async def _read(self, proc) -> None:
        from parley.evaluation.commands import DONE_MARK

        mark = DONE_MARK.encode()
        with self.log_path.open("ab") as between:
            while line := await proc.stdout.readline():
                if line.startswith(mark):
                    if self.answer is not None and not self.answer.done():
                        self.answer.set_result(int(json.loads(line[len(mark) :])["code"]))
                    continue
                out = self.sink or between
                out.write(line)
                out.flush()
        code = await proc.wait()  # end of output: the child exited
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(1 if code is None else 128 - code if code < 0 else code or 1)
            log.error("eval: its child exited with %s in the middle of a version", code)
        elif code and proc is self.proc:  # not ended by close(): e.g. one started early that failed to start
            log.error("eval: its child exited with %s between versions (its output: %s)", code, self.log_path)

    async def run(self, job: EvalJob, out: Path) -> int:
        """Play `job` into `out`; the child's exit code for it (that of a child that died on it)."""
        await self.start()
        self.answer = asyncio.get_running_loop().create_future()
        try:
            with (out / "eval.log").open("ab") as job_log:
                self.sink = job_log
                try:
                    self.proc.stdin.write(job_line(job, out))
                    await self.proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it died between jobs: the reader answers with its exit code
                await asyncio.wait({self.answer, self.reader}, return_when=asyncio.FIRST_COMPLETED)
                if self.answer.done():
                    return self.answer.result()
                problem = self.reader.exception() if not self.reader.cancelled() else None
                log.error(
                    "eval: reading its child's output failed (%r); version %d is not recorded", problem, job.version
                )
                return 1
        except asyncio.CancelledError:
            await self.close()
            raise
        finally:
            self.sink = None
            self.answer = None

    async def close(self) -> None:
        """End the child: end of input first (it shuts its engine down), then terminate, then kill."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(OSError, RuntimeError):
                proc.stdin.close()
            for send, wait_s in ((None, 20.0), (proc.terminate, 20.0), (proc.kill, 10.0)):
                if send is not None:
                    with contextlib.suppress(ProcessLookupError):
                        send()
                try:
                    await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=wait_s)
                    break
                except TimeoutError:
                    continue
        if self.reader is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.reader), timeout=5.0)
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
            self.reader = None


Launcher = Callable[[EvalJob, Path], Awaitable[int]]  # (job, partial output dir) -> exit code
# (run dir, version, output dir) -> the exported checkpoint: the learner's learner.checkpoint.export_version
Exporter = Callable[[Path, int, Path], Path]


class PeriodicEval:
    """Schedules and runs the learner's evals, one at a time, oldest version first.

    `submit(version)` is called right after a version is published: it exports that version's weights
    at once (they may be pruned before its turn comes) and queues it. `run(halt)` works through the
    queue; each finished eval is read back, logged, kept as the best model or deleted, and checked for
    a regression. `export` writes a version as a checkpoint (the learner passes its own); `launch` is
    the child-process launcher (a test double in unit tests). `start()` starts the child before any
    version is queued (the learner calls it before it builds its model); `close()` ends it where `run`
    never ran (a learner that fails to start).
    """

    def __init__(self, cfg, run_dir: str | Path, *, export: Exporter, launch: Launcher | None = None):
        from parley.evaluation.selection import check_metric
        from parley.runtime.toml import to_toml

        self.cfg, self.lc, self.run_dir = cfg, cfg.learner, Path(run_dir)
        self.env, self.env_record = cfg.env.load(), cfg.env.record()
        self.metric = check_metric(self.lc.eval_metric or self.env.eval.select, label="eval_metric", env=self.env)
        self.root = eval_root(self.run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_path = self.root / "config.toml"
        self.config_path.write_text(to_toml(cfg))
        self.export = export
        self.queue: asyncio.Queue[EvalJob | None] = asyncio.Queue()
        self.queued: set[int] = set()
        self.outcomes: list[EvalOutcome] = []
        self.current: int | None = None
        self.unfinished = 0  # submitted and not yet finished (queued or running)
        self.regression = ""  # why training should stop; "" while it should not
        self._changed = asyncio.Event()  # an eval finished (drain re-checks)
        self.child: FollowingChild | None = None
        self.own_child = launch is None  # the real child, which start() may start before any job
        self.launch = launch or self._launch_child
        self._behind: asyncio.Task | None = None  # submit's export running behind training

    # -- scheduling -------------------------------------------------------------------------------

    def due(self, version: int, last: bool = False) -> bool:
        every = self.lc.eval_every
        if every <= 0 or version in self.queued or evaluated(self.run_dir, version):
            return False
        return version == 0 or version % every == 0 or last

    async def submit(self, version: int, step: int, write: Callable[[], object] | None = None) -> None:
        """Queue `version`; its weights are exported first (the learner keeps only the last few).

        `write` (weights.publish.Weights.eval_copy: a version that travels in GPU buffers, copied to the
        CPU on the step's path): writes its files into the learner's weights directory. The write and the
        export then run behind training rather than on the step's path (about 0.55 s of a SmolLM2 step's
        end on an H100, 2026-12-07, every eval_every versions), and the version is queued when they are
        done. Until then a durable marker (owed_marker) says the version is owed an eval, so a learner
        stopped meanwhile exports it at its next start. One runs at a time: a second waits here for the
        first, so at most one CPU copy of the weights waits."""
        if write is None or version == 0:
            model = await self._export(version)
            if model is not None:
                self._queue(EvalJob(version=version, step=step, model=model))
            return
        await self.settle()
        mark = owed_marker(self.run_dir, version)
        mark.parent.mkdir(parents=True, exist_ok=True)
        write_durable_text(mark, f"{step}\n")
        self.queued.add(version)
        self.unfinished += 1  # counted now: the drain at the end waits for it
        self._behind = asyncio.create_task(self._export_behind(version, step, write, mark))

    async def settle(self) -> None:
        """Wait for the export running behind training (submit's `write`), if one does."""
        if self._behind is not None and not self._behind.done():
            await asyncio.wait({self._behind})

    async def _export_behind(self, version: int, step: int, write: Callable[[], object], mark: Path) -> None:
        """submit's write and export, behind training. Nothing here may stop training: a failure (a full
        disk, a damaged file, a bug) leaves that version unevaluated, with its reason among the outcomes."""
        queued = False
        try:
            try:
                await asyncio.to_thread(write)
                model = await self._export(version)  # None: failed, recorded by _export
            except Exception as e:  # noqa: BLE001 - the version goes unevaluated, training goes on
                log.error(
                    "eval: version %d not queued, its weights not written or exported: %s: %s",
                    version,
                    type(e).__name__,
                    e,
                )
                self.outcomes.append(EvalOutcome(version, ok=False, error=f"export: {type(e).__name__}: {e}"))
                model = None
            mark.unlink(missing_ok=True)  # exported (models/v<N> is whole), or failed and recorded
            if model is not None:
                self._queue(EvalJob(version=version, step=step, model=model), counted=True)
                queued = True
        finally:
            if not queued:
                self.unfinished -= 1
                self._changed.set()

    async def _export(self, version: int) -> str | None:
        """The model an eval of `version` plays: the policy's for version 0, else the version exported to
        eval/models/v<N>; None when the export failed (recorded as a failed outcome)."""
        if version == 0:
            return self.cfg.policy.model
        out = model_dir(self.run_dir, version)
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._export_into, version, out)
        except (OSError, RuntimeError) as e:  # e.g. disk full: that version goes unevaluated, training goes on
            log.error("eval: version %d not queued, its export failed: %s", version, e)
            self.outcomes.append(EvalOutcome(version, ok=False, error=f"export: {e}"))
            return None
        log.info("eval: exported version %d to %s in %.1fs", version, out, time.perf_counter() - t0)
        return str(out)

    def _export_into(self, version: int, out: Path) -> None:
        """Written aside, then renamed: a models/v<N> is whole, so a learner started again can play it."""
        part = out.with_name(f".{out.name}.export")
        try:
            shutil.rmtree(part, ignore_errors=True)
            self.export(self.run_dir, version, part)
            shutil.rmtree(out, ignore_errors=True)
            part.rename(out)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise

    def _queue(self, job: EvalJob, counted: bool = False) -> None:
        """counted: unfinished already counts it (submit's export behind training)."""
        self.queued.add(job.version)
        if not counted:
            self.unfinished += 1
        self.queue.put_nowait(job)
        log.info("eval: version %d queued (%d waiting)", job.version, self.queue.qsize())

    def requeue_unfinished(self, upto: int) -> list[int]:
        """At a learner's start: queue again the versions up to `upto` (the step it starts from) whose
        eval an earlier learner of the run queued and did not finish (it failed, was stopped, or its
        drain timed out): each has its exported model (models/v<N>, whole: submit renames it into
        place), or is version 0, played from the policy model (also where no learner queued it: an
        earlier one ran without the eval). A version past `upto` belongs to steps
        the run is about to train again, so its model is deleted; an export cut short is deleted; a
        version whose eval failed (v<N>.failed) is not played again. Returns the versions queued."""
        models = self.root / "models"
        for d in models.glob(".*.export"):  # an export cut short
            shutil.rmtree(d, ignore_errors=True)
        self._settle_owed(upto)
        found: dict[int, str] = {}
        if self.lc.eval_every > 0 and self._unplayed(0):  # the baseline every selection reads
            found[0] = self.cfg.policy.model
        for version, d in exported_models(self.run_dir).items():
            if version > upto:
                log.info("eval: version %d's exported model is from steps trained again now; deleted", version)
                shutil.rmtree(d, ignore_errors=True)
            elif self._unplayed(version):
                found[version] = str(d)
        for version in sorted(found):
            log.warning("eval: version %d was queued by an earlier learner and not finished; played now", version)
            self._queue(EvalJob(version=version, step=version, model=found[version]))
        return sorted(found)

    def _settle_owed(self, upto: int) -> None:
        """The versions an earlier learner submitted whose export it did not finish (owed_marker):
        exported now from what the run kept of them (their weights directory or checkpoint), so the
        requeue below plays them; one whose weights are gone is set aside as failed, saying so. Those
        past `upto` belong to steps trained again now: dropped."""
        owed = owed_marker(self.run_dir, 0).parent
        for mark in sorted(owed.glob("v*")) if owed.is_dir() else []:
            try:
                version = int(mark.name[1:])
            except ValueError:
                continue
            out = model_dir(self.run_dir, version)
            if version <= upto and not out.is_dir() and self._unplayed(version):
                try:
                    self._export_into(version, out)
                    log.warning("eval: version %d's export was cut short by the learner's stop; exported now", version)
                except (OSError, RuntimeError, ValueError) as e:
                    failed = failed_dir(self.run_dir, version)
                    failed.mkdir(parents=True, exist_ok=True)
                    reason = f"owed an eval, but its weights were not kept when the learner stopped before exporting them: {e}"
                    (failed / "error.txt").write_text(reason + "\n")
                    log.error("eval: version %d %s", version, reason)
            mark.unlink(missing_ok=True)

    def _unplayed(self, version: int) -> bool:
        failed = failed_dir(self.run_dir, version).exists()
        return not (evaluated(self.run_dir, version) or failed or version in self.queued)

    def counters(self) -> dict[str, float]:
        """For the learner's heartbeat: the last finished eval's means, what runs and what waits."""
        out = {
            "eval.queued": float(self.queue.qsize()),
            "eval.running": float(-1 if self.current is None else self.current),
        }
        done = [o for o in self.outcomes if o.ok]
        if done:
            out["eval.version"] = float(done[-1].version)
            out.update({f"eval.{m}": v for m, v in done[-1].means.items()})
        out["eval.failed"] = float(sum(not o.ok for o in self.outcomes))
        return out

    @property
    def busy(self) -> bool:
        return self.unfinished > 0

    # -- running ----------------------------------------------------------------------------------

    async def run(self, halt: asyncio.Event) -> None:
        """Work through the queue until `halt`; an eval in progress is terminated on halt, and the
        eval child is ended at the end."""
        try:
            await self._work(halt)
        finally:
            await self.close()

    async def _work(self, halt: asyncio.Event) -> None:
        while not halt.is_set():
            get = asyncio.ensure_future(self.queue.get())
            halted = asyncio.ensure_future(halt.wait())
            await asyncio.wait({get, halted}, return_when=asyncio.FIRST_COMPLETED)
            halted.cancel()
            if not get.done():
                get.cancel()
                break
            job = get.result()
            if job is None:
                break
            self.current = job.version
            try:
                work = asyncio.ensure_future(self.evaluate(job))
                halted = asyncio.ensure_future(halt.wait())
                await asyncio.wait({work, halted}, return_when=asyncio.FIRST_COMPLETED)
                halted.cancel()
                if not work.done():
                    log.warning("eval: version %d interrupted by shutdown; it is not recorded", job.version)
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    break
                try:
                    self.outcomes.append(work.result())
                except Exception as e:  # an eval that breaks must not stop training
                    log.exception("eval: version %d broke", job.version)
                    self.outcomes.append(EvalOutcome(job.version, ok=False, error=f"{type(e).__name__}: {e}"))
            finally:
                self.current = None
                self.unfinished -= 1
                self._changed.set()

    async def drain(self, timeout_s: float, halt: asyncio.Event) -> None:
        """At the end of training: wait for the queued evals (progress every 30 s) unless halted."""
        t0 = time.monotonic()
        while not halt.is_set() and time.monotonic() - t0 < timeout_s:
            self._changed.clear()  # before the check: a finish after it wakes the wait below
            if not self.busy:
                break
            log.info(
                "eval: waiting for version %s (%d more queued), %.0fs so far",
                self.current,
                self.queue.qsize(),
                time.monotonic() - t0,
            )
            waits = [asyncio.ensure_future(halt.wait()), asyncio.ensure_future(self._changed.wait())]
            await asyncio.wait(waits, timeout=30.0, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        if self.busy:
            log.warning("eval: stopping with version %s unfinished and %d queued", self.current, self.queue.qsize())

    def _following_child(self) -> FollowingChild:
        if self.child is None:
            env = dict(os.environ)
            if os.environ.get(EVAL_USER_ENV):
                env["PARLEY_NATS_USER"] = os.environ[EVAL_USER_ENV]
                env["PARLEY_NATS_PASSWORD"] = os.environ.get(EVAL_PASSWORD_ENV, "")
            env.setdefault("PYTHONUNBUFFERED", "1")
            self.child = FollowingChild(eval_argv(self.cfg, self.config_path, self.root), env, self.root / "follow.log")
        return self.child

    async def start(self) -> None:
        """Start the eval child now, before any version is queued: it opens its policy engine while the
        learner builds its model, so version 0's result does not wait for an engine start after the
        learner's first step (docs/benchmark.md, "Periodic eval and early stop"). Nothing with a
        launcher of the caller's (a test double). A child that does not start is reported and tried
        again at the first version, as without this."""
        if not self.own_child:
            return
        try:
            await self._following_child().start()
        except OSError as e:
            log.error("eval: its child did not start (%s); the first version tries again", e)

    async def close(self) -> None:
        """End the eval child where `run` never ran or has ended (idempotent); an export still running
        behind training is cut (its version stays owed: owed_marker)."""
        if self._behind is not None and not self._behind.done():
            self._behind.cancel()
            await asyncio.gather(self._behind, return_exceptions=True)
        if self.child is not None:
            await self.child.close()

    async def _launch_child(self, job: EvalJob, out: Path) -> int:
        log.info("eval: version %d (log %s)", job.version, out / "eval.log")
        return await self._following_child().run(job, out)

    async def evaluate(self, job: EvalJob) -> EvalOutcome:
        """Play one version into a partial directory, then move it into place as eval/v<N>."""
        final = version_dir(self.run_dir, job.version)
        partial = self.root / f".v{job.version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        t0 = time.perf_counter()
        code = await self.launch(job, partial)
        seconds = time.perf_counter() - t0
        unscored = [m.describe() for m in read_unscored(partial)]
        if code != 0 or not (partial / "records.parquet").is_file():
            failed = failed_dir(self.run_dir, job.version)
            if code == 3:  # `parley eval` ran to the end, but scored nothing: say why, per conversation
                error = f"no conversation scored ({len(unscored)} not): " + "; ".join(unscored)
            else:
                error = f"parley eval exited {code}"
            error += f"; its log: {failed / 'eval.log'}"
            shutil.rmtree(failed, ignore_errors=True)
            partial.rename(failed)
            log.error("eval: version %d failed after %.0fs: %s", job.version, seconds, error)
            return EvalOutcome(job.version, ok=False, seconds=seconds, error=error, unscored=unscored)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for line in unscored:
            log.warning("eval: version %d: not scored: %s", job.version, line)
        outcome = self.record(job, seconds)
        outcome.unscored = unscored
        return outcome

    def record(self, job: EvalJob, seconds: float) -> EvalOutcome:
        """Read a finished eval back: log its means, keep the best model, check for a regression."""
        from parley.evaluation.selection import SelectionError, load_versions, regression, select_best

        history = load_versions(self.run_dir, self.env)  # oldest first
        mine = next((v for v in history if v.version == job.version), None)
        if mine is None:
            log.error("eval: version %d wrote no scored conversation", job.version)
            return EvalOutcome(job.version, ok=False, seconds=seconds, error="no scored conversations")
        means = {m: mine.mean(m) for m in self.env.eval.columns}  # every column of the table
        log.info(
            "eval: version %d (step %d) on %d held-out items in %.0fs: %s",
            job.version,
            job.step,
            len(mine.items),
            seconds,
            ", ".join(f"{m} {v:.4f}" for m, v in means.items()),
        )
        with (self.root / "history.jsonl").open("a") as f:
            f.write(
                json.dumps(
                    {
                        "version": job.version,
                        "step": job.step,
                        "n": len(mine.items),
                        "seconds": round(seconds, 1),
                        **means,
                        "env": self.env_record,
                        "created": time.time(),
                    }
                )
                + "\n"
            )
        try:
            best = select_best(self.run_dir, self.metric, history, self.env)
            log.info("eval: %s", best.describe())
            self._keep_only_model(best.version)
        except SelectionError as e:
            log.warning("eval: no selection yet: %s", e)
        found = regression(history, self.metric, self.lc.early_stop_alpha, self.env) if self.lc.early_stop else None
        if found is not None:
            self.regression = found.describe(self.metric, self.lc.early_stop_alpha)
            log.warning("eval: early stop: %s", self.regression)
            (self.root / "early_stop.json").write_text(
                json.dumps(
                    {
                        "version": job.version,
                        "step": job.step,
                        "metric": self.metric,
                        "alpha": self.lc.early_stop_alpha,
                        "reason": self.regression,
                    },
                    indent=1,
                )
                + "\n"
            )
        return EvalOutcome(job.version, ok=True, means=means, n=len(mine.items), seconds=seconds)

    def _keep_only_model(self, best: int) -> None:
        """Evaluated versions' exported models are deleted except the best one's; versions still waiting
        for their eval keep theirs until it is done."""
        for version, d in exported_models(self.run_dir).items():
            if version != best and evaluated(self.run_dir, version):
                shutil.rmtree(d, ignore_errors=True)
