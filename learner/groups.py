"""Assembling GRPO groups from Scored messages: one group per task, trainable when all n samples
are in, dropped after a timeout or when too stale (or kept with an importance-sampling correction),
skipped when every sample has the same reward. Pure bookkeeping; learner.intake feeds it from the
SCORED consumer and takes batches from it. See docs/learner.md for how this state is checkpointed.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from parley.errors import BadMessage
from parley.protocol import arrays
from parley.protocol.messages import ABANDONED_STALE, GREEDY_BELOW, Scored, Trajectory

log = logging.getLogger(__name__)

# Rewards closer than this inside a group give no GRPO signal: such a group is skipped, not trained.
ZERO_SPREAD = 1e-6


class BadTrajectory(BadMessage):
    """A trajectory the learner can never train on; the consumer dead-letters it with this reason."""


def check_trajectory(traj: Trajectory) -> None:
    """Raise BadTrajectory naming the first inconsistency of the token layout. Array operations
    only: the per-token work is numpy's, whatever the conversation's length."""
    try:
        n = arrays.token_ids(traj).size
        mask = arrays.loss_mask(traj)
        generated = [arrays.generated(turn) for turn in traj.turns]
        for turn in traj.turns:
            arrays.turn_logprobs(turn)  # a packed field of a bad length fails here
    except ValueError as e:
        raise BadTrajectory(str(e) if str(e).startswith(traj.traj_id) else f"{traj.traj_id}: {e}") from None
    if n == 0:
        raise BadTrajectory(f"{traj.traj_id}: no token ids")
    if mask.size != n:
        raise BadTrajectory(f"{traj.traj_id}: loss_mask has {mask.size} entries for {n} tokens")
    if (mask > 1).any():
        raise BadTrajectory(f"{traj.traj_id}: loss_mask must hold only 0 and 1")
    if mask[0]:
        raise BadTrajectory(f"{traj.traj_id}: token 0 is marked trained, but nothing predicts it")
    covered = np.zeros(n, dtype=bool)
    for i, (turn, k) in enumerate(zip(traj.turns, generated)):
        end = turn.start + k
        if turn.start < 1 or end > n:
            raise BadTrajectory(f"{traj.traj_id}: turn {i} spans [{turn.start}, {end}) outside 1..{n}")
        covered[turn.start : end] = True
    uncovered = np.flatnonzero(mask.astype(bool) & ~covered)
    if uncovered.size:
        raise BadTrajectory(f"{traj.traj_id}: token {uncovered[0]} is trained but no turn has its behaviour log-prob")
    if not mask.any():
        raise BadTrajectory(f"{traj.traj_id}: no trained token (loss_mask is all 0)")


# A sampled token's log-prob is <= 0; vLLM's are computed in float32, so allow rounding above 0.
LOGPROB_SLACK = 1e-3


def check_hostile_values(
    scored: Scored, vocab_size: int, max_positions: int | None = None, *, reference: bool = False
) -> None:
    """Raise BadTrajectory for values that decode but that no honest actor or scorer sends: a
    non-finite or out-of-range reward (rewards.reward.hostile_reward), sampling settings the learner
    cannot recompute the log-probs of (a temperature below vLLM's greedy threshold or not finite,
    top_p < 1, a temperature other than 1 against the raw reference service), a non-finite or positive behaviour log-prob, a token id outside the policy's vocabulary (on a GPU an out-of-range id is a
    device-side assert that kills the learner, then a crash loop on the redelivered message), a
    conversation longer than the policy's positions (`max_positions`; one such sequence fills a
    micro-batch of its own whatever the budget, and its activations the memory); with `reference`
    ([policy] reference = "service") missing reference log-probs, or ones of the wrong length, not
    finite or positive (check_reference).
    Kept apart from check_trajectory, which checks the token layout. Reads the packed fields
    (protocol.arrays) as arrays."""
    from parley.rewards.reward import hostile_reward

    traj = scored.trajectory
    ids = arrays.token_ids(traj)
    if max_positions is not None and ids.size > max_positions:
        raise BadTrajectory(f"{traj.traj_id}: {ids.size} tokens, more than the policy's {max_positions} positions")
    why = hostile_reward(scored.metrics, scored.weights, scored.total)
    if why:
        raise BadTrajectory(f"{scored.traj_id}: {why}")
    # The settings that shape the behaviour log-probs, as the learner recomputes them: softmax(logits / T)
    # with nothing cut away. NaN fails the comparisons too.
    if not (GREEDY_BELOW <= traj.temperature < math.inf):
        raise BadTrajectory(
            f"{traj.traj_id}: temperature {traj.temperature} is not a finite number >= {GREEDY_BELOW:g} "
            "(below it vLLM samples greedily and reports untempered log-probs); the learner trains on "
            "log-probs of softmax(logits / temperature)"
        )
    if traj.top_p != 1.0:
        raise BadTrajectory(
            f"{traj.traj_id}: top_p {traj.top_p}: its log-probs are renormalized over the top-p "
            "nucleus, which the learner does not recompute; actors that train sample with top_p = 1.0"
        )
    if reference and traj.temperature != 1.0:
        raise BadTrajectory(
            f'{traj.traj_id}: temperature {traj.temperature} with [policy] reference = "service": '
            "the service's reference log-probs are of the raw model, a KL to this tempered policy "
            "would mix the two; sample at temperature 1.0 or use the learner's own reference"
        )
    for i, turn in enumerate(traj.turns):
        lp = arrays.turn_logprobs(turn)
        bad = ~(np.isfinite(lp) & (lp <= LOGPROB_SLACK))
        if bad.any():
            j = int(np.argmax(bad))
            raise BadTrajectory(
                f"{traj.traj_id}: turn {i} log-prob {j} is {float(lp[j])}; behaviour log-probs are finite and <= 0"
            )
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        bad_id = int(ids[int(np.argmax(outside))])
        raise BadTrajectory(f"{traj.traj_id}: token id {bad_id} is outside the policy's vocabulary 0..{vocab_size - 1}")
    if reference:
        check_reference(scored, ids.size)


def check_reference(scored: Scored, n_tokens: int) -> None:
    """Raise BadTrajectory unless the Scored carries one finite, non-positive reference log-prob per
    token (Scored.ref_logp_f32), as the learner needs under [policy] reference = "service"."""
    try:
        ref = arrays.ref_logprobs(scored)
    except ValueError as e:
        raise BadTrajectory(f"{scored.traj_id}: {e}") from None
    if ref.size == 0:
        raise BadTrajectory(
            f"{scored.traj_id}: no reference log-probs (ref_logp_f32) while policy.reference="
            "'service'; the scorer fills them in from `parley reference` when it reads the same "
            "[policy] reference setting"
        )
    if ref.size != n_tokens:
        raise BadTrajectory(f"{scored.traj_id}: {ref.size} reference log-probs for {n_tokens} tokens (one per token)")
    bad = ~(np.isfinite(ref) & (ref <= LOGPROB_SLACK))
    if bad.any():
        j = int(np.argmax(bad))
        raise BadTrajectory(
            f"{scored.traj_id}: reference log-prob {j} is {float(ref[j])}; reference log-probs are finite and <= 0"
        )


def behaviour_logprobs(traj: Trajectory) -> np.ndarray:
    """(T,) float32 behaviour log-probs aligned with the token ids (0.0 where no turn generated the token)."""
    out = np.zeros(arrays.token_ids(traj).size, dtype=np.float32)
    for turn in traj.turns:
        lp = arrays.turn_logprobs(turn)
        out[turn.start : turn.start + lp.size] = lp
    return out


def behaviour_version(traj: Trajectory) -> int:
    """The oldest policy version that generated a trained turn (the one staleness is measured by)."""
    trained = [t.version for t in traj.turns if t.trained] or [t.version for t in traj.turns]
    return min(trained) if trained else 0


@dataclass
class Group:
    """The samples of one task seen so far."""

    task_id: str
    # time.monotonic() of the first sample (the timeout counts from here): a wall clock that jumps
    # would time groups out early or never; the ledger keeps it as wall-clock time (learner.intake)
    first_seen: float
    samples: dict[int, Scored] = field(default_factory=dict)
    completed: float = 0.0  # time.monotonic() the last sample arrived; FIFO order of complete groups

    def min_version(self) -> int:
        return min(behaviour_version(s.trajectory) for s in self.samples.values())

    def abandoned(self) -> Scored | None:
        """A sample its actor stopped because the group could no longer be trained
        (protocol.messages.ABANDONED_STALE): the group is then never trained, whatever the versions."""
        return next((s for _, s in sorted(self.samples.items()) if s.trajectory.terminated == ABANDONED_STALE), None)

    def rewards(self) -> list[float]:
        return [self.samples[i].total for i in sorted(self.samples)]

    def ordered(self) -> list[Scored]:
        return [self.samples[i] for i in sorted(self.samples)]


@dataclass
class Taken:
    """A group chosen for a step, with how it is trained."""

    group: Group
    correct: bool  # stale beyond max_staleness and kept under stale_policy="correct"
    staleness: int


@dataclass
class Outcome:
    """A group that left the buffer without being trained, and why."""

    task_id: str
    kind: str  # "timeout" | "stale" | "zero_advantage" | "dead" | "deadline" | "nonfinite" | "step_failed"
    reason: str
    samples: list[str]  # traj_ids
    group: Group | None = None  # what was buffered of it, for the archive


class Finished(dict):
    """task_id -> kind ("trained" or an Outcome kind) of every finished task, where the feeder's
    tasks `prefix` + index of index < `below` (the watermark) are finished without an entry: the
    ledger holds the watermark and the exceptions above it, so a write costs the open work, not
    the run's history (the kinds of the tasks under the watermark that were not trained are in the
    reasons log, learner.checkpoint.Ledger)."""

    def __init__(self, prefix: str = "", below: int = 0, entries: dict[str, str] | None = None):
        super().__init__(entries or {})
        self.prefix, self.below = prefix, below

    def index(self, task_id: str) -> int | None:
        tail = task_id[len(self.prefix) :]
        if not (self.prefix and task_id.startswith(self.prefix) and tail.isdigit()):
            return None
        return int(tail) if tail == f"{int(tail):06d}" else None  # learner.feeder.task_id's spelling only

    def __contains__(self, task_id) -> bool:
        if dict.__contains__(self, task_id):
            return True
        i = self.index(task_id) if isinstance(task_id, str) else None
        return i is not None and i < self.below

    def advance(self, hold: set[str]) -> None:
        """Move the watermark over every consecutive finished task, forgetting their entries;
        never over one of `hold` (trained after the last checkpoint: not finished for the ledger)."""
        while True:
            t = f"{self.prefix}{self.below:06d}"
            if not self.prefix or t in hold or not dict.__contains__(self, t):
                return
            del self[t]
            self.below += 1


class Grouper:
    """Buffers Scored by task_id until groups of `n` are complete; idempotent per traj_id.

    `done` remembers every task that was trained, dropped or skipped, so a redelivered or late
    sample of it is ignored rather than starting a new group.
    """

    def __init__(self, n: int, *, max_staleness: int, stale_policy: str, timeout_s: float, order: str = "oldest"):
        if n < 1:
            raise ValueError(f"group size n={n} must be >= 1")
        if stale_policy not in ("drop", "correct"):
            raise ValueError(f"stale_policy={stale_policy!r} not allowed; use drop or correct")
        if order not in ("oldest", "freshest"):
            raise ValueError(f"group_order={order!r} not allowed; use oldest or freshest")
        self.n = n
        self.order = order  # which trainable groups a step takes first ([learner] group_order)
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.timeout_s = timeout_s
        self.buffer: dict[str, Group] = {}
        self.done: Finished = Finished()  # task_id -> "trained" or an Outcome kind (learner.service sets its prefix)
        self.counters: Counter[str] = Counter()

    # -- intake ---------------------------------------------------------------------------------

    def add(self, scored: Scored, now: float | None = None) -> str:
        """Buffer one sample: returns "added", "complete" (it completed its group), "duplicate"
        (this traj_id is already buffered) or "late" (its task is already done)."""
        if not 0 <= scored.sample < self.n:
            raise BadTrajectory(
                f"{scored.traj_id}: sample index {scored.sample} outside 0..{self.n - 1} (group size n={self.n})"
            )
        if scored.task_id in self.done:
            self.counters["late"] += 1
            return "late"
        now = time.monotonic() if now is None else now
        group = self.buffer.setdefault(scored.task_id, Group(scored.task_id, first_seen=now))
        if scored.sample in group.samples:
            self.counters["duplicate"] += 1
            return "duplicate"
        group.samples[scored.sample] = scored
        if len(group.samples) == self.n:
            group.completed = now
            return "complete"
        return "added"

    def restore(self, group: Group) -> None:
        self.buffer[group.task_id] = group

    # -- leaving the buffer ---------------------------------------------------------------------

    def ready(self) -> list[Group]:
        """Complete groups, oldest completion first."""
        return sorted(
            (g for g in self.buffer.values() if len(g.samples) == self.n), key=lambda g: (g.completed, g.task_id)
        )

    def expire(self, now: float | None = None) -> list[Outcome]:
        """Drop partial groups older than timeout_s (by time.monotonic()), each with a logged reason."""
        now = time.monotonic() if now is None else now
        out = []
        for g in list(self.buffer.values()):
            age = now - g.first_seen
            if len(g.samples) < self.n and age > self.timeout_s:
                reason = (
                    f"timeout: {len(g.samples)}/{self.n} samples after {age:.0f}s "
                    f"(group_timeout_s={self.timeout_s:g}); missing samples {sorted(set(range(self.n)) - set(g.samples))}"
                )
                out.append(self._finish(g, "timeout", reason))
        return out

    def abandon(self, task_id: str, kind: str, reason: str, sample: int | None = None) -> Outcome | None:
        """Give up a task that can no longer become a complete group: all of it (sample=None: its
        Task is dead), or because `sample` will never arrive. None when there is nothing to give up:
        the task is already finished, its group is complete (trainable as it is), or the lost
        sample is in fact buffered (an earlier delivery of it got through)."""
        if task_id in self.done:
            return None
        g = self.buffer.get(task_id)
        if g is not None and (len(g.samples) == self.n or sample in g.samples):
            return None
        if g is None:
            g = self.buffer[task_id] = Group(task_id, first_seen=time.monotonic())
        return self._finish(g, kind, reason)

    def take(self, k: int, learner_version: int) -> tuple[list[Taken], list[Outcome]]:
        """Choose k trainable groups for a step at `learner_version`.

        Oldest complete groups first (order "oldest"), or those of the newest behaviour version first
        (order "freshest", the oldest completion first among equals). A group whose oldest behaviour
        version lags more than max_staleness is dropped (stale_policy="drop") or taken with
        correct=True; a group whose rewards are all equal is skipped (it has no GRPO signal). Dropped
        and skipped groups are final either way; if fewer than k trainable groups exist, none is
        taken and ([], outcomes) is returned. Under "freshest" every complete group is looked at, so
        an older one passed over now is dropped or skipped as soon as it lags too far or has no signal,
        not left holding its admission slot. Partial groups that are already `doomed`, and groups
        with a sample its actor abandoned (Group.abandoned), are dropped as stale too, whatever the order.
        """
        outcomes: list[Outcome] = []
        chosen: list[Taken] = []
        ready = []
        for g in self.ready():  # a complete group with an abandoned sample goes at once, whatever the order
            if g.abandoned() is not None:
                outcomes.append(self._finish(g, "stale", self._abandoned_reason(g)))
            else:
                ready.append(g)
        if self.order == "freshest":
            ready.sort(key=lambda g: -g.min_version())  # stable: oldest completion first among equals
        for g in ready:
            if len(chosen) == k and self.order == "oldest":
                break
            rewards = g.rewards()
            if max(rewards) - min(rewards) <= ZERO_SPREAD:
                outcomes.append(
                    self._finish(g, "zero_advantage", f"zero advantage: every sample has reward {rewards[0]:.4g}")
                )
                continue
            behaviour = g.min_version()
            lag = learner_version - behaviour  # versions the policy moved since the oldest trained turn
            if lag > self.max_staleness and self.stale_policy == "drop":
                reason = (
                    f"stale: behaviour version {behaviour}, learner version {learner_version}, "
                    f"lag {lag} > max_staleness {self.max_staleness}"
                )
                outcomes.append(self._finish(g, "stale", reason))
                continue
            if len(chosen) < k:
                chosen.append(Taken(g, correct=lag > self.max_staleness, staleness=lag))
        outcomes += self._drop_doomed(learner_version)
        if len(chosen) < k:
            return [], outcomes
        for t in chosen:
            del self.buffer[t.group.task_id]
            self.done[t.group.task_id] = "trained"
            self.counters["trained"] += 1
            if t.correct:
                self.counters["corrected"] += 1
        return chosen, outcomes

    def doomed(self, task_id: str, learner_version: int) -> bool:
        """Whether the buffered, partial group of `task_id` can no longer be trained
        (stale_policy="drop"): a group's staleness is its oldest sample's behaviour version, which
        later samples can only lower, and the learner's version only rises, so one sample in that
        lags more than max_staleness dooms the whole group."""
        g = self.buffer.get(task_id)
        if g is None or not 0 < len(g.samples) < self.n:
            return False
        return g.abandoned() is not None or (
            self.stale_policy == "drop" and learner_version - g.min_version() > self.max_staleness
        )

    def _drop_doomed(self, learner_version: int) -> list[Outcome]:
        """The doomed partial groups, dropped as stale now, freeing their admission slots, instead of
        holding them until their last samples come back to be dropped (an oversampled extra at
        max_staleness 0 held its slot a whole play); their later samples are then `late`, ignored."""
        out = []
        for g in [g for g in self.buffer.values() if self.doomed(g.task_id, learner_version)]:
            if g.abandoned() is not None:
                out.append(self._finish(g, "stale", self._abandoned_reason(g)))
                continue
            behaviour = g.min_version()
            out.append(
                self._finish(
                    g,
                    "stale",
                    (
                        f"stale before complete ({len(g.samples)}/{self.n} samples in): behaviour version {behaviour}, "
                        f"learner version {learner_version}, lag {learner_version - behaviour} > max_staleness {self.max_staleness}"
                    ),
                )
            )
        return out

    def _abandoned_reason(self, g: Group) -> str:
        s = g.abandoned()
        versions = sorted({t.version for t in s.trajectory.turns})
        return (
            f"stale: sample {s.sample} was stopped by actor {s.trajectory.actor or '?'} after "
            f"{len(s.trajectory.turns)} turn(s) (versions {versions}) because the group could no longer be "
            f"trained; {len(g.samples)}/{self.n} samples in"
        )

    def untake(self, taken: list[Taken]) -> None:
        """Put groups of a step that failed back, as if they had never been taken."""
        for t in taken:
            self.buffer[t.group.task_id] = t.group
            self.done.pop(t.group.task_id, None)
            self.counters["trained"] -= 1
            if t.correct:
                self.counters["corrected"] -= 1

    def reject(self, taken: list[Taken], reason: str, kind: str = "nonfinite") -> list[Outcome]:
        """Groups of a step the trainer refused to apply (kind "nonfinite": non-finite loss or gradient)
        or that failed max_step_attempts times (kind "step_failed"): final, never trained, like a
        dropped group."""
        out = []
        for t in taken:
            self.done[t.group.task_id] = kind
            self.counters["trained"] -= 1
            if t.correct:
                self.counters["corrected"] -= 1
            self.counters[kind] += 1
            log.error("group %s %s", t.group.task_id, reason)
            out.append(Outcome(t.group.task_id, kind, reason, [s.traj_id for s in t.group.ordered()], group=t.group))
        return out

    def _finish(self, g: Group, kind: str, reason: str) -> Outcome:
        del self.buffer[g.task_id]
        self.done[g.task_id] = kind
        self.counters[kind] += 1
        log.warning("group %s %s", g.task_id, reason)
        return Outcome(g.task_id, kind, reason, [s.traj_id for s in g.ordered()], group=g)
