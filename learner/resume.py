"""How the learner starts on its run directory: a fresh start records the base model and the
environment (and refuses a directory that holds a learner state); a resume restores the trainer's
checkpoint, the run state, the buffered groups and the feeder from the ledger, and cuts the step
logs back to the checkpointed step. Called by learner.service while it builds the parts.
"""

from __future__ import annotations

import logging
import time

from parley.errors import StateError
from parley.learner import checkpoint as ckpt
from parley.learner import envrecord
from parley.learner.feeder import FeederState, Issued
from parley.learner.groups import Finished, Group, Grouper, Outcome
from parley.learner.runstate import RunState
from parley.learner.steplog import StepLog

log = logging.getLogger(__name__)


class LearnerStateError(StateError):
    """The run directory's learner state does not fit the command (fresh start over an old run)."""


def fresh(run_dir, model_dir, env_record) -> FeederState:
    if ckpt.has_state(run_dir):
        raise LearnerStateError(
            f"{ckpt.learner_dir(run_dir)} holds a learner state; pass --resume to "
            "continue it, or use another run name / run.dir for a fresh run"
        )
    ckpt.record_base_model(run_dir, model_dir)
    envrecord.write(run_dir, env_record)
    return FeederState()


def restore(
    run_dir, model_dir, env_record, *, ledger: ckpt.Ledger, driver, state: RunState, grouper: Grouper, steplog: StepLog
) -> FeederState:
    """Fill `state` and `grouper` from the ledger and load its checkpoint into the trainer (`driver`);
    the feeder's state to build it with."""
    saved = ledger.open()  # the buffered samples come back from the sample log
    if saved is None:
        log.warning("--resume: no learner state in %s; starting fresh", ckpt.learner_dir(run_dir))
        return fresh(run_dir, model_dir, env_record)
    changed = envrecord.differs(run_dir, env_record)
    if changed:
        raise LearnerStateError(f"--resume: {changed}")
    if saved.tag:
        driver.load_checkpoint(ckpt.ckpt_dir(run_dir), saved.tag)
    state.step = state.ckpt_step = saved.step
    state.tag = saved.tag
    grouper.done = Finished(grouper.done.prefix, saved.done_below, saved.done)
    if not saved.reasons_bytes:  # a ledger from before the reasons log: its reasons go there with the next write
        state.reasons = dict(saved.reasons)
    state.dead_seq = saved.dead_seq
    state.attempts.update(saved.attempts)
    state.step_error = saved.step_error
    grouper.counters.update(saved.counters)
    # Timeouts and deadlines count only while a learner runs: each buffered group's first sample and
    # each issue time come back at the age they had when the ledger was written (ages against its
    # `saved`, one wall-clock reading, so no wall-clock jump counts), on this process's monotonic
    # clock; the samples actors produced meanwhile (waiting in SCORED) are read before any group is
    # timed out or any task given up.
    now = time.monotonic()

    def since(t: float) -> float:  # a ledger's wall-clock time as the monotonic time of its age
        return now - max(0.0, saved.saved - t)

    for g in saved.groups:
        completed = since(g.completed) if g.completed else 0.0
        grouper.restore(Group(g.task_id, since(g.first_seen), {s.sample: s for s in g.samples}, completed))
    steplog.truncate(saved.step)
    state.archive_seq = saved.archive_seq
    ckpt.truncate_archive(run_dir, saved.step, saved.archive_seq)
    # Groups the ledger records as finished untrained whose step line was cut above (after the
    # checkpoint, checkpoint_every > 1) or never written (finished after the last step): the next
    # step's line reports them, so trained.jsonl keeps every outcome across the resume.
    reported = steplog.reported()
    state.since_step = [
        Outcome(t, saved.done.get(t, "dropped"), reason, []) for t, reason in saved.reasons.items() if t not in reported
    ]
    log.info(
        "resumed at step %d (checkpoint %s): %d buffered groups, %d finished tasks, feeder at task %d",
        saved.step,
        saved.tag or "initial weights",
        len(saved.groups),
        len(saved.done),
        saved.next_index,
    )
    # A ledger from before issue records were kept counts each in-flight task's deadline from now.
    issued = {i.task_id: Issued(at=since(i.at), version=i.version) for i in saved.issued}
    in_flight = {t: issued.get(t) or Issued(at=now, version=saved.step) for t in saved.in_flight}
    return FeederState(next_index=saved.next_index, in_flight=in_flight, consumed=saved.consumed)
