"""Wire messages for tests, built on protocol.examples' filled-in ones with the fields a test cares
about replaced, the judge test double and a service engine test double. Unit, integration and e2e tests import these instead of
writing out Trajectory/Scored/JudgeReply by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import msgspec

from parley.protocol import arrays, examples
from parley.protocol.messages import AssistantTurn, ChatMessage, JudgeReply, Scored, Trajectory


def turn(start: int, logprobs: Sequence[float], version: int = 0, finish_reason: str = "stop") -> AssistantTurn:
    """One assistant turn whose generated tokens begin at `start`, its behaviour log-probs packed."""
    return AssistantTurn(
        start=start, logprobs_f32=arrays.pack_logprobs(list(logprobs)), version=version, finish_reason=finish_reason
    )


def trajectory(
    run: str = "unit",
    task_id: str = "t-0001",
    sample: int = 0,
    *,
    token_ids: Sequence[int] | None = None,
    loss_mask: Sequence[int] | None = None,
    messages: Sequence[ChatMessage | tuple[str, str]] | None = None,
    **fields,
) -> Trajectory:
    """protocol.examples.trajectory with its ids for (run, task_id, sample), the given tokens (packed as
    today's actors write them), messages ((role, content) pairs or ChatMessages) and any other fields."""
    traj = examples.trajectory(run, task_id=task_id, sample=sample)
    if token_ids is not None:
        fields["token_ids_i32"] = arrays.pack_ids(list(token_ids))
    if loss_mask is not None:
        fields["loss_mask_u8"] = arrays.pack_mask(list(loss_mask))
    if messages is not None:
        fields["messages"] = [m if isinstance(m, ChatMessage) else ChatMessage(*m) for m in messages]
    return msgspec.structs.replace(traj, **fields)


def scored(
    traj: Trajectory,
    metrics: dict[str, float],
    weights: dict[str, float] | None = None,
    total: float | None = None,
    **fields,
) -> Scored:
    """The Scored of `traj` with these metrics; `weights` default to 1 for each metric and `total`
    to the weighted sum (what the scorer computes without clamps)."""
    weights = {name: 1.0 for name in metrics} if weights is None else weights
    if total is None:
        total = sum(weights.get(name, 0.0) * value for name, value in metrics.items())
    return Scored(
        traj_id=traj.traj_id,
        task_id=traj.task_id,
        sample=traj.sample,
        run=traj.run,
        metrics=metrics,
        weights=weights,
        total=total,
        trajectory=traj,
        **fields,
    )


def last_assistant(messages) -> str:
    return next((m.content for m in reversed(messages) if m.role == "assistant"), "")


def first_assistant(messages) -> str:
    return next(m.content for m in messages if m.role == "assistant")


LEVELS = {"understanding": 3, "clarification": 3, "suggestions": 3}


class JudgeDouble:
    """Test double of the judge client, no model: `extract` answers `document(messages)` (the last
    assistant message unless told), `interactivity` the levels of `levels_by_len[len(messages)]` or
    `levels` (with `score`), `interactivity_3level` `score_3level`. `fail_op` makes that operation answer
    a failed reply after `attempts`,
    `unavailable` makes extract raise JudgeUnavailable (no judge service answers); every call is
    recorded in `calls` as (op, number of messages)."""

    def __init__(
        self,
        *,
        model: str = "judge-double",
        document: Callable | str = last_assistant,
        levels: dict[str, int] | None = None,
        levels_by_len: dict[int, dict[str, int]] | None = None,
        score: float = 0.0,
        score_3level: float = 0.5,
        raw: Callable | str = "{}",
        raw_3level: str = "{}",
        fail_op: str | None = None,
        attempts: int = 4,
        unavailable: bool = False,
    ):
        self.model = model
        self.document, self.raw, self.raw_3level = document, raw, raw_3level
        self.levels = dict(LEVELS if levels is None else levels)
        self.levels_by_len = levels_by_len or {}
        self.score, self.score_3level = score, score_3level
        self.fail_op, self.attempts, self.unavailable = fail_op, attempts, unavailable
        self.calls: list[tuple[str, int]] = []

    def _failed(self, op: str) -> JudgeReply | None:
        if self.fail_op != op:
            return None
        why = "reply cut off" if op == "extract" else "not JSON"
        return JudgeReply(ok=False, attempts=self.attempts, error=f"attempt {self.attempts}: {why}", model=self.model)

    async def ask(self, op: str, messages, *, seed=0) -> JudgeReply:
        """services.judge.client.Judge's one entry: the operation by name."""
        if op not in ("extract", "interactivity", "interactivity_3level"):
            raise ValueError(f"JudgeDouble has no operation {op!r}")
        return await getattr(self, op)(messages, seed=seed)

    async def extract(self, messages, *, seed=0):
        from parley.services.judge.client import JudgeUnavailable

        self.calls.append(("extract", len(messages)))
        if self.unavailable:
            raise JudgeUnavailable("no judge service answers")
        if failed := self._failed("extract"):
            return failed
        doc = self.document(messages) if callable(self.document) else self.document
        raw = self.raw(doc) if callable(self.raw) else self.raw
        return JudgeReply(ok=True, document=doc, raw=raw, model=self.model)

    async def interactivity(self, messages, *, seed=0):
        self.calls.append(("interactivity", len(messages)))
        await asyncio.sleep(0)
        if failed := self._failed("interactivity"):
            return failed
        levels = self.levels_by_len.get(len(messages), self.levels)
        return JudgeReply(ok=True, levels=dict(levels), score=self.score, raw="{}", model=self.model)

    async def interactivity_3level(self, messages, *, seed=0):
        self.calls.append(("interactivity_3level", len(messages)))
        if failed := self._failed("interactivity_3level"):
            return failed
        return JudgeReply(ok=True, score=self.score_3level, raw=self.raw_3level, model=self.model)


def perturbed_model(model_dir, seed: int, scale: float = 0.05):
    """What a learner would publish as a new version: the checkpoint at `model_dir` (fp32, eval mode)
    with N(0, scale^2) noise from `seed` added to every parameter. Save it with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


class EngineDouble:
    """Test double of the engine behind a service handler (engines.service): each call waits until
    `release` is set, and `ended` records how it ended: "done" (answered with `reply(data)`) or
    "cancelled"."""

    def __init__(self, reply: Callable[[bytes], bytes] = lambda data: b"answer to " + data):
        self.reply = reply
        self.started: list[bytes] = []
        self.ended: dict[bytes, str] = {}
        self.release = asyncio.Event()

    async def handle(self, data: bytes) -> bytes:
        self.started.append(data)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.ended[data] = "cancelled"
            raise
        self.ended[data] = "done"
        return self.reply(data)


def eval_record(condition: str, item: str, bleu: float, inter: float, tokens: int, seed: int = 0, **metrics):
    """An EvalRecord of one item under `condition` with the CollabLLM metrics (and any others) and its
    assistant tokens."""
    from parley.protocol.messages import ChatMessage, EvalRecord

    return EvalRecord(
        eval_id=f"{condition}/{item}/{seed}",
        condition=condition,
        item_id=item,
        model=f"model-{condition}",
        system_prompt="",
        sim_prompt="lazy_full",
        sim_model="sim",
        judge_model="judge",
        seed=seed,
        messages=[ChatMessage("user", "hi"), ChatMessage("assistant", "hello")],
        reference="ref",
        assistant_tokens=tokens,
        metrics={"bleu": bleu, "interactivity": inter, **metrics},
    )


def safetensors_bytes(data: bytes) -> bytes:
    """A whole safetensors file holding `data` as one U8 tensor: what a test double writes as a version's
    model.safetensors (export checks the header first: learner.checkpoint.check_safetensors)."""
    import json
    import struct

    header = json.dumps({"data": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def run_gpu_part(tmp_path, part: str, python: str, smi: str, **env: str):
    """`bash bench/gpu_run.sh PART` with test doubles on PATH: `python` is the script python3 runs as (it
    appends its arguments, "|"-joined, to $STUB_LOG), `smi` the line nvidia-smi prints. Returns the
    completed process, the calls python3 recorded (one line each) and $OUT."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "python3").write_text(python)
    (stubs / "nvidia-smi").write_text(f'#!/bin/bash\necho "{smi}"\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    log, out = tmp_path / "calls.log", tmp_path / "out"
    full = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(log), "OUT": str(out), **env}
    res = subprocess.run(
        ["bash", str(root / "bench" / "gpu_run.sh"), part],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
    )
    return res, (log.read_text().splitlines() if log.exists() else []), out


class EngineArgsDouble:
    """Test double for vLLM's AsyncEngineArgs (its module is slow to import): keeps the fields given."""

    def __init__(self, **fields):
        self.fields = fields


def stub_engine_args(monkeypatch) -> None:
    """engines.engine._engine_args builds EngineArgsDouble instead of vLLM's AsyncEngineArgs."""
    import sys
    import types

    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.AsyncEngineArgs = EngineArgsDouble
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
