"""The reference service ([policy] reference = "service") against the learner's own reference, on
the toy model in fp32 on CPU, real nats-server, real DeepSpeed:

- the service's per-token log-probs, asked over the bus the way the scorer asks, equal what the
  learner's frozen reference computes for the same tokens packed into its micro-batches;
- two GRPO steps with reference = "service" (the samples' reference log-probs from the service,
  through Scored.ref_logp_f32 and the learner's intake check) give the same kl_mean and the same
  updated weights as reference = "local"; kl_coef = 0 loads no reference and ends elsewhere;
- the scorer waits for a reference service that is not up yet, spending no delivery, and stores
  the service's log-probs in the Scored.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import numpy as np
import pytest
import torch

from parley.config.learner import LearnerConfig
from parley.learner.packing import Sample, build_batch, pack_by_tokens
from parley.protocol import arrays
from parley.protocol.connect import connect
from parley.protocol.messages import Scored, Trajectory
from tests import factories

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

NAME = "toy"  # the [policy] model name the requests carry; the service holds this one
# Learner (packed, SDPA with a block-diagonal mask) vs service (one sequence per forward), fp32:
# measured max 1.4e-6, mean 4.9e-8 on these 234 tokens; the bound asked of the service.
LOGP_TOL = 1e-5


def sampled_trajectories(model, prompt_lens: list[int], n: int, new: int, seed: int) -> list[Trajectory]:
    """n samples of `new` tokens per prompt from the toy model (temperature 1), as Trajectory
    messages: the prompt untrained, the sampled tokens one trained turn with their behaviour log-probs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g, plen in enumerate(prompt_lens):
        ids = torch.randint(3, 2000, (1, plen), generator=gen).repeat(n, 1)
        lps = []
        with torch.no_grad():
            for _ in range(new):
                logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=gen)
                lps.append(logp.gather(1, nxt)[:, 0])
                ids = torch.cat([ids, nxt], dim=1)
        lps = torch.stack(lps, dim=1)
        for i in range(n):
            out.append(
                factories.trajectory(
                    "refsvc",
                    f"task-{g}",
                    i,
                    token_ids=ids[i].tolist(),
                    loss_mask=[0] * plen + [1] * new,
                    turns=[factories.turn(plen, lps[i].tolist(), finish_reason="length")],
                )
            )
    return out


@contextlib.asynccontextmanager
async def reference_up(url: str, model_dir):
    """The reference service on its own connection, as `parley reference` runs it."""
    from parley.services.reference.server import ReferenceModel, reference_service

    conn = await connect(url, name="reference-test")
    ref = ReferenceModel(NAME, model_dir, dtype="auto", chunk=64)
    service = reference_service(conn, ref, name="reference-test")
    await service.start()
    try:
        yield ref, service
    finally:
        await service.stop(grace_s=30)
        await conn.drain()


async def service_logprobs(nc, trajs: list[Trajectory]) -> dict[str, np.ndarray]:
    """What the scorer puts into Scored.ref_logp_f32, per trajectory."""
    from parley.services.reference.client import ReferenceClient

    client = ReferenceClient(nc, model=NAME, timeout=120)
    packed = await asyncio.gather(*(client.logprobs(t) for t in trajs))
    return {t.traj_id: np.frombuffer(p, dtype="<f4") for t, p in zip(trajs, packed)}


def plain_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


async def test_service_logprobs_equal_the_learners_own_reference(nc, nats_server, tiny_model):
    from parley.learner.logprobs import token_logprobs
    from parley.learner.trainer import Trainer
    from parley.services.reference.client import ReferenceClient, ReferenceUnavailable

    trajs = sampled_trajectories(plain_model(tiny_model), [5, 11, 23], 3, 14, seed=3)
    async with reference_up(nats_server.url, tiny_model):
        got = await service_logprobs(nc, trajs)
        # another model's request reaches no service of this one (its own subject): nobody answers it
        with pytest.raises(ReferenceUnavailable, match="no reference service answers on parley.svc.reference.other"):
            await ReferenceClient(nc, model="other", timeout=60).logprobs(trajs[0])

    cfg = LearnerConfig(kl_coef=0.01, micro_batch_tokens=64, logit_chunk_tokens=16)
    trainer = Trainer(cfg, tiny_model)
    assert trainer.reference is not None
    # every token after the first "trained", so the learner computes the reference log-prob of each
    samples = [
        Sample(
            t.traj_id,
            arrays.token_ids(t),
            [0] + [1] * (arrays.token_ids(t).size - 1),
            np.zeros(arrays.token_ids(t).size, np.float32),
            0.0,
        )
        for t in trajs
    ]
    diffs = []
    for micro in pack_by_tokens([len(s.token_ids) for s in samples], cfg.micro_batch_tokens):
        assert len(micro) > 1 or len(samples[micro[0]].token_ids) > 32  # packed, as the learner trains
        batch = build_batch([samples[j] for j in micro])
        mine, _ = token_logprobs(trainer.reference, batch, cfg.logit_chunk_tokens, grad=False)
        theirs = np.concatenate([got[samples[j].traj_id][1:] for j in micro])
        assert all(got[samples[j].traj_id][0] == 0.0 for j in micro)  # token 0 has no prefix
        diffs.append(np.abs(mine.numpy() - theirs))
    diff = np.concatenate(diffs)
    print(f"service vs learner reference: max {diff.max():.2e}, mean {diff.mean():.2e} over {diff.size} tokens")
    assert diff.size == sum(len(s.token_ids) - 1 for s in samples)
    assert diff.max() <= LOGP_TOL


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.module.named_parameters() if p.requires_grad}


async def test_service_reference_trains_like_the_local_one(nc, nats_server, tiny_model):
    from parley.learner.groups import behaviour_logprobs, check_hostile_values
    from parley.learner.grpo import group_advantages
    from parley.learner.intake import policy_limits
    from parley.learner.trainer import Trainer

    vocab, _ = policy_limits(tiny_model)
    trajs = sampled_trajectories(plain_model(tiny_model), [6, 9], 4, 16, seed=5)
    async with reference_up(nats_server.url, tiny_model):
        ref = await service_logprobs(nc, trajs)
    adv = group_advantages(torch.tensor([[0.1, 0.9, 0.4, 0.6], [0.3, 0.2, 0.8, 0.5]])).reshape(-1)
    received = []
    for i, t in enumerate(trajs):  # scorer -> Scored -> the learner's intake and its Samples
        s = factories.scored(t, {}, ref_logp_f32=arrays.pack_logprobs(ref[t.traj_id]))
        s = msgspec.msgpack.Decoder(Scored).decode(msgspec.msgpack.encode(s))
        check_hostile_values(s, vocab, reference=True)
        received.append((s, float(adv[i])))

    def samples(with_ref: bool) -> list[Sample]:
        return [
            Sample(
                s.traj_id,
                arrays.token_ids(s.trajectory),
                arrays.loss_mask(s.trajectory),
                behaviour_logprobs(s.trajectory),
                a,
                ref=arrays.ref_logprobs(s) if with_ref else None,
            )
            for s, a in received
        ]

    def run(reference: str, kl_coef: float = 0.5):
        # kl_coef large enough that the KL term moves the second step's weights (checked below)
        cfg = LearnerConfig(zero_stage=2, lr=1e-3, kl_coef=kl_coef, micro_batch_tokens=64)
        trainer = Trainer(cfg, tiny_model, reference=reference)
        loaded = trainer.reference is not None
        batch = samples(reference == "service")
        if reference == "service":
            before = params(trainer)
            with pytest.raises(ValueError, match=r"8 sample\(s\).*carry no reference log-probs"):
                trainer.train_step(samples(False))
            assert all(torch.equal(before[n], p) for n, p in params(trainer).items())  # refused before any backward
        stats = [trainer.train_step(batch) for _ in range(2)]  # the second starts away from the reference
        return loaded, stats, params(trainer)

    local_loaded, local, local_w = run("local")
    service_loaded, service, service_w = run("service")
    none_loaded, _, no_kl_w = run("local", kl_coef=0.0)
    assert (local_loaded, service_loaded, none_loaded) == (True, False, False)

    print("kl_mean local", [s["kl_mean"] for s in local], "service", [s["kl_mean"] for s in service])
    assert local[1]["kl_mean"] > 1e-6  # the policy has moved: the KL term is not vacuous
    for a, b in zip(local, service):
        assert b["kl_mean"] == pytest.approx(a["kl_mean"], rel=1e-3, abs=1e-9)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-8)
    worst = max(float((local_w[n] - service_w[n]).abs().max()) for n in local_w)
    moved = max(float((local_w[n] - no_kl_w[n]).abs().max()) for n in local_w)
    print(f"weights after 2 steps: max |local - service| {worst:.2e}; max |local - no KL| {moved:.2e}")
    # Adam's steps are +-lr-sized (1e-3): the two references agree to float rounding, while dropping
    # the KL term moves some weight by a sizeable part of a step
    for n in local_w:
        torch.testing.assert_close(service_w[n], local_w[n], rtol=0, atol=1e-5)
    assert moved > 100 * max(worst, 1e-7)


async def test_scorer_waits_for_the_reference_service_and_stores_its_logprobs(nc, js, nats_server, tiny_model):
    from parley.config.scorer import ScorerConfig
    from parley.protocol import bus, codec, topology
    from parley.scorer.scorer import Scorer
    from parley.services.reference.client import ReferenceClient

    run = "refscore"
    settings = topology.BusSettings(ack_wait_s=30.0, max_deliver=2, max_bytes=16 * 2**20)
    await topology.ensure_topology(js, run, settings)
    trajs = sampled_trajectories(plain_model(tiny_model), [7], 2, 10, seed=9)
    for t in trajs:
        t.run = run
        await bus.publish(js, run, "traj", t)
    cfg = ScorerConfig(concurrency=2, retry_delay_s=0.5, retry_max_delay_s=1.0, reference_timeout_s=30.0)
    scorer = Scorer(
        nc,
        run,
        factories.JudgeDouble(
            document=lambda messages: messages[-1].content,
            levels={"understanding": 2, "clarification": 1, "suggestions": 3},
        ),
        cfg,
        settings,
        "scorer-test",
        reference=ReferenceClient(nc, model=NAME, timeout=cfg.reference_timeout_s),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(scorer.run_until(stop, fetch_timeout=0.5))
    try:
        await asyncio.sleep(3.0)  # no reference service yet: the trajectories are held, not nak'ed
        assert scorer.counters["reference_wait"] >= 2 and scorer.counters["scored"] == 0
        async with reference_up(nats_server.url, tiny_model) as (ref, _):
            for _ in range(240):
                if scorer.counters["scored"] == len(trajs):
                    break
                await asyncio.sleep(0.5)
            expected = {t.traj_id: ref.logprobs(arrays.token_ids(t)) for t in trajs}
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert scorer.counters["scored"] == len(trajs) and scorer.counters["reference_retry"] == 0
    name = topology.stream_name(run, "scored")
    stored = [codec.decode("scored", (await js.get_msg(name, seq)).data) for seq in (1, 2)]
    assert (await js.stream_info(topology.stream_name(run, "dead"))).state.messages == 0
    for s in stored:
        lp = arrays.ref_logprobs(s)
        assert lp.size == arrays.token_ids(s.trajectory).size and lp[0] == 0.0
        np.testing.assert_array_equal(lp[1:], expected[s.traj_id])
        assert s.timings["reference"] > 0


async def test_the_service_refuses_what_it_cannot_answer_with_the_reason(tiny_model):
    from parley.learner.intake import policy_limits
    from parley.protocol import codec, topology
    from parley.protocol.messages import ReferenceRequest
    from parley.services.reference.server import ReferenceModel, reference_routes

    vocab, positions = policy_limits(tiny_model)
    ref = ReferenceModel(NAME, tiny_model, chunk=64)
    handler = reference_routes(ref)[topology.reference_subject(ref.model_name)]

    async def ask(data: bytes):
        return codec.decode("reference.reply", await handler(data))

    def req(ids, **kw) -> bytes:
        return codec.encode(ReferenceRequest(model=kw.pop("model", NAME), token_ids_i32=arrays.pack_ids(ids), **kw))

    good = await ask(req([5, 9, 17, 3]))
    assert good.ok and arrays.reference_logprobs(good.logp_f32, "t").size == 3
    for data, needle in [
        (b"\x93not a request", "request is not a ReferenceRequest"),
        (req([5, 9], model="other"), "holds model 'toy', not 'other'"),
        (req([5, 9], version=3), "version 3 asked; the reference is the initial weights, version 0"),
        (req([5]), "1 token(s): a log-prob needs a token and a prefix"),
        (req([5, vocab]), f"token id {vocab} is outside the vocabulary 0..{vocab - 1}"),
        (req([5] * (positions + 1)), f"{positions + 1} tokens, more than the model's {positions} positions"),
        (codec.encode(ReferenceRequest(model=NAME, token_ids_i32=b"\x01\x02\x03")), "holds 3 bytes"),
    ]:
        reply = await ask(data)
        assert not reply.ok and needle in reply.error, (needle, reply.error)
