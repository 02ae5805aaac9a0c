"""[policy] reference = "service" at the learner's intake, in process with a test-double trainer
(real nats-server): a Scored without reference log-probs, with too few, a NaN or a positive one is
dead-lettered with the reason, its group never trains, and the honest groups reach the trainer with
their reference log-probs in Sample.ref, token for token."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from parley.protocol import arrays, codec, topology
from parley.protocol.bus import publish
from parley.protocol.messages import Scored
from tests.integration.test_learner_fates import TrainerDouble
from tests.integration.test_learner_resume import BUS, make_scored, toy  # noqa: F401 (toy: the fixture)

pytestmark = [pytest.mark.integration]
RUN, N, STEPS = "refsvc", 3, 2


def with_ref(s: Scored, ref: np.ndarray | None) -> Scored:
    return msgspec.structs.replace(s, ref_logp_f32=b"" if ref is None else arrays.pack_logprobs(ref))


def honest_ref(s: Scored) -> np.ndarray:
    """Made-up but well-formed: one finite value <= 0 per token, 0.0 at token 0; distinct per position."""
    n = arrays.token_ids(s.trajectory).size
    return -np.linspace(0.0, 3.0, n, dtype=np.float32) - 0.001 * s.sample


class RecordingTrainerDouble(TrainerDouble):  # test double: keeps the samples of every step
    def __init__(self):
        super().__init__()
        self.samples = []

    def __call__(self, op, *args):
        if op == "train_step":
            self.samples += args[0]
        return super().__call__(op, *args)


async def test_scored_with_bad_reference_logprobs_is_dead_lettered(js, nc, toy, tmp_path):
    from parley.config.learner import LearnerConfig, RolloutConfig
    from parley.config.policy import PolicySection
    from parley.config.run import RunConfig
    from parley.learner.service import Learner

    model_path, tok, model = toy
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text((model_path / "config.json").read_text())
    cfg = RunConfig(
        bus=BUS,
        rollout=RolloutConfig(n=N),
        policy=PolicySection(reference="service"),
        learner=LearnerConfig(
            steps=STEPS,
            groups_per_step=1,
            max_staleness=STEPS,
            ledger_flush_s=0.5,
            kl_coef=0.001,
            accept_foreign_scored=True,  # its samples are synthetic: no feeder issued their tasks
        ),
    )
    cfg.run.name, cfg.run.dir = RUN, str(tmp_path / "run")
    await topology.ensure_topology(js, RUN, BUS)

    def bad(group: int, ref_of):
        s = make_scored(tok, model, RUN, group, 0)
        return with_ref(s, ref_of(honest_ref(s)))

    short = bad(11, lambda r: r[:-1])
    n11 = arrays.token_ids(short.trajectory).size
    poison = {
        "task-10/0": (bad(10, lambda r: None), "no reference log-probs (ref_logp_f32)"),
        "task-11/0": (short, f"{n11 - 1} reference log-probs for {n11} tokens"),
        "task-12/0": (bad(12, lambda r: np.where(np.arange(r.size) == 5, np.nan, r)), "reference log-prob 5 is nan"),
        "task-13/0": (bad(13, lambda r: np.where(np.arange(r.size) == 7, 2.0, r)), "reference log-prob 7 is 2.0"),
    }
    for s, _ in poison.values():
        await publish(js, RUN, "scored", s)
    honest = [make_scored(tok, model, RUN, g, i) for g in range(STEPS) for i in range(N)]
    sent = {}
    for s in honest:
        sent[s.traj_id] = honest_ref(s)
        await publish(js, RUN, "scored", with_ref(s, sent[s.traj_id]))

    trainer = RecordingTrainerDouble()
    learner = Learner(cfg, js, nc, trainer, model_dir=base, resume=False, steps=STEPS)
    assert await asyncio.wait_for(learner.run(asyncio.Event()), timeout=120) == 0

    dead_stream = topology.stream_name(RUN, "dead")
    info = await js.stream_info(dead_stream)
    letters = [
        codec.decode("dead", (await js.get_msg(dead_stream, seq)).data) for seq in range(1, info.state.messages + 1)
    ]
    reasons = {codec.decode("scored", d.payload).traj_id: d.reason for d in letters}
    assert set(reasons) == set(poison)
    for traj_id, (_, needle) in poison.items():
        assert needle in reasons[traj_id], reasons[traj_id]
    assert sorted(s.traj_id for s in trainer.samples) == sorted(sent)
    for s in trainer.samples:
        np.testing.assert_array_equal(s.ref, sent[s.traj_id])
