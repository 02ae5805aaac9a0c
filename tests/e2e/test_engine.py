"""PolicyEngine on a real vLLM (CPU) with the toy model: generation, JSON-constrained
generation, in-place weight reloads, and the learner/actor log-prob contract (vLLM's sampled
log-probs equal a transformers fp32 forward pass over the same ids). The engine is the toy model's
shared one (tests/e2e/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from parley.rollout.chat import ChatTokens
from tests import factories
from tests.reference import reference_logprobs

# engine start-up takes ~30 s alone, minutes on a busy 2-core box
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TOL = 1e-4


class Ctx:
    """The shared engine (tests/e2e/conftest.py) plus what the tests need around it. Tests drive the
    engine through the shared engines' private event loop, so they do not depend on pytest-asyncio's
    loop scoping."""

    def __init__(self, engines, engine):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = engines.model_dir
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.hf = AutoModelForCausalLM.from_pretrained(self.path, dtype="float32").eval()
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.run = engines.run
        self.engine = engine

    def gather(self, *coros):
        async def all_of():
            return await asyncio.gather(*coros)

        return self.run(all_of())

    def prompt(self, text: str) -> list[int]:
        rendered = self.tok.apply_chat_template(
            [{"role": "system", "content": "You help people write."}, {"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return self.tok.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def ctx(engines, tiny_engine):
    return Ctx(engines, tiny_engine)


def test_generate_returns_one_logprob_per_token(ctx):
    prompts = [ctx.prompt(f"Tell me about item {i}.") for i in range(6)]
    outs = ctx.gather(*[ctx.engine.generate(p, max_tokens=24, seed=i) for i, p in enumerate(prompts)])
    for out in outs:
        assert 0 < len(out.token_ids) <= 24
        assert len(out.logprobs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == ctx.end
        else:
            assert len(out.token_ids) == 24
    # a seed makes a sample reproducible
    again = ctx.run(ctx.engine.generate(prompts[0], max_tokens=24, seed=0))
    assert again.token_ids == outs[0].token_ids


def test_the_engines_sockets_are_in_a_scratch_dir_of_this_process(ctx):
    """vLLM's client-to-engine-core sockets go to engine_socket_dir's directory (swept once this
    process is gone, killed included), not loose in the temp directory."""
    import stat

    from parley.engines.engine import RPC_DIR_ENV

    path = os.environ[RPC_DIR_ENV]
    assert os.path.basename(path).startswith("parley-vllm-") and f"-{os.getpid()}-" in os.path.basename(path)
    sockets = [e for e in os.scandir(path) if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)]
    assert sockets, os.listdir(path)


def test_a_cancelled_generation_is_aborted_in_the_engine_and_the_engine_serves_on(ctx):
    """An actor cuts a turn whose group can no longer be trained by cancelling its generate call
    (rollout.conversation.StaleWatch): vLLM must then abort the request, not finish it unread."""

    async def cut():
        llm = ctx.engine._llm
        job = asyncio.ensure_future(ctx.engine.generate(ctx.prompt("Write a long story."), max_tokens=4000, seed=1))
        for _ in range(400):  # the request is in the engine
            await asyncio.sleep(0.01)
            if llm.output_processor.get_num_unfinished_requests():
                break
        assert llm.output_processor.get_num_unfinished_requests() == 1 and not job.done()
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        for _ in range(200):
            if not llm.output_processor.get_num_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return llm.output_processor.get_num_unfinished_requests()

    assert ctx.run(cut()) == 0
    out = ctx.run(ctx.engine.generate(ctx.prompt("Tell me about item 1."), max_tokens=8, seed=2))
    assert 0 < len(out.token_ids) <= 8


def test_the_watch_lets_a_stepping_engine_run_and_fails_one_that_holds_a_request_without_a_step(ctx):
    """PolicyEngine.watch on vLLM itself: its evidence that the engine steps is vLLM's stat logger, called
    at every batch the engine core sends (EngineCounts.steps). A generation longer than the stall bound
    runs through; a scheduler paused behind parley's back (as a hung engine core holds requests) with a
    request waiting fails the watch past the bound; resumed, the engine serves the request on."""
    import dataclasses
    import time

    from parley.engines.engine import EngineFailed

    engine, settings = ctx.engine, ctx.engine.settings

    async def go():
        # a fresh engine's first request waits seconds for its first step (the CPU build's warm-up); the
        # stall bound in use is minutes (EngineConfig.stall_timeout_s), this test's 0.3 s is for after it
        await engine.generate(ctx.prompt("Hello."), max_tokens=4, seed=3)
        stop = asyncio.Event()
        watch = asyncio.ensure_future(engine.watch(stop, tick_s=0.02))
        steps, t0 = engine.counts.steps, time.monotonic()
        out = await engine.generate(ctx.prompt("Write a long story."), max_tokens=200, seed=3)
        took, stepped = time.monotonic() - t0, engine.counts.steps - steps
        assert not watch.done(), watch  # a long generation is not a stall
        stop.set()
        await watch
        await engine._llm.pause_generation(mode="keep", clear_cache=False)  # parley does not know
        try:
            held = asyncio.ensure_future(engine.generate(ctx.prompt("Tell me about item 2."), max_tokens=8, seed=4))
            with pytest.raises(EngineFailed, match="held 1 requests for"):
                await asyncio.wait_for(engine.watch(asyncio.Event(), tick_s=0.02), timeout=30)
        finally:
            await engine._llm.resume_generation()
        return out, took, stepped, await asyncio.wait_for(held, timeout=60)

    engine.settings = dataclasses.replace(settings, stall_timeout_s=0.3)
    try:
        out, took, stepped, after = ctx.run(go())
    finally:
        engine.settings = settings
    assert took > 0.3 and stepped >= len(out.token_ids) // 2, (took, stepped, len(out.token_ids))
    assert 0 < len(after.token_ids) <= 8


def test_a_simulator_request_withdrawn_by_its_cancelled_actor_is_aborted_in_the_engine(ctx, nats_server, monkeypatch):
    """The whole chain of a withdrawal: an actor's SimClient.ask cancelled (StaleWatch) withdraws its
    request on the bus; the simulator service (engines/service.py over services/sim/server.py and a LocalBackend
    on the shared engine) cancels the computation nobody awaits, and vLLM aborts the request, long
    before the requester's 300 s wait would have let the service drop it."""
    from parley.config.actor import SimConfig
    from parley.engines.backend import LocalBackend
    from parley.protocol.connect import connect
    from parley.protocol.messages import ChatMessage, SimRequest
    from parley.services.sim.client import SimClient
    from parley.services.sim.server import Simulator

    llm = ctx.engine._llm
    aborted = []
    abort = llm.abort

    async def recording_abort(request_id, internal=False):  # what vLLM's generate calls when cancelled
        aborted.append(request_id)
        await abort(request_id, internal=internal)

    monkeypatch.setattr(llm, "abort", recording_abort)

    async def unfinished_after(condition, timeout_s: float) -> int:
        for _ in range(int(timeout_s / 0.01)):
            if condition(llm.output_processor.get_num_unfinished_requests()):
                break
            await asyncio.sleep(0.01)
        return llm.output_processor.get_num_unfinished_requests()

    async def withdraw():
        nc = await connect(nats_server.url, name="e2e-withdraw")
        backend = LocalBackend(ctx.engine, ctx.tok, model_name="tiny", owns_engine=False)
        service = Simulator(backend, SimConfig(max_tokens=1500, max_retries=0)).service(nc)
        await service.start()
        try:
            sim = SimClient(nc, timeout_s=300, wait_s=600)
            question = SimRequest(prompt="cooperative", messages=[ChatMessage("user", "hi")], seed=3)
            asking = asyncio.ensure_future(sim.ask(question))
            assert await unfinished_after(lambda n: n == 1, 30.0) == 1 and not asking.done()
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking
            return await unfinished_after(lambda n: n == 0, 5.0), dict(service.counters)
        finally:
            await service.stop(grace_s=5)
            await nc.close()

    left, counters = ctx.run(withdraw(), timeout=120)
    assert len(aborted) == 1, "vLLM generated the answer of a withdrawn request to its end"
    assert left == 0
    assert counters.get("withdrawn") == 1 and counters.get("cancelled") == 1 and "served" not in counters


def test_logprobs_match_transformers(ctx):
    """The key learner/actor contract, at temperature 1 (our training default)."""
    prompt = ctx.prompt("Write a short note to the team.")
    outs = ctx.gather(*[ctx.engine.generate(prompt, max_tokens=32, seed=100 + i) for i in range(3)])
    for out in outs:
        ref = reference_logprobs(ctx.hf, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < TOL
        # an off-by-one alignment (scoring each token with the previous position's
        # distribution) must be caught by the same comparison
        shifted = reference_logprobs(ctx.hf, prompt[:-1], [prompt[-1]] + out.token_ids)[:-1]
        assert max(abs(a - b) for a, b in zip(shifted, out.logprobs)) > 100 * TOL


def test_multi_turn_chat_tokens_logprobs(ctx):
    """Across turns: the behaviour log-probs recorded in ChatTokens equal the learner's single
    forward pass over the whole conversation, at the trained positions."""
    chat = ChatTokens(ctx.tok, [{"role": "user", "content": "Help me write a letter."}])
    for turn in range(3):
        out = ctx.run(ctx.engine.generate(chat.prompt_ids, max_tokens=12, seed=7 + turn))
        chat.add_assistant(out.token_ids, out.finish_reason, out.logprobs)
        if turn < 2:
            chat.add_user(f"Thanks, now part {turn + 2}.")
    ids, mask = chat.token_ids, chat.loss_mask
    full = reference_logprobs(ctx.hf, ids[:1], ids[1:])  # full[i - 1] scores ids[i]
    trained = [i for i, m in enumerate(mask) if m]
    assert trained and trained[0] > 0
    assert max(abs(full[i - 1] - chat.logprobs[i]) for i in trained) < TOL
    assert ctx.tok.decode(ids) == ctx.tok.apply_chat_template(chat.messages, tokenize=False)


def test_generate_json_follows_schema(ctx):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "done": {"type": "boolean"},
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["answer", "done", "score"],
        "additionalProperties": False,
    }
    prompt = ctx.prompt("Reply in JSON.")
    outs = ctx.gather(*[ctx.engine.generate_json(prompt, schema, max_tokens=48, seed=s) for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert set(value) == {"answer", "done", "score"}
        assert value["answer"] in ("yes", "no")
        assert isinstance(value["done"], bool)
        assert isinstance(value["score"], int) and 0 <= value["score"] <= 10
        assert len(out.logprobs) == len(out.token_ids)


def test_generate_json_returns_the_top_logprobs_of_every_position(ctx):
    schema = {
        "type": "object",
        "properties": {"score": {"type": "integer", "enum": [0, 1, 2, 3]}},
        "required": ["score"],
        "additionalProperties": False,
    }
    (out,) = ctx.gather(ctx.engine.generate_json(ctx.prompt("Rate it."), schema, max_tokens=16, seed=1, top_logprobs=5))
    assert out.finish_reason == "stop" and len(out.top) == len(out.token_ids)
    # the texts are the reply's (the stop token's own text, kept out of out.text, comes last)
    assert "".join(text for text, _ in out.top).startswith(out.text)
    for (text, candidates), lp in zip(out.top, out.logprobs):
        assert candidates[text] == pytest.approx(lp, abs=1e-5) or candidates[text] > lp  # merged look-alikes add up
        assert all(v <= 1e-6 for v in candidates.values())


def test_expected_interactivity_reply_carries_the_judges_distribution(ctx):
    from parley.config.scorer import JudgeConfig
    from parley.engines.backend import LocalBackend
    from parley.protocol.messages import ChatMessage, JudgeRequest
    from parley.rewards.metrics import INTERACTIVITY_KEYS
    from parley.services.judge.server import Judge

    judge = Judge(
        LocalBackend(ctx.engine, ctx.tok, model_name="tiny", owns_engine=False),
        JudgeConfig(max_tokens=400, max_retries=3),
    )
    conv = [
        ChatMessage("user", "write a note for my team"),
        ChatMessage("assistant", "Sure: who reads it, and how formal?"),
    ]
    reply = ctx.run(judge.handle("interactivity_expected", JudgeRequest(op="interactivity_expected", messages=conv)))
    assert reply.ok, reply.error
    assert set(reply.distribution) == set(INTERACTIVITY_KEYS)
    for key, probs in reply.distribution.items():
        assert set(probs) == {"0", "1", "2", "3"} and sum(probs.values()) == pytest.approx(1.0)
        assert probs[str(reply.levels[key])] > 0  # the level it wrote is one it gave probability to
    expected = sum(int(level) * p for probs in reply.distribution.values() for level, p in probs.items()) / 9
    assert reply.score == pytest.approx(expected)
    # a rating, not the written levels again: the toy judge is unsure somewhere
    assert min(max(probs.values()) for probs in reply.distribution.values()) < 0.999


def test_reload_weights_changes_and_restores(ctx, tmp_path):
    prompt = ctx.prompt("Describe the old mill.")

    def greedy():
        return ctx.run(ctx.engine.generate(prompt, max_tokens=24, temperature=0.0))

    before = greedy()

    # what a learner would publish: a perturbed copy saved the HF way
    perturbed = factories.perturbed_model(ctx.path, seed=1)
    new_dir = tmp_path / "v1"
    perturbed.save_pretrained(new_dir)

    try:
        # a request in flight across the swap must still finish cleanly
        async def swap_during_generation():
            long = asyncio.ensure_future(ctx.engine.generate(prompt, max_tokens=200, seed=3))
            await asyncio.sleep(0.05)
            await ctx.engine.reload_weights(new_dir, version=1)
            return await long

        inflight = ctx.run(swap_during_generation())
        assert inflight.finish_reason in ("stop", "length")
        assert len(inflight.logprobs) == len(inflight.token_ids)
        assert ctx.engine.version == 1

        after = greedy()
        assert after.token_ids != before.token_ids
        # every tensor was replaced (tied embeddings included): vLLM now agrees with the
        # perturbed model, not the original
        ref = reference_logprobs(perturbed, prompt, after.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, after.logprobs)) < TOL
    finally:
        ctx.run(ctx.engine.reload_weights(ctx.path, version=0))

    restored = greedy()
    assert restored.token_ids == before.token_ids
    assert restored.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def test_a_weight_swap_reuses_no_kv_the_old_weights_computed_and_caching_goes_on(ctx, tmp_path):
    """Prompts are salted by weights (PolicyEngine._weights_epoch), so a swap resets no prefix cache
    (a reset with requests running preempts them all) and yet a prompt served before it is computed
    afresh after it: vLLM reports no cached prompt tokens, and the log-probs are the new weights'.
    The same prompt once more is cached again, under the new weights."""
    prompt = ctx.prompt("Tell me about " + "the long river and the many bridges across it, " * 24)

    def greedy():
        return ctx.run(ctx.engine.generate(prompt, max_tokens=8, temperature=0.0))

    greedy()
    assert greedy().cached_tokens > 0  # the prefix cache is on and holds this prompt
    perturbed = factories.perturbed_model(ctx.path, seed=2)
    new_dir = tmp_path / "v1"
    perturbed.save_pretrained(new_dir)
    try:
        ctx.run(ctx.engine.reload_weights(new_dir, version=1))
        after = greedy()
        assert after.cached_tokens == 0
        ref = reference_logprobs(perturbed, prompt, after.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, after.logprobs)) < TOL
        assert greedy().cached_tokens > 0
    finally:
        ctx.run(ctx.engine.reload_weights(ctx.path, version=0))


def test_with_prefix_cache_across_versions_a_swap_keeps_the_cache_and_says_it_is_stale(ctx, tmp_path):
    """[actor.engine] prefix_cache_across_versions: the salt leaves the weights out, so the prompt cached
    before a swap is taken from vLLM's prefix cache after it (vLLM's cached-token count), every cached
    token counted stale; the log-probs are the new weights' over the old weights' KV, not a fresh
    prefill's. The shared engine is switched for this test alone."""
    import dataclasses

    engine = ctx.engine
    prompt = ctx.prompt("Tell me about " + "the old mill and the quiet pond beside it, " * 24)

    def greedy():
        return ctx.run(engine.generate(prompt, max_tokens=8, temperature=0.0))

    settings = engine.settings
    engine.settings = dataclasses.replace(settings, prefix_cache_across_versions=True)
    engine._prefix_epochs = engine._track_prefix_epochs()
    perturbed = factories.perturbed_model(ctx.path, seed=3)
    new_dir = tmp_path / "v1"
    perturbed.save_pretrained(new_dir)
    try:
        greedy()
        before = greedy()
        assert before.cached_tokens > 0 and before.stale_cached_tokens == 0
        ctx.run(engine.reload_weights(new_dir, version=1))
        after = greedy()
        assert after.cached_tokens == before.cached_tokens  # kept across the swap
        assert after.stale_cached_tokens == after.cached_tokens  # all of it the old weights'
        ref = reference_logprobs(perturbed, prompt, after.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, after.logprobs)) > TOL  # not a fresh prefill's
    finally:
        ctx.run(engine.reload_weights(ctx.path, version=0))
        engine.settings, engine._prefix_epochs = settings, None


def test_nccl_transport_loads_a_version_and_refuses_a_bad_one(ctx, tmp_path):
    """transport nccl end to end on vLLM (gloo where there is no GPU, as the learner picks): this
    process plays rank 0's sender, the engine's worker joins it, receives the packed buffer,
    checks it and loads it; a wrong checksum is refused and changes nothing."""
    import socket

    import msgspec

    from parley.protocol import codec
    from parley.weights.common import WeightVerifyError
    from parley.weights.cuda_ipc import IpcPublisher
    from parley.weights.nccl import NcclSender
    from parley.weights.registry import gpu_announcement
    from parley.weights.snapshot import hf_tensors

    prompt = ctx.prompt("Describe the new bridge.")

    def greedy():
        return ctx.run(ctx.engine.generate(prompt, max_tokens=24, temperature=0.0))

    before = greedy()
    perturbed = factories.perturbed_model(ctx.path, seed=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = NcclSender(IpcPublisher(hold_s=60.0), f"127.0.0.1:{port}", "gloo", timeout_s=60.0)
    try:
        source = sender.pack(hf_tensors(perturbed), 1)
        wv = gpu_announcement("engine-test", 1, 1, source)
        bad_tensors = list(source.tensors)
        bad_tensors[0] = msgspec.structs.replace(bad_tensors[0], checksum=[1, 2, 3])
        bad = msgspec.structs.replace(wv, nccl=msgspec.structs.replace(source, tensors=bad_tensors))
        with pytest.raises(WeightVerifyError, match="checksum mismatch"):
            ctx.run(ctx.engine.load_gpu(codec.encode(bad), hold_s=60.0, version=1))
        assert ctx.engine.version == 0 and greedy().token_ids == before.token_ids

        ctx.run(ctx.engine.load_gpu(codec.encode(wv), hold_s=60.0, version=1))
        after = greedy()
        assert ctx.engine.version == 1 and after.token_ids != before.token_ids
        ref = reference_logprobs(perturbed, prompt, after.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, after.logprobs)) < TOL
        assert len(sender.actors) == 1  # one join, kept across both requests
    finally:
        sender.close()
        ctx.run(ctx.engine.reload_weights(ctx.path, version=0))
    assert greedy().token_ids == before.token_ids


@pytest.mark.parametrize("kind", ["objstore", "shared_dir"])
def test_packed_deltas_carry_a_version_chain_and_a_corrupted_one_is_served_from_its_full_copy(
    ctx, tmp_path, nats_server, kind
):
    """[weights] delta_format = "packed" end to end on vLLM's CPU build and a real nats-server: this
    process plays the learner (weights.gpu_delta.PackedVersions over the toy model's tensors, 3% of
    the values changed each version, weights.registry.publish_version with `packed`), the actor's
    follower the actor. v1 is loaded from its file and kept packed; v2 comes by its delta alone (its
    full files never fetched) and serves v2's log-probs; v3's delta is corrupted (a wrong word,
    the blob's own sha256 intact), so it is refused and v3 is served from its full copy; v4 comes by
    its delta again, applied to the copy refilled from v3's file; with the copy dropped (a lost
    base), v5 is served from its full copy and kept packed again."""
    import torch
    from transformers import AutoModelForCausalLM

    from parley.protocol import topology
    from parley.protocol.bus import COUNTERS
    from parley.protocol.connect import connect
    from parley.weights import registry
    from parley.weights.config import ObjstoreWeights, SharedDirWeights
    from parley.weights.cuda_ipc import table_digest
    from parley.weights.follow import WeightFollower
    from parley.weights.gpu_delta import PackedVersions
    from parley.weights.snapshot import hf_tensors

    prompt = ctx.prompt("Describe the packed bridge.")
    settings = (
        ObjstoreWeights(full_every=100, delta_format="packed")
        if kind == "objstore"
        else SharedDirWeights(dir=str(tmp_path / "shared"), full_every=100, delta_format="packed")
    )
    model = AutoModelForCausalLM.from_pretrained(ctx.path, dtype="float32").eval()
    gen = torch.Generator().manual_seed(5)
    learner = PackedVersions()
    run = f"packed-{kind}"

    def step(k: int, corrupt: bool = False):
        with torch.no_grad():
            for p in model.parameters():
                mask = torch.rand(p.shape, generator=gen) < 0.03
                p.add_(mask * torch.randn(p.shape, generator=gen) * 0.05)
        wdir = tmp_path / f"learner-v{k}"
        model.save_pretrained(wdir)
        table, pending = learner.pack(hf_tensors(model), k, settings.delta_max_share)
        blob, base_version, base = pending.encode()
        pending.discard()  # its full file is model.save_pretrained's here
        if corrupt:
            blob = blob[:-1] + bytes([blob[-1] ^ 1])
        return wdir, (table, blob, base_version, base)

    async def served_is_learners(wdir):
        after = await ctx.engine.generate(prompt, max_tokens=16, temperature=0.0)
        ref = reference_logprobs(
            AutoModelForCausalLM.from_pretrained(wdir, dtype="float32").eval(), prompt, after.token_ids
        )
        return max(abs(a - b) for a, b in zip(ref, after.logprobs)) < TOL

    async def scenario():
        nc = await connect(nats_server.url, name="packed-test")
        js = nc.jetstream()
        await topology.ensure_topology(js, run, topology.BusSettings(max_bytes=64 << 20))
        full_fetches: list[int] = []

        async def fetch(*args, **kw):  # registry.fetch_version, counted: the full version's files
            full_fetches.append(args[2].version)
            return await registry.fetch_version(*args, **kw)

        follower = WeightFollower(
            js,
            run,
            ctx.engine,
            dest_root=tmp_path / "actor",
            poll_s=0.3,
            base_dir=ctx.path,
            settings=settings,
            fetch=fetch,
        )
        seen = []
        try:
            for k, corrupt in ((1, False), (2, False), (3, True), (4, False), (5, False)):
                if k == 5:  # the actor lost its packed copy (a restart, say): v5's delta has no base here
                    await ctx.engine.drop_packed()
                wdir, packed = step(k, corrupt)
                applied, refused = COUNTERS["weights.delta_applied"], COUNTERS["weights.delta_refused"]
                wv = await registry.publish_version(js, run, k, k, wdir, settings, packed=packed)
                assert await follower.check() and ctx.engine.version == k
                seen.append(
                    (
                        k,
                        COUNTERS["weights.delta_applied"] - applied,
                        COUNTERS["weights.delta_refused"] - refused,
                        full_fetches.count(k),
                        ctx.engine.packed_name == table_digest(wv.packed),
                    )
                )
                assert await served_is_learners(wdir), f"v{k} serves other log-probs than the learner's"
        finally:
            await nc.close()
        return seen

    try:
        # (version, deltas applied, deltas refused, its full files fetched, the packed copy holds it)
        assert ctx.run(scenario(), timeout=300) == [
            (1, 0, 0, 1, True),
            (2, 1, 0, 0, True),
            (3, 0, 1, 1, True),
            (4, 1, 0, 0, True),
            (5, 0, 0, 1, True),
        ]
    finally:
        ctx.run(ctx.engine.drop_packed())
        ctx.run(ctx.engine.reload_weights(ctx.path, version=0))
