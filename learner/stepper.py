"""The learner's step: take `groups_per_step` trainable groups, train on them, then publish, checkpoint,
queue the periodic eval, write the step logs and the archive, then the ledger, prune; a step the trainer
refused (not finite) dead-letters its samples instead. Owns the step logs, the reward-signal monitor
and the last step's live counters. Built by learner.service, whose loop calls `try_step`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter

from parley.errors import ConfigError
from parley.learner import checkpoint as ckpt
from parley.learner import envrecord
from parley.learner.feeder import Feeder
from parley.learner.groups import Grouper, Taken
from parley.learner.intake import Intake
from parley.learner.runstate import RunState
from parley.learner.steplog import PHASES, StepLog, behaviour_gap
from parley.learner.watchers import Evals
from parley.protocol import codec, topology
from parley.protocol.bus import dead_letter, retry_unreachable
from parley.runtime import killpoints
from parley.runtime.durable import fsync_tree
from parley.weights.publish import Weights

log = logging.getLogger(__name__)


class Stepper:
    def __init__(
        self,
        state: RunState,
        cfg,
        js,
        driver,
        *,
        grouper: Grouper,
        feeder: Feeder,
        intake: Intake,
        weights: Weights,
        evals: Evals,
        steplog: StepLog,
        env_record,
        consumer: str,
        started: float,
    ):
        from parley.rewards.diagnostics import SignalMonitor

        self.state, self.cfg, self.lc, self.js, self.driver = state, cfg, cfg.learner, js, driver
        self.run_name, self.run_dir = cfg.run.name, cfg.run_dir
        self.grouper, self.feeder, self.intake, self.weights, self.evals = grouper, feeder, intake, weights, evals
        self.steplog, self.env_record = steplog, env_record
        self.consumer = consumer  # who dead-letters a refused step's samples
        self.wait_since = started  # since when the learner waits for a step's groups
        self.monitor = SignalMonitor()
        self.live: dict[str, float] = {}  # last step's reward terms, staleness and timings, for the heartbeat
        self.tokens_total = 0.0  # tokens trained on by this process (a counter for the metrics)
        self.gap_steps = 0  # steps of this process flagged by [learner] behaviour_gap_alarm

    async def try_step(self) -> bool:
        st = self.state
        taken, outcomes = self.grouper.take(self.lc.groups_per_step, st.step)
        st.since_step += self.intake.consume(outcomes)
        if not taken:
            return False
        wait_s = time.monotonic() - self.wait_since
        failed = max(st.attempts[t.group.task_id] for t in taken)
        if failed >= self.lc.max_step_attempts:
            await self.refuse_step(taken, {}, failed=failed)
            return True
        st.phase = "busy"
        # The attempt is durable before the step may kill the process (an OOM, a CUDA fault, the
        # kernel's OOM killer): otherwise every resume would take the same groups first, for ever.
        st.in_step = [t.group for t in taken]
        for t in taken:
            st.attempts[t.group.task_id] += 1
        if not await self.intake.flush():  # the lease is stale (Intake.fence): no step whose attempt is unrecorded
            st.in_step = []
            for t in taken:
                st.attempts[t.group.task_id] -= 1
            self.grouper.untake(taken)
            st.phase = "ready"
            return False
        killpoints.reached("step")
        try:
            trained, stats, refused, refused_stats, untried = await self.train(taken)
        except BaseException as e:
            # The trainer's state after a failure inside its step is not known (gradients of some
            # micro-batches may be accumulated), so the process ends here, and a resume starts from
            # the checkpoint; the groups stay buffered with their attempt counted.
            st.in_step = []
            self.grouper.untake(taken)
            if isinstance(e, Exception):
                st.step_error = f"{'out of memory: ' if out_of_memory(e) else ''}{type(e).__name__}: {e}"[:500]
                await self.intake.flush()
                if out_of_memory(e):
                    log.error(
                        "step %d failed out of memory over %s (attempt %d of %d; at %d its groups are "
                        "rejected and dead-lettered): %s",
                        st.step + 1,
                        [t.group.task_id for t in taken],
                        max(st.attempts[t.group.task_id] for t in taken),
                        self.lc.max_step_attempts,
                        self.lc.max_step_attempts,
                        e,
                    )
            raise
        st.in_step, st.step_error = [], ""
        for t in taken:
            st.attempts.pop(t.group.task_id, None)
        if refused:  # an update the trainer did not apply: its groups refused, the later ones untried
            self.grouper.untake(untried)
            await self.refuse_step(refused, refused_stats)
        taken = trained
        if not taken:
            await self.intake.flush()  # the attempts taken back (a kill now is no failed step)
            return True
        admitted_at = st.step  # the version the groups were trained against
        st.step += 1
        admission_lag: Counter[str] = Counter()
        for t in taken:
            issued = self.feeder.mark_consumed(t.group.task_id)
            st.uncommitted.append((t.group, issued))
            if issued is not None:
                admission_lag[str(admitted_at - issued.version)] += 1
        # The training is over: a ledger write takes the attempt back before the publication and the
        # checkpoint, so a kill from here on (a node loss, an operator's SIGKILL during the checkpoint)
        # is no failed step; the groups are still buffered for that ledger (state.uncommitted) until
        # the checkpoint write vouches for them. Only a death inside train() keeps its attempt counted.
        await self.intake.flush()
        # The feeder's version moves in publish(), once the actors have been told of the new weights.
        stats["wait_s"] = wait_s
        stats["admission_lag_hist"] = dict(admission_lag)
        stats["ended_at"] = time.time()  # wall clock at the step's end: the start of "step end -> serving"

        last = st.last()
        eval_due = self.evals.due(st.step, last=last)
        eval_write = None  # a GPU payload's copy for the eval: written and exported behind the next step
        if st.step % self.lc.publish_every == 0 or last:
            t0 = time.perf_counter()
            if eval_due:
                eval_write = await self.weights.eval_copy(st.step)
            published = await self.weights.publish(st.step, write_now=eval_due and eval_write is None)
            stats["publish_s"] = (
                time.perf_counter() - t0
            )  # on the step's path: the CPU copy (the file for an eval: a file payload's; a GPU payload's goes behind)
            stats["publish_skipped_held"] = 0.0 if published else 1.0
            killpoints.reached("published")
        if st.step % self.lc.checkpoint_every == 0 or last:
            t0 = time.perf_counter()
            tag = ckpt.step_tag(st.step)
            await asyncio.to_thread(self.driver.save_checkpoint, ckpt.ckpt_dir(self.run_dir), tag)
            envrecord.write(ckpt.ckpt_dir(self.run_dir) / tag, self.env_record)
            killpoints.reached("checkpoint_write")
            # durable before a ledger write names it: after a power cut the ledger's tag must hold a model
            await asyncio.to_thread(fsync_tree, ckpt.ckpt_dir(self.run_dir) / tag)
            st.ckpt_step, st.tag = st.step, tag
            st.uncommitted.clear()
            stats["checkpoint_s"] = time.perf_counter() - t0
            killpoints.reached("checkpoint")
        # after the checkpoint: an unpublished version is exported from it
        if eval_due:
            t0 = time.perf_counter()
            await self.evals.submit(st.step, eval_write)
            stats["eval_export_s"] = time.perf_counter() - t0
        # The step's lines go out before the ledger that vouches for them: a resume drops lines
        # beyond the ledger's step, never misses one.
        metrics = self.metrics(taken, stats)
        self.steplog.write(st.step, metrics, self.trained_entry(taken))
        self.steplog.log_evals(self.evals.finished())
        self.tokens_total += float(stats.get("tokens", 0.0))
        self.live = live_counters(metrics) | {"train.tokens_total": self.tokens_total}
        st.since_step = []
        # The archive before the ledger, as the checkpoint and the step lines: whatever the ledger
        # names is durable; what a kill leaves beyond the ledger's step a resume removes and redoes.
        trained = [s for t in taken for s in t.group.ordered()]
        await asyncio.to_thread(ckpt.write_archive, self.run_dir, st.step, trained)
        killpoints.reached("archive")
        await self.intake.flush()
        killpoints.reached("ledger")
        if st.tag == ckpt.step_tag(st.step):
            ckpt.prune_checkpoints(self.run_dir, self.lc.keep_checkpoints, st.tag)
        log.info(
            "step %d: loss %.4f, %d groups, %d tokens, %.1fs train, %.1fs waiting for data",
            st.step,
            stats.get("loss", float("nan")),
            len(taken),
            int(stats["tokens"]),
            stats["train_s"],
            wait_s,
        )
        self.wait_since = time.monotonic()
        st.phase = "ready"
        self.stop_on_gaps()
        return True

    def stop_on_gaps(self) -> None:
        """After a step that is durable (its lines, archive and ledger): ConfigError (exit code 2, which
        `parley up` does not restart) once [learner] behaviour_gap_stop steps of this process were flagged."""
        limit = self.lc.behaviour_gap_stop
        if limit and self.gap_steps >= limit:
            raise ConfigError(
                f"{self.gap_steps} steps (the last: step {self.state.step}) had behaviour log-probs more than "
                f"{self.lc.behaviour_gap_alarm:g} nats a token from the learner's ([learner] behaviour_gap_alarm): "
                "the actors sample from another model than the one trained; fix the actor engine's settings or "
                f"its weight updates, or set [learner] behaviour_gap_stop = 0 (now {limit}) to train on regardless"
            )

    async def train(self, taken: list[Taken]) -> tuple[list[Taken], dict, list[Taken], dict, list[Taken]]:
        """Train the step's groups in `updates_per_step` optimizer updates, each on a mini-batch of whole
        groups in their order with a loss of its own (verl's ppo_mini_batch_size); advantages are each
        group's, so the split changes none. Stops at an update the trainer did not apply (not finite).
        Returns the groups trained and the step's stats (merged over the updates), then the refused
        mini-batch with its stats and the groups after it, not tried."""
        size = -(-len(taken) // self.lc.updates_per_step)
        minis = [taken[i : i + size] for i in range(0, len(taken), size)]
        trained: list[Taken] = []
        per_update: list[dict] = []
        for i, mini in enumerate(minis):
            stats = await asyncio.to_thread(self.driver.train_step, self.samples(mini))
            if stats.get("skipped"):
                return trained, merge_updates(per_update), mini, stats, [t for later in minis[i + 1 :] for t in later]
            trained += mini
            per_update.append(stats)
        return trained, merge_updates(per_update), [], {}, []

    async def refuse_step(self, taken: list[Taken], stats: dict, failed: int = 0) -> None:
        """The trainer did not apply a step (its loss or gradient norm was not finite), or a step over
        these groups failed `failed` (= max_step_attempts) times: the weights are as before, its groups
        are final (kind "nonfinite" or "step_failed", in the ledger with the next write) and each of
        their samples goes to DEAD with the reason, for an operator to look at."""
        if failed:
            kind = "step_failed"
            reason = (
                f"not trained: a training step over these groups failed {failed} times "
                f"([learner] max_step_attempts); last error: {self.state.step_error or 'none recorded (the learner died inside the training)'}"
            )
            for t in taken:
                self.state.attempts.pop(t.group.task_id, None)
            self.state.step_error = ""
        else:
            kind = "nonfinite"
            reason = (
                f"not trained: the step over these groups had loss {stats.get('loss', float('nan')):.4g} and "
                f"grad norm {stats.get('grad_norm', float('nan')):.4g}; not finite, so it was skipped"
            )
        self.state.since_step += self.intake.consume(self.grouper.reject(taken, reason, kind))
        self.state.counters["steps.skipped" if kind == "nonfinite" else "steps.failed"] += 1
        subject = topology.subject(self.run_name, "scored")
        for t in taken:
            for s in t.group.ordered():
                await retry_unreachable(
                    lambda s=s: dead_letter(
                        self.js,
                        self.run_name,
                        subject=subject,
                        reason=f"{s.traj_id}: {reason}",
                        consumer=self.consumer,
                        payload=codec.encode(s),
                        max_bytes=self.cfg.bus.max_msg_bytes,
                        cause=kind,
                    ),
                    what=f"dead-lettering {s.traj_id}",
                    give_up_s=math.inf,  # as long as NATS is away (docs/reliability.md)
                )
        self.state.phase = "ready"
        self.wait_since = time.monotonic()

    def samples(self, taken: list[Taken]):
        # the compute half builds them (torch), imported here so the control half loads no torch
        from parley.learner.grpo import samples_of

        return samples_of(
            taken, scale=self.lc.scale_advantages, std=self.lc.adv_std, ref=self.cfg.policy.reference == "service"
        )

    # -- reporting ------------------------------------------------------------------------------

    def metrics(self, taken: list[Taken], stats: dict) -> dict:
        from parley.rewards.diagnostics import diagnose_groups

        groups = [t.group.ordered() for t in taken]
        diag = diagnose_groups(groups)
        no_signal = self.monitor.update(diag)
        totals = [s.total for g in groups for s in g]
        hist = Counter(str(t.staleness) for t in taken)
        mean = sum(totals) / len(totals)
        gap = behaviour_gap(stats, self.lc.behaviour_gap_alarm)
        if gap:
            self.gap_steps += 1
            log.warning("step %d: %s", self.state.step, gap)
        return {
            "version": self.state.step,
            **stats,
            **({"behaviour_gap": True} if gap else {}),
            "reward_mean": mean,
            "reward_std": (sum((x - mean) ** 2 for x in totals) / len(totals)) ** 0.5,
            "reward_terms": {
                k: {"mean": v.mean, "within_group_std": v.within_group_std, "corr_with_total": v.corr_with_total}
                for k, v in diag.items()
            },
            "no_signal_terms": no_signal,
            "staleness_hist": dict(hist),
            "groups_corrected": sum(t.correct for t in taken),
            # trained turns generated over a prompt whose KV older weights computed ([actor.engine]
            # prefix_cache_across_versions; 0 without it): the share, and the share of their prompt tokens
            **stale_prefix(groups),
            "groups": dict(self.grouper.counters),
            "buffered_groups": len(self.grouper.buffer),
            "feeder": {
                "in_flight": len(self.feeder.state.in_flight),
                "consumed": self.feeder.state.consumed,
                "next_index": self.feeder.state.next_index,
                "paused": int(self.feeder.paused),
            },
        }

    def trained_entry(self, taken: list[Taken]) -> dict:
        return {
            "version": self.state.step,
            "traj_ids": [s.traj_id for t in taken for s in t.group.ordered()],
            "tasks": [t.group.task_id for t in taken],
            "corrected": [t.group.task_id for t in taken if t.correct],
            "not_trained": {o.task_id: o.reason for o in self.state.since_step},
        }


def stale_prefix(groups) -> dict[str, float]:
    """Of a step's trained turns, the share generated over a stale prefix (AssistantTurn.stale_prefix_tokens
    > 0: KV older weights computed, taken from the prefix cache) and those tokens' share of the turns' prompts."""
    turns = [u for g in groups for s in g for u in s.trajectory.turns if u.trained]
    prompts = sum(u.start for u in turns)
    return {
        "stale_prefix_turn_share": sum(u.stale_prefix_tokens > 0 for u in turns) / len(turns) if turns else 0.0,
        "stale_prefix_token_share": sum(u.stale_prefix_tokens for u in turns) / prompts if prompts else 0.0,
    }


def out_of_memory(e: BaseException) -> bool:
    """A device out-of-memory error: torch.OutOfMemoryError (a RuntimeError; torch.cuda's before
    torch 2.5) or an older torch's RuntimeError saying "out of memory"."""
    return isinstance(e, RuntimeError) and (type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e))


# The step's numbers the heartbeat carries as train.<name> (runtime.metrics names their series).
TRAIN_LIVE = {
    "loss": "loss",
    "kl_mean": "kl",
    "grad_norm": "grad_norm",
    "tokens": "tokens",
    "train_s": "step_s",
    "wait_s": "wait_s",
    "publish_s": "publish_s",
    "checkpoint_s": "checkpoint_s",
    "logp_mismatch": "logp_mismatch",
}


# the trainer's stats (learner.trainer.Trainer.train_step) that add up over a step's updates; of the
# others, *_max take the largest, LAST the last update's, the rest the mean weighted by trained tokens
_SUMMED = ("tokens", "trained_tokens", "sequences", "micro_batches", "train_s", *PHASES)
_LAST = ("lr", "cache_released_gib", "reserved_gib")


def merge_updates(per_update: list[dict]) -> dict:
    """One step's stats from those of its optimizer updates; "updates" counts them."""
    if len(per_update) <= 1:
        return {**(per_update[0] if per_update else {}), "updates": float(len(per_update))}
    out: dict = {}
    weights = [u.get("trained_tokens", 1.0) for u in per_update]
    for key in dict.fromkeys(k for u in per_update for k in u):
        values = [(u[key], w) for u, w in zip(per_update, weights) if key in u]
        if key in _SUMMED:
            out[key] = sum(v for v, _ in values)
        elif key in _LAST:
            out[key] = values[-1][0]
        elif key.endswith("_max") or key == "peak_allocated_gib":
            out[key] = max(v for v, _ in values)
        else:
            out[key] = sum(v * w for v, w in values) / max(sum(w for _, w in values), 1e-12)
    out["tokens_per_s"] = out["tokens"] / out["train_s"] if out.get("train_s") else 0.0
    out["updates"] = float(len(per_update))
    return out


def live_counters(metrics: dict) -> dict[str, float]:
    """What the heartbeat carries of a step: each reward term's mean and within-group std, staleness,
    and the step's loss, KL, tokens and timings (TRAIN_LIVE)."""
    out = {"reward.total": float(metrics.get("reward_mean", 0.0))}
    for key, name in TRAIN_LIVE.items():
        if isinstance(metrics.get(key), (int, float)):
            out[f"train.{name}"] = float(metrics[key])
    for term, st in (metrics.get("reward_terms") or {}).items():
        out[f"reward.{term}"] = float(st["mean"])
        out[f"reward.{term}.group_std"] = float(st["within_group_std"])
    for term in metrics.get("no_signal_terms") or []:
        out[f"reward.{term}.NO_SIGNAL"] = 1.0
    if "logp_mismatch" in metrics:  # 0 or 1 on every step that measured it: a gauge that also falls back
        out["train.behaviour_gap"] = float(bool(metrics.get("behaviour_gap")))
    hist = metrics.get("staleness_hist") or {}
    if hist:
        n = sum(hist.values())
        out["staleness.mean"] = sum(int(k) * v for k, v in hist.items()) / n
        out["staleness.max"] = float(max(int(k) for k in hist))
    return out
