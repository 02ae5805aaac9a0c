"""`RunState`: the learner's state that more than one of its parts reads or writes (the step count,
what the last checkpoint vouches for, the fates of tasks since the last step, the counters).
learner.service builds one and hands it to the intake, the stepper and the watchers explicitly;
learner.resume fills it from the ledger, and the intake's ledger write records it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from parley.learner.feeder import Issued
from parley.learner.groups import Group, Outcome


@dataclass
class RunState:
    steps: int  # the step budget; 0 trains forever
    step: int = 0  # optimizer steps done = the policy version the trainer holds
    ckpt_step: int = 0  # what the last ledger write can vouch for: the checkpointed step and its tag
    tag: str = ""
    uncommitted: list[tuple[Group, Issued | None]] = field(default_factory=list)  # trained after the last checkpoint
    since_step: list[Outcome] = field(default_factory=list)  # groups dropped/skipped since the last step
    # task_id -> why it was not trained, since the last ledger write (which appends them to its reasons log)
    reasons: dict[str, str] = field(default_factory=dict)
    dead_seq: int = 1  # next DEAD stream sequence to read
    counters: Counter[str] = field(default_factory=Counter)
    in_step: list[Group] = field(default_factory=list)  # the groups of the step being trained (still buffered)
    attempts: Counter[str] = field(default_factory=Counter)  # task_id -> steps begun over its group, unfinished
    step_error: str = ""  # the last failed step's error
    archive_seq: int = 0  # the next archive/dropped-NNNNNNNN.parquet
    phase: str = "starting"  # what the heartbeat says the learner is doing

    def last(self) -> bool:
        """The step budget is spent (never with steps = 0)."""
        return bool(self.steps) and self.step >= self.steps
