"""One filled-in example of every wire message, for the self-check and the protocol tests."""

from __future__ import annotations

from parley.protocol.arrays import pack_ids, pack_logprobs, pack_mask
from parley.protocol.messages import (
    AssistantTurn,
    BudgetUpdate,
    ChatMessage,
    DeadLetter,
    EvalRecord,
    FutureRollout,
    Heartbeat,
    JudgeOutput,
    JudgeReply,
    JudgeRequest,
    ReferenceReply,
    ReferenceRequest,
    Scored,
    SimReply,
    SimRequest,
    Task,
    Trajectory,
    WeightVersion,
)

T0 = 1_790_000_000.0  # a fixed timestamp keeps examples comparable


def task(run: str = "example", task_id: str = "t-0001") -> Task:
    return Task(
        task_id=task_id,
        run=run,
        item_id="bundled-000/0",
        n=4,
        prefix=[ChatMessage("user", "can you help me with a blog post")],
        reference="A Week in Lisbon\n\nThe trams...",
        title="A Week in Lisbon",
        summary="A travel blog post about a week in Lisbon.",
        seed=7,
        created=T0,
    )


def trajectory(run: str = "example", task_id: str = "t-0001", sample: int = 0) -> Trajectory:
    return Trajectory(
        traj_id=f"{task_id}/{sample}",
        task_id=task_id,
        sample=sample,
        run=run,
        item_id="bundled-000/0",
        messages=[
            ChatMessage("user", "can you help me with a blog post"),
            ChatMessage("assistant", "Sure - what is it about?"),
        ],
        token_ids_i32=pack_ids([1, 2, 3, 4, 5, 6, 7, 8]),
        loss_mask_u8=pack_mask([0, 0, 0, 0, 1, 1, 1, 0]),
        turns=[
            AssistantTurn(start=4, logprobs_f32=pack_logprobs([-0.5, -1.25, -0.125]), version=3, finish_reason="stop")
        ],
        reference="A Week in Lisbon\n\nThe trams...",
        prompt_tokens=4,
        assistant_tokens=3,
        sim_fallbacks=[],
        terminated="sim_done",
        futures=[FutureRollout(messages=[ChatMessage("user", "ok")], assistant_tokens=0)],
        model="smol",
        actor="actor-0",
        seed=7,
        timings={"generate": 0.5, "sim": 0.25, "total": 0.875},
        created=T0,
    )


def scored(run: str = "example") -> Scored:
    traj = trajectory(run)
    return Scored(
        traj_id=traj.traj_id,
        task_id=traj.task_id,
        sample=traj.sample,
        run=run,
        metrics={"bleu": 0.25, "interactivity": 0.5, "token_amount": 0.003},
        weights={"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1},
        total=0.7497,
        trajectory=traj,
        document="A Week in Lisbon",
        judge=[JudgeOutput(op="extract", raw='{"document": "A Week in Lisbon"}')],
        judge_model="smol",
        scorer="scorer-0",
        timings={"extract": 1.0, "interactivity": 1.0, "total": 2.0},
        created=T0,
    )


def eval_record(run: str = "example") -> EvalRecord:
    return EvalRecord(
        eval_id="base/bundled-000/0",
        condition="base",
        item_id="bundled-000/0",
        model="smol",
        system_prompt="",
        sim_prompt="lazy_full",
        sim_model="smol",
        judge_model="smol",
        seed=11,
        messages=[ChatMessage("user", "help me write something")],
        reference="A Week in Lisbon",
        assistant_tokens=0,
        metrics={"bleu": 0.0},
        created=T0,
    )


def dead_letter(run: str = "example") -> DeadLetter:
    return DeadLetter(
        subject=f"parley.{run}.traj",
        reason="decode error: example",
        consumer="scorer-0",
        payload=b"\x01\x02",
        created=T0,
    )


def channel_examples(run: str = "example") -> dict:
    return {
        "tasks": task(run),
        "traj": trajectory(run),
        "scored": scored(run),
        "eval": eval_record(run),
        "dead": dead_letter(run),
    }


def other_examples() -> dict:
    return {
        "sim.request": SimRequest(
            prompt="lazy_full", messages=[ChatMessage("assistant", "What is it about?")], reference="doc"
        ),
        "sim.reply": SimReply(message="a trip", done=False),
        "judge.request": JudgeRequest(op="extract", messages=[ChatMessage("user", "hi")]),
        "judge.reply": JudgeReply(ok=True, document="doc", levels={"understanding": 2}, score=0.5),
        "reference.request": ReferenceRequest(model="tiny", token_ids_i32=pack_ids([1, 5, 9])),
        "reference.reply": ReferenceReply(ok=True, logp_f32=pack_logprobs([-2.5, -0.25]), model="tiny"),
        "weights": WeightVersion(
            version=1, step=1, transport="objstore", location="v000001", sha256="0" * 64, bytes=10, created=T0
        ),
        "status": Heartbeat(role="actor", id="actor-0", state="ready", version=1, counters={"traj": 3.0}, created=T0),
        "control.budget": BudgetUpdate(sim_call_budget=1000, judge_calls_per_s=2.5, created=T0),
    }
