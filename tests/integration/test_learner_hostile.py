"""Hostile but well-formed Scored messages against the real `parley learner` (real nats-server, real
DeepSpeed on the toy model): a NaN reward, an out-of-range metric, a positive behaviour log-prob,
a token id outside the vocabulary and a conversation longer than the model's positions are
dead-lettered with their reason at intake, and the run goes on to its last step with finite
weights, having trained only the honest groups."""

from __future__ import annotations

import json

import msgspec
import pytest

from parley.protocol import arrays, codec, topology
from parley.protocol.bus import publish
from parley.weights.common import current_version
from parley.weights.registry import fetch_version
from tests.integration.test_learner_resume import (  # noqa: F401 - toy is a fixture
    BUS,
    GROUPS_PER_STEP,
    STEPS,
    N,
    finish,
    make_scored,
    start_learner,
    toy,
    trained_lines,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RUN = "hostile"


async def test_hostile_scored_values_are_dead_lettered_and_the_weights_stay_finite(js, nats_server, toy, tmp_path):
    import torch
    from safetensors.torch import load_file

    model_path, tok, model = toy
    conf = json.loads((model_path / "config.json").read_text())
    vocab, positions = conf["vocab_size"], conf["max_position_embeddings"]
    honest = [make_scored(tok, model, RUN, g, i) for g in range(STEPS * GROUPS_PER_STEP) for i in range(N)]

    def hostile(group: int, **change):
        s = make_scored(tok, model, RUN, group, 0)
        traj = s.trajectory  # packed, as the actors write it: edit the arrays and pack them again
        ids, mask = arrays.token_ids(traj).tolist(), arrays.loss_mask(traj).tolist()
        if "logprob" in change:
            lps = arrays.turn_logprobs(traj.turns[0]).tolist()
            lps[0] = change.pop("logprob")
            traj.turns[0] = msgspec.structs.replace(traj.turns[0], logprobs_f32=arrays.pack_logprobs(lps))
        if "token" in change:
            ids[1] = change.pop("token")
        if "pad" in change:  # well-formed (mask as long as the tokens), longer than the model's positions
            pad = change.pop("pad")
            ids += [ids[-1]] * pad
            mask += [0] * pad
        traj = msgspec.structs.replace(traj, token_ids_i32=arrays.pack_ids(ids), loss_mask_u8=arrays.pack_mask(mask))
        return msgspec.structs.replace(s, trajectory=traj, **change)

    poison = {
        "task-10/0": (hostile(10, total=float("nan")), "total reward nan is not finite"),
        "task-11/0": (hostile(11, metrics={"bleu": 40.0}), "metric bleu=40.0 is outside [0, 1]"),
        "task-12/0": (hostile(12, logprob=3.0), "log-prob 0 is 3.0"),
        "task-13/0": (hostile(13, token=vocab), f"token id {vocab} is outside the policy's vocabulary"),
        "task-14/0": (hostile(14, pad=positions), f"more than the policy's {positions} positions"),
    }
    await topology.ensure_topology(js, RUN, BUS)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    proc = start_learner(nats_server.url, RUN, run_dir, model_path, log)
    for s, _ in poison.values():  # first, so they meet a learner that has trained nothing yet
        await publish(js, RUN, "scored", s)
    # The NaN reward's group is otherwise complete: taken in, it would be the first group trained
    # (its advantages, and through the loss the step, NaN). Refused, its group stays partial.
    for i in range(1, N):
        await publish(js, RUN, "scored", make_scored(tok, model, RUN, 10, i))
    for s in honest:
        await publish(js, RUN, "scored", s)
    await finish(proc, log)  # the run reached its last step

    trained = [t for line in trained_lines(run_dir) for t in line["traj_ids"]]
    assert sorted(trained) == sorted(s.traj_id for s in honest)
    dead_stream = topology.stream_name(RUN, "dead")
    info = await js.stream_info(dead_stream)
    letters = [
        codec.decode("dead", (await js.get_msg(dead_stream, seq)).data) for seq in range(1, info.state.messages + 1)
    ]
    reasons = {codec.decode("scored", d.payload).traj_id: d.reason for d in letters}
    assert set(reasons) == set(poison)
    for traj_id, (_, needle) in poison.items():
        assert needle in reasons[traj_id], reasons[traj_id]

    wv = await current_version(js, RUN)
    assert wv.version == STEPS
    weights = load_file(str(await fetch_version(js, RUN, wv, tmp_path / "fetched") / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


async def test_a_step_the_trainer_skips_is_dead_lettered_and_training_goes_on(js, nc, toy, tmp_path):
    """The learner's side of the last line of defence, in process with a test-double trainer whose
    first step reports a non-finite loss (skipped): that step's groups go to DEAD with the reason and
    are final in the ledger as "nonfinite", no step or version is counted for it, and later groups train."""
    import asyncio

    from parley.config.learner import LearnerConfig, RolloutConfig
    from parley.config.run import RunConfig
    from parley.learner.checkpoint import read_state
    from parley.learner.service import Learner
    from tests.integration.test_learner_early_stop import TrainerDouble

    class FirstStepNaNDouble(TrainerDouble):  # test double: the first step's loss is NaN
        def __call__(self, op, *args):
            out = super().__call__(op, *args)
            if op == "train_step" and self.calls.count("train_step") == 1:
                out |= {"loss": float("nan"), "grad_norm": float("inf"), "skipped": 1.0}
            elif op == "train_step":
                out |= {"skipped": 0.0}
            return out

    model_path, tok, model = toy
    run, steps = "skipped", 2
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text((model_path / "config.json").read_text())
    cfg = RunConfig(
        bus=BUS,
        rollout=RolloutConfig(n=N),
        learner=LearnerConfig(
            steps=steps, groups_per_step=1, max_staleness=steps, ledger_flush_s=0.5, accept_foreign_scored=True
        ),
    )
    cfg.run.name, cfg.run.dir = run, str(tmp_path / "run")
    await topology.ensure_topology(js, run, BUS)
    for g in range(steps + 1):
        for i in range(N):
            await publish(js, run, "scored", make_scored(tok, model, run, g, i))
    trainer = FirstStepNaNDouble(step_s=0.0)
    learner = Learner(cfg, js, nc, trainer, model_dir=base, resume=False, steps=steps)
    assert await asyncio.wait_for(learner.run(asyncio.Event()), timeout=120) == 0

    assert trainer.calls.count("train_step") == steps + 1 and learner.state.step == steps
    assert (await current_version(js, run)).version == steps
    dead_stream = topology.stream_name(run, "dead")
    info = await js.stream_info(dead_stream)
    letters = [
        codec.decode("dead", (await js.get_msg(dead_stream, seq)).data) for seq in range(1, info.state.messages + 1)
    ]
    first = "task-00"  # the oldest complete group is taken first
    assert sorted(codec.decode("scored", d.payload).traj_id for d in letters) == [f"{first}/{i}" for i in range(N)]
    assert all("not finite, so it was skipped" in d.reason for d in letters)
    assert read_state(tmp_path / "run").done[first] == "nonfinite"
    trained = [t for line in trained_lines(tmp_path / "run") for t in line["traj_ids"]]
    assert not any(t.startswith(first) for t in trained) and len(trained) == steps * N
