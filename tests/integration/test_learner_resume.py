"""Exact resume: a learner SIGKILLed between steps and restarted with --resume trains exactly the
trajectories an uninterrupted learner trains, none twice. Real nats-server, real DeepSpeed on the
toy model, the real `parley learner` command; the Scored messages are synthetic conversations in
the toy tokenizer's ids with the toy model's own behaviour log-probs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parley.learner.checkpoint import read_state
from parley.protocol import topology
from parley.protocol.bus import publish
from parley.protocol.messages import Scored
from parley.weights.common import current_version
from tests import factories

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
N, GROUPS_PER_STEP, STEPS = 3, 2, 3
# Small streams: the test server reserves max_bytes per stream, and two runs of 8 GiB ones do not fit.
BUS = topology.BusSettings(max_bytes=64 * 1024**2, ack_wait_s=4.0)
PHRASES = [
    "Sure, what is the post about?",
    "Here is a first draft of the letter.",
    "Could you tell me the tone?",
    "Thanks! I kept your structure.",
    "The recipe needs two cups of flour.",
    "Yes, that works.",
]


def make_scored(tok, model, run: str, group: int, sample: int) -> Scored:
    """A two-turn conversation built token-in/token-out, with real behaviour log-probs."""
    from parley.rollout.chat import ChatTokens
    from tests.reference import reference_logprobs

    rng = random.Random(group * 100 + sample)
    task = f"task-{group:02d}"
    conv = ChatTokens(tok, [{"role": "user", "content": f"Help me write note {group}."}])
    turns = []
    for t in range(2):
        gen = tok.encode(rng.choice(PHRASES), add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        lps = reference_logprobs(model, conv.prompt_ids, gen)
        turns.append(factories.turn(len(conv.token_ids), lps))
        conv.add_assistant(gen, "stop", lps)
        if t == 0:
            conv.add_user("Go on.")
    traj = factories.trajectory(
        run,
        task,
        sample,
        item_id=f"item-{group}",
        messages=[(m["role"], m["content"]) for m in conv.messages],
        token_ids=conv.token_ids,
        loss_mask=conv.loss_mask,
        turns=turns,
    )
    return factories.scored(traj, {"bleu": rng.random()})


@pytest.fixture(scope="module")
def toy(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return tiny_model, tok, model


def start_learner(url: str, run: str, run_dir: Path, model: Path, log: Path, resume: bool = False) -> subprocess.Popen:
    sets = [
        f'run.dir="{run_dir}"',
        f'policy.model="{model}"',
        f"rollout.n={N}",
        f"learner.groups_per_step={GROUPS_PER_STEP}",
        'learner.stale_policy="correct"',
        "learner.lr=1e-4",
        "learner.micro_batch_tokens=256",
        f"bus.ack_wait_s={BUS.ack_wait_s}",
        f"bus.max_bytes={BUS.max_bytes}",
        "learner.ledger_flush_s=0.5",
        "learner.accept_foreign_scored=true",  # its samples are synthetic: no feeder issued their tasks
        "learner.eval_every=0",  # no sim/judge services here; the periodic eval has its own tests
    ]
    cmd = [sys.executable, "-m", "parley.deploy.cli", "learner", "--nats", url, "--run", run, "--steps", str(STEPS)]
    for s in sets:
        cmd += ["--set", s]
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "PARLEY_LOG": "INFO"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)


def trained_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "trained.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"learner exited with {proc.returncode} while waiting for {what}:\n{log.read_text()[-4000:]}")
        await asyncio.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{log.read_text()[-4000:] if log else ''}")


async def finish(proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    code = await asyncio.to_thread(proc.wait, timeout)
    assert code == 0, log.read_text()[-4000:]


async def test_sigkilled_learner_resumes_exactly(js, nats_server, toy, tmp_path):
    model_path, tok, model = toy
    groups = {g: [make_scored(tok, model, "", g, i) for i in range(N)] for g in range(STEPS * GROUPS_PER_STEP)}

    async def send(run: str, pairs):
        for g, i in pairs:
            s = groups[g][i]
            s.run = s.trajectory.run = run
            await publish(js, run, "scored", s)

    every = [(g, i) for g in groups for i in range(N)]

    # The reference: one uninterrupted learner given every sample at once.
    await topology.ensure_topology(js, "whole", BUS)
    whole_dir, whole_log = tmp_path / "whole", tmp_path / "whole.log"
    proc = start_learner(nats_server.url, "whole", whole_dir, model_path, whole_log)
    await send("whole", every)
    await finish(proc, whole_log)
    expected = [t for line in trained_lines(whole_dir) for t in line["traj_ids"]]
    assert sorted(expected) == sorted(f"task-{g:02d}/{i}" for g, i in every)
    assert (await current_version(js, "whole")).version == STEPS

    # The interrupted one: the first step's groups and a partial group, then SIGKILL once the
    # partial group is recorded in the ledger (so its messages are acked and must come back from it).
    await topology.ensure_topology(js, "killed", BUS)
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    proc = start_learner(nats_server.url, "killed", run_dir, model_path, log)
    await send("killed", [(0, i) for i in range(N)] + [(1, i) for i in range(N)] + [(5, 0), (5, 1)])

    def step1_and_partial_recorded():
        state = read_state(run_dir) if (run_dir / "learner" / "state.msgpack").is_file() else None
        return (
            state is not None
            and state.step == 1
            and any(g.task_id == "task-05" and len(g.samples) == 2 for g in state.groups)
        )

    await wait_for(step1_and_partial_recorded, 120, "step 1 and the partial group in the ledger", proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(trained_lines(run_dir)) == 1

    await send("killed", [(g, i) for g in (2, 3, 4) for i in range(N)] + [(5, 2)])
    proc = start_learner(nats_server.url, "killed", run_dir, model_path, log, resume=True)
    await finish(proc, log)

    lines = trained_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3]
    got = [t for line in lines for t in line["traj_ids"]]
    assert len(got) == len(set(got)), "a trajectory was trained twice"
    assert sorted(got) == sorted(expected)
    assert "resumed at step 1" in log.read_text()
    assert (await current_version(js, "killed")).version == STEPS
