"""`parley trace TRAJ_ID` on a run directory written the way the learner writes one: samples of the
embedded default (its environment, CollabLLM medium, and its [scorer]) scored by rollout.score with
a judge test double, then the learner's own writers (StepLog's trained.jsonl,
checkpoint.write_archive, the Ledger). The step ledger entry has the shape
learner.stepper.Stepper.trained_entry gives it."""

from __future__ import annotations

import asyncio

import msgspec
from typer.testing import CliRunner

from parley.config.run import load_config
from parley.deploy.cli import app
from parley.learner import checkpoint as ckpt
from parley.learner.steplog import StepLog
from parley.protocol.messages import ChatMessage, FutureRollout, JudgeReply
from parley.rollout.score import score_trajectory
from tests.factories import JudgeDouble, trajectory, turn

DOC = (
    "A Week in Lisbon. The trams climb the hills at dawn, and the city wakes slowly around them. "
    "We walked from Alfama to Belem, ate custard tarts, and watched the river turn gold at night."
)
EMBEDDED = load_config()  # the embedded default: char BLEU of the last draft, the rubric by expectation


class JudgeExpectedDouble(JudgeDouble):
    """Test double of the embedded default's judge: `interactivity_expected` answers a level
    distribution (what a local vLLM judge reads from its log-probs), raw JSON as the judge writes it."""

    async def ask(self, op, messages, *, seed=0):
        if op != "interactivity_expected":
            return await super().ask(op, messages, seed=seed)
        self.calls.append((op, len(messages)))
        dist = {k: {"2": 0.5, "3": 0.5} for k in ("understanding", "clarification", "suggestions")}
        raw = '{"understanding": 3, "clarification": 2, "suggestions": 3}'
        return JudgeReply(ok=True, levels={}, distribution=dist, raw=raw, model="smollm2-judge")


def _score(traj):
    reward = EMBEDDED.env.load().reward
    return asyncio.run(score_trajectory(traj, JudgeExpectedDouble(), EMBEDDED.scorer, reward=reward, scorer="scorer-a"))


def _sample(task_id: str, sample: int, versions=(3, 4), fallback: bool = False):
    """A conversation of the embedded default's shape: a system prompt and the dataset's opening (the
    task's), then policy turns (`versions`) and the simulator's answers between them."""
    msgs = [
        ("system", "You are a helpful writing assistant."),
        ("user", "can you help me with a blog post"),
        ("assistant", "Sure - what is it about?"),
        ("user", "lisbon, a week there, the trams"),
        ("assistant", DOC),
    ]
    traj = trajectory(
        task_id=task_id,
        sample=sample,
        messages=msgs,
        token_ids=list(range(40)),
        loss_mask=[0] * 10 + [1] * 5 + [0] * 10 + [1] * 15,
        turns=[turn(10, [-0.5] * 5, version=versions[0]), turn(25, [-0.25] * 15, version=versions[1])],
        prefix_messages=2,
        sim_fallbacks=[3] if fallback else [],
        sim_prompt="lazy_full",
        terminated="sim_done",
        assistant_tokens=20,
        seed=11 + sample,
        futures=[],
    )
    return _score(traj)


def _run_dir(tmp_path):
    """Step 4 trained t-0001 and dropped t-0002 as stale; t-0003 waits in the buffer; t-0004 died."""
    trained = [_sample("t-0001", i) for i in range(2)]
    dropped = [_sample("t-0002", i, versions=(0, 0), fallback=True) for i in range(2)]
    buffered = _sample("t-0003", 0)
    stale = "stale: behaviour version 0 is 4 behind the learner's step 4 (max_staleness 1)"
    log = StepLog(tmp_path, tensorboard=False)
    log.write(
        4,
        {"loss": 0.1},
        {
            "version": 4,
            "traj_ids": [s.traj_id for s in trained],
            "tasks": ["t-0001"],
            "corrected": [],
            "not_trained": {"t-0002": stale},
        },
    )
    ckpt.write_archive(tmp_path, 4, trained)
    ckpt.write_dropped(tmp_path, 0, dropped)
    ledger = ckpt.Ledger(tmp_path)
    ledger.write(
        ckpt.LearnerState(
            step=4,
            done={"t-0001": "trained", "t-0002": "stale", "t-0004": "dead"},
            groups=[ckpt.GroupState(task_id="t-0003", first_seen=1.0, samples=[buffered])],
        ),
        reasons=[("t-0002", "stale", stale), ("t-0004", "dead", "t-0004/0: judge failed 5 times")],
    )
    ledger.close()
    return tmp_path, trained[1]


def _trace(run_dir, traj_id, *extra):
    return CliRunner().invoke(app, ["trace", traj_id, "--run-dir", str(run_dir), "--width", "0", *extra])


def test_trace_prints_a_trained_samples_lineage(tmp_path):
    run_dir, s = _run_dir(tmp_path)
    res = _trace(run_dir, "t-0001/1")
    assert res.exit_code == 0, res.output
    out = res.output
    # the prompt: the task's two messages
    assert "prompt (2 message(s) from the task" in out
    assert "[system] You are a helpful writing assistant." in out
    # each policy turn with its version; each simulator call with its answer
    assert "2 policy version 3: 5 tokens, finish stop" in out
    assert "4 policy version 4: 15 tokens" in out
    assert "3 simulator call 1 (prompt lazy_full; asked with the 2 message(s) before)" in out
    assert "[user] lisbon, a week there, the trams" in out
    assert "simulator call 2: said the user is done" in out
    # every judge call with its request's seed and its answer
    assert "judge calls (model smollm2-judge):" in out
    assert f"interactivity_expected on the conversation (seed {s.trajectory.seed}, 1 attempt(s)): ok" in out
    assert 'answer: {"understanding": 3, "clarification": 2, "suggestions": 3}' in out
    assert f"document: {DOC}" in out
    # the score term by term, summing to the total
    assert f"score: total {s.total:.6g} (scorer scorer-a)" in out
    for name, w in s.weights.items():
        assert f"{name:<16} {s.metrics[name]:.6g} x weight {w:g}" in out
    # the optimizer step that trained it
    assert "TRAINED by optimizer step 4 (against version 3, its update made version 4)" in out
    assert "generated by version(s) [3, 4]; lag -1 version(s)" not in out
    assert "generated by version(s) [3, 4]; lag 0 version(s)" in out


def test_trace_prints_why_a_sample_was_dropped(tmp_path):
    run_dir, _ = _run_dir(tmp_path)
    out = _trace(run_dir, "t-0002/0").output
    assert "FALLBACK" in out  # the simulator's unusable answer is marked
    assert (
        "training: DROPPED, not trained: stale: behaviour version 0 is 4 behind the learner's step 4 (max_staleness 1)"
    ) in out
    buffered = _trace(run_dir, "t-0003/0").output
    assert "training: not yet: waiting in the learner's buffer at step 4" in buffered
    # no sample of t-0004 reached the learner (dead-lettered before scoring): the ledger says why
    dead = _trace(run_dir, "t-0004/0")
    assert dead.exit_code == 0, dead.output
    assert "no sample of it in the run directory" in dead.output
    assert "DROPPED, not trained: dead: t-0004/0: judge failed 5 times" in dead.output


def test_trace_refuses_an_unknown_id_naming_it(tmp_path):
    run_dir, _ = _run_dir(tmp_path)
    res = _trace(run_dir, "t-9999/0")
    assert res.exit_code == 1
    assert "trajectory 't-9999/0' is not in this run directory" in res.output
    assert "e.g. t-0001/0" in res.output


def test_older_samples_without_recorded_prefix_or_seeds_still_trace(tmp_path):
    """A Scored from before prefix_messages and JudgeOutput.seed: the prompt runs to the first
    generated turn, and the seed is said to be unrecorded."""
    s = _sample("t-0001", 0)
    old = msgspec.structs.replace(
        s,
        trajectory=msgspec.structs.replace(s.trajectory, prefix_messages=-1),
        judge=[msgspec.structs.replace(o, seed=-1) for o in s.judge],
    )
    ckpt.write_archive(tmp_path, 1, [old])
    StepLog(tmp_path, tensorboard=False).write(1, {}, {"version": 1, "traj_ids": [old.traj_id], "not_trained": {}})
    out = _trace(tmp_path, "t-0001/0").output
    assert "prompt (2 message(s) from the task, up to the first generated turn" in out
    assert "seed not recorded" in out
    assert ChatMessage("user", "lisbon, a week there, the trams").content in out


def test_a_next_turn_sample_shows_each_future_and_the_judge_call_on_it(tmp_path):
    """The recipe's unit: one trained turn after the dataset's prefix, scored over sampled futures
    (actors store each future as the whole branch: the conversation, then its own messages)."""
    main = [
        ChatMessage("user", "can you help me with a blog post"),
        ChatMessage("assistant", "Sure - what is it about?"),
        ChatMessage("user", "lisbon"),
        ChatMessage("assistant", "What should it cover?"),
    ]
    futures = [
        FutureRollout(messages=[*main, ChatMessage("user", f"the trams {k}"), ChatMessage("assistant", DOC)])
        for k in range(2)
    ]
    traj = trajectory(
        task_id="t-0005",
        messages=main,
        token_ids=list(range(30)),
        loss_mask=[0] * 25 + [1] * 5,
        turns=[turn(25, [-0.5] * 5, version=7)],
        prefix_messages=3,
        mode="next_turn",
        futures=futures,
        terminated="max_new_turns",
    )
    s = _score(traj)
    ckpt.write_archive(tmp_path, 8, [s])
    StepLog(tmp_path, tensorboard=False).write(8, {}, {"version": 8, "traj_ids": [s.traj_id], "not_trained": {}})
    out = _trace(tmp_path, "t-0005/0").output
    assert "prompt (3 message(s) from the task" in out
    assert "3 policy version 7: 5 tokens, finish stop" in out
    assert "future 1 (scored, not trained" in out
    assert "simulator: [user] the trams 1" in out
    assert out.count("simulator: [user] can you help") == 0  # the branch's shared part is not repeated
    assert "interactivity_expected on future 0" in out and "interactivity_expected on future 1" in out
    assert "TRAINED by optimizer step 8 (against version 7" in out
