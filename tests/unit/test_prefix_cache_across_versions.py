"""[actor.engine] prefix_cache_across_versions (issue 56, item 2): off, every prompt's cache_salt names the
weights epoch, so a whole-weight swap leaves no KV of the old weights to reuse; on, the salt stays the
same across swaps, a conversation's next turn takes its earlier turns' KV from the prefix cache, and the
engine counts how many of those cached tokens older weights computed (GenOut.stale_cached_tokens, the
turn's AssistantTurn.stale_prefix_tokens, the heartbeat's engine.* counters). No vLLM engine: a test
double plays AsyncLLM with a prefix cache keyed as vLLM keys it (blocks chained from the salt and the
adapter)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from parley.config.run import ConfigError, load_config
from parley.engines.engine import EngineCounts, EngineSettings, PolicyEngine, PrefixEpochs

BLOCK = 4


class PrefixCacheLLMDouble:
    """Test double for vLLM's AsyncLLM: a prefix cache of whole BLOCK-token blocks, each keyed by its
    tokens, all before them, the request's cache_salt and its adapter (vLLM's block hash); a request
    takes the longest run of cached blocks from the start (never its last token, which vLLM always
    computes) and leaves the blocks of its prompt and output behind. Generation appends `reply`."""

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK, num_gpu_blocks=64))
    renderer = None

    def __init__(self, reply=(7, 8, 9, 10, 11)):
        self.reply, self.blocks, self.salts = list(reply), set(), []

    def _chain(self, salt, lora, tokens):
        h, out = hash((salt, lora)), []
        for i in range(len(tokens) // BLOCK):
            h = hash((h, tuple(tokens[i * BLOCK : (i + 1) * BLOCK])))
            out.append(h)
        return out

    async def generate(self, prompt, params, request_id, lora_request=None):
        ids, salt = prompt["prompt_token_ids"], prompt["cache_salt"]
        self.salts.append(salt)
        lora = lora_request.lora_name if lora_request is not None else ""
        hit = 0
        for h in self._chain(salt, lora, ids):
            if h not in self.blocks:
                break
            hit += 1
        cached = min(hit * BLOCK, (len(ids) - 1) // BLOCK * BLOCK)
        self.blocks.update(self._chain(salt, lora, ids + self.reply[:-1]))
        comp = SimpleNamespace(
            token_ids=list(self.reply),
            logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in self.reply],
            finish_reason="stop",
            text="",
        )
        yield SimpleNamespace(outputs=[comp], prompt_token_ids=list(ids), num_cached_tokens=cached)

    async def pause_generation(self, **kw):
        pass

    async def resume_generation(self):
        pass

    async def collective_rpc(self, method, kwargs=None):
        return [None]


def engine_double(across: bool) -> PolicyEngine:
    """A PolicyEngine over PrefixCacheLLMDouble (no vLLM), as __init__ leaves one."""
    engine = PolicyEngine.__new__(PolicyEngine)
    engine.settings = EngineSettings(model="double", prefix_cache_across_versions=across)
    engine.version = engine.base_version = 0
    engine.counts, engine._llm, engine._reload_lock = EngineCounts(), PrefixCacheLLMDouble(), asyncio.Lock()
    engine.adapters, engine._users = {}, {}
    engine._weights_epoch = 0
    engine._prefix_epochs = engine._track_prefix_epochs() if across else None
    return engine


def conversation(engine: PolicyEngine, swap_between: bool):
    """Two turns of one conversation: the second's prompt is the first's, its reply and a user message;
    with `swap_between`, whole weights are swapped in place before the second."""

    async def play():
        first_prompt = list(range(100, 113))  # 13 tokens: 3 whole blocks
        first = await engine._run(first_prompt, None)
        if swap_between:
            await engine.reload_weights("/nowhere", version=1)
        second_prompt = first_prompt + first.token_ids + [200, 201, 202]
        return first, await engine._run(second_prompt, None)

    return asyncio.run(play())


def test_off_the_salt_changes_at_a_swap_and_nothing_old_is_reused():
    engine = engine_double(across=False)
    _, second = conversation(engine, swap_between=True)
    assert engine._llm.salts == ["parley-weights-0", "parley-weights-1"]
    assert second.cached_tokens == 0 and second.stale_cached_tokens == 0


def test_on_the_salt_stays_across_a_swap_and_the_earlier_turn_is_reused_and_counted_stale():
    engine = engine_double(across=True)
    first, second = conversation(engine, swap_between=True)
    salts = engine._llm.salts
    assert len(salts) == 2 and salts[0] == salts[1]
    # the first turn's 13 prompt + 4 computed reply tokens = 17: four whole blocks from the cache
    assert second.cached_tokens == 16
    assert second.stale_cached_tokens == 16  # every one computed by the weights before the swap
    assert first.stale_cached_tokens == 0
    c = engine.counts.counters()
    assert c["engine.prompt_tokens"] == 13 + 21 and c["engine.cached_tokens"] == 16
    assert c["engine.stale_cached_tokens"] == 16 and c["engine.stale_prefix_requests"] == 1


def test_on_without_a_swap_cached_tokens_are_not_stale():
    engine = engine_double(across=True)
    _, second = conversation(engine, swap_between=False)
    assert second.cached_tokens == 16 and second.stale_cached_tokens == 0
    assert engine.counts.counters()["engine.stale_prefix_requests"] == 0


def test_prefix_epochs_stamps_blocks_by_the_weights_that_computed_them():
    p = PrefixEpochs(block_size=2, capacity=100)
    p.computed("", [1, 2, 3, 4], cached=0, epoch=0)
    assert p.stale("", [1, 2, 3, 4, 5], cached=4, epoch=0) == 0
    assert p.stale("", [1, 2, 3, 4, 5], cached=4, epoch=1) == 4
    # epoch 1 recomputes the second block (vLLM found only the first cached): it is epoch 1's now
    p.computed("", [1, 2, 3, 4], cached=2, epoch=1)
    assert p.stale("", [1, 2, 3, 4, 5], cached=4, epoch=1) == 2
    # another adapter's blocks are other blocks; a block stamped by none counts as stale
    assert p.stale("v2-1", [1, 2, 3, 4, 5], cached=4, epoch=1) == 4
    small = PrefixEpochs(block_size=2, capacity=1)
    small.computed("", [1, 2, 3, 4], cached=0, epoch=3)
    assert small.stale("", [1, 2, 3, 4], cached=2, epoch=3) == 2  # the first block's stamp aged out


def test_settable_with_set_and_refused_where_it_means_nothing():
    assert not load_config().actor.engine.prefix_cache_across_versions
    assert load_config(
        None, ["actor.engine.prefix_cache_across_versions=true"]
    ).actor.engine.prefix_cache_across_versions
    with pytest.raises(ConfigError, match="sim.engine.prefix_cache_across_versions = true: the sim engine never"):
        load_config(None, ["sim.engine.prefix_cache_across_versions=true"])
    with pytest.raises(ConfigError, match='serve = "adapter": adapter versions keep the prefix cache already'):
        load_config(
            None,
            [
                "actor.engine.prefix_cache_across_versions=true",
                "learner.lora.enabled=true",
                "actor.engine.max_lora_rank=16",
            ],
        )
    load_config(  # merged LoRA versions are whole weights swapped in place: the setting applies
        None,
        ["actor.engine.prefix_cache_across_versions=true", "learner.lora.enabled=true", 'learner.lora.serve="merged"'],
    )


def test_an_engine_without_a_prefix_cache_refuses_it():
    from parley.engines.engine import _engine_args

    settings = EngineSettings(model="double", prefix_cache_across_versions=True, extra={"enable_prefix_caching": False})
    with pytest.raises(ValueError, match="there is no prefix cache to keep"):
        _engine_args(settings, cpu_bind="nobind")


def test_each_turn_records_its_stale_prefix_and_version(tiny_model):
    """run_conversation stamps each AssistantTurn with the version and the stale prefix tokens its
    generate reported; the field survives the wire and an older trajectory without it reads as 0."""
    from transformers import AutoTokenizer

    from parley.engines.engine import GenOut
    from parley.protocol import codec
    from parley.protocol.messages import ChatMessage, SimReply
    from tests.unit.test_rollout import play, task

    tok = AutoTokenizer.from_pretrained(tiny_model)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    class StaleEngineDouble:
        """Test double of PolicyEngine.generate: the second turn reports 12 stale cached tokens."""

        calls = 0

        async def generate(self, prompt_ids, max_tokens, **kw):
            self.calls += 1
            ids = tok.encode("Sure.", add_special_tokens=False) + [end]
            return GenOut(
                ids, [-0.1] * len(ids), "stop", "Sure.", cached_tokens=16, stale_cached_tokens=12 * (self.calls > 1)
            )

    class SimDouble:
        """Test double of the simulator client: one more user message, then done."""

        def __init__(self):
            self.replies = [SimReply(message="more"), SimReply(message="ok", done=True)]

        async def ask(self, req):
            return self.replies.pop(0)

    t = task(n=1, prefix=[ChatMessage("user", "hi")], system_prompt="Be brief.", max_new_turns=4, max_tokens=16, seed=1)
    versions = iter([3, 4])
    traj = play(tok, StaleEngineDouble(), SimDouble(), t, version_fn=lambda: next(versions), max_model_len=512)
    assert [(turn.version, turn.stale_prefix_tokens) for turn in traj.turns] == [(3, 0), (4, 12)]
    back = codec.decode("traj", codec.encode(traj))
    assert [turn.stale_prefix_tokens for turn in back.turns] == [0, 12]


def test_the_progress_line_shows_the_prefix_cache_share_and_its_stale_part():
    from parley.deploy import up
    from parley.deploy.live import Snapshot
    from parley.protocol.messages import Heartbeat

    def snap(cached, stale):
        counters = {"engine.prompt_tokens": 1000.0, "engine.cached_tokens": cached, "engine.stale_cached_tokens": stale}
        return Snapshot(roles={"actor/actor-0": Heartbeat(role="actor", id="actor-0", state="busy", counters=counters)})

    assert "| prefix cache 80%" in up.progress_line(snap(800.0, 0.0))
    assert "stale" not in up.progress_line(snap(800.0, 0.0))
    assert "| prefix cache 80% (50% stale)" in up.progress_line(snap(800.0, 400.0))


def test_the_learners_step_metrics_say_how_much_it_trained_over_a_stale_prefix():
    from parley.learner.stepper import stale_prefix
    from parley.protocol.messages import AssistantTurn

    def sample(*turns):
        return SimpleNamespace(trajectory=SimpleNamespace(turns=list(turns)))

    fresh = AssistantTurn(start=10, version=1, finish_reason="stop")
    stale = AssistantTurn(start=30, version=2, finish_reason="stop", stale_prefix_tokens=24)
    untrained = AssistantTurn(start=50, version=2, finish_reason="stop", trained=False, stale_prefix_tokens=48)
    assert stale_prefix([[sample(fresh, stale, untrained)], [sample(fresh)]]) == {
        "stale_prefix_turn_share": 1 / 3,
        "stale_prefix_token_share": 24 / 50,
    }
    assert stale_prefix([]) == {"stale_prefix_turn_share": 0.0, "stale_prefix_token_share": 0.0}


def test_an_eval_engine_runs_exact_whatever_the_actors_setting(monkeypatch):
    """The periodic eval's long-lived engine (FollowingPolicy) measures each version over KV of its own
    weights: it takes [actor.engine] with the setting off. open_engine is replaced by a recorder."""
    from parley.engines import backend
    from parley.evaluation.commands import FollowingPolicy

    opened = []

    def open_engine_recorder(cfg, version=0, sampled_logprobs=False):
        opened.append(cfg)
        return SimpleNamespace(shutdown=lambda: None), object(), "path"

    monkeypatch.setattr(backend, "open_engine", open_engine_recorder)
    cfg = load_config(None, ["actor.engine.prefix_cache_across_versions=true"])
    asyncio.run(FollowingPolicy(cfg).open("smol", 3))
    assert [c.prefix_cache_across_versions for c in opened] == [False]
    assert opened[0].model == "smol"
