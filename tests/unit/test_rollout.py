"""The conversation loop without vLLM or NATS: a scripted policy-engine double and a scripted
simulator-client double drive run_conversation over the toy tokenizer. Checks what a Trajectory
promises: the token stream reads back as the chat template's rendering, the loss mask covers
exactly the generated ids, one log-prob per generated token, versions, terminations, fallbacks,
next_turn futures; and the simulator client's give-up path."""

from __future__ import annotations

import asyncio
import types

import nats.errors
import pytest

from parley.engines.engine import GenOut
from parley.protocol import arrays, codec
from parley.protocol.bus import Poison
from parley.protocol.messages import ABANDONED_STALE, ChatMessage, SimReply, SimRequest, Task
from parley.rollout.conversation import PolicySettings, StaleWatch, check_task, derive_seed, run_conversation
from parley.services.sim.client import FALLBACK_MESSAGE, SimClient, SimUnreachable


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


class EngineDouble:
    """Test double of PolicyEngine.generate: answers with scripted texts (cycled), ends each with
    <|im_end|> unless max_tokens cuts it, log-prob -0.01 * (position + 1)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, list(texts), []
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop_token_ids=None):
        self.calls.append(dict(prompt_ids=list(prompt_ids), max_tokens=max_tokens, seed=seed, stop=stop_token_ids))
        text = self.texts[(len(self.calls) - 1) % len(self.texts)]
        ids = self.tok.encode(text, add_special_tokens=False) + [self.end]
        reason = "stop"
        if len(ids) > max_tokens:
            ids, reason = ids[:max_tokens], "length"
        return GenOut(ids, [-0.01 * (i + 1) for i in range(len(ids))], reason, text)


class SimClientDouble:
    """Test double of rollout.SimClient: scripted SimReplies, requests recorded."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []

    async def ask(self, req):
        self.requests.append(req)
        return self.replies.pop(0)


def task(**kw) -> Task:
    base = dict(
        task_id="t1",
        run="r",
        item_id="item/0",
        n=2,
        prefix=[ChatMessage("user", "help me write a toast")],
        reference="REF",
        title="Toast",
        summary="a toast",
        system_prompt="You help people write.",
        sim_prompt="lazy_full",
        max_new_turns=6,
        max_tokens=32,
        seed=5,
    )
    return Task(**{**base, **kw})


def play(tok, engine, sim, t, sample=0, version_fn=lambda: 0, max_model_len=2048, watch=None):
    policy = PolicySettings(max_model_len=max_model_len, model="tiny-double", actor="a1")
    return asyncio.run(run_conversation(engine, sim, t, sample, version_fn, tokenizer=tok, policy=policy, watch=watch))


def assert_consistent(tok, traj):
    """The invariants every published trajectory must satisfy."""
    msgs = [{"role": m.role, "content": m.content} for m in traj.messages]
    gen_prompt = msgs[-1]["role"] == "user"
    ids, mask = arrays.token_ids(traj).tolist(), arrays.loss_mask(traj).tolist()
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
    assert len(mask) == len(ids)
    expected = [0] * len(ids)
    for turn in traj.turns:
        n = arrays.generated(turn)
        assert arrays.turn_logprobs(turn).size == n
        expected[turn.start : turn.start + n] = [1] * n
    assert mask == expected
    assert traj.assistant_tokens == sum(arrays.generated(t) for t in traj.turns) == sum(mask)
    assert traj.prompt_tokens == traj.turns[0].start
    assert codec.decode("traj", codec.encode(traj)) == traj


def test_conversation_until_the_simulator_is_done(tok):
    engine = EngineDouble(tok, ["Who is the toast for?", "Here is a draft toast."])
    sim = SimClientDouble(
        [SimReply(message="my sister, keep it short"), SimReply(message="perfect, thanks", done=True)]
    )
    versions = iter([3, 4, 4])
    traj = play(tok, engine, sim, task(), sample=1, version_fn=lambda: next(versions))
    assert traj.terminated == "sim_done"
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert traj.messages[0].content == "You help people write."
    assert [m.content for m in traj.messages if m.role == "assistant"] == [
        "Who is the toast for?",
        "Here is a draft toast.",
    ]
    assert [t.version for t in traj.turns] == [3, 4]
    assert all(t.trained and t.finish_reason == "stop" for t in traj.turns)
    assert (traj.traj_id, traj.sample, traj.mode, traj.actor, traj.model) == (
        "t1/1",
        1,
        "conversation",
        "a1",
        "tiny-double",
    )
    assert traj.seed == derive_seed("t1", 5, 1) and traj.sim_fallbacks == []
    assert traj.prefix_messages == 2  # the task's system prompt and opening: the rest was played (parley trace)
    assert set(traj.timings) == {"generate", "sim", "total"}
    assert_consistent(tok, traj)
    # the simulator sees the conversation without the assistant's system prompt
    assert [m.role for m in sim.requests[0].messages] == ["user", "assistant"]
    assert sim.requests[0].reference == "REF" and sim.requests[0].prompt == "lazy_full"
    # every engine call got its own seed and the template's end-of-turn token as a stop
    assert len({c["seed"] for c in engine.calls}) == 2
    assert engine.calls[0]["stop"] == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_empty_prefix_lets_the_simulator_open_and_budget_ends_on_an_assistant_turn(tok):
    engine = EngineDouble(tok, ["Sure, what is it about?"])
    sim = SimClientDouble([SimReply(message="write a poem", done=True), SimReply(message="about the sea")])
    traj = play(tok, engine, sim, task(prefix=[], system_prompt="", max_new_turns=4))
    # the opening ignores "done"; 4 messages: user, assistant, user, assistant
    assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant"]
    assert traj.messages[0].content == "write a poem"
    assert traj.prefix_messages == 0  # the simulator's opening is its answer, not the task's
    assert traj.terminated == "max_new_turns"
    assert_consistent(tok, traj)

    engine = EngineDouble(tok, ["Sure."])
    sim = SimClientDouble([SimReply(message="write a poem"), SimReply(message="more")])
    traj = play(tok, engine, sim, task(prefix=[], max_new_turns=3))
    # a third message would be a user turn nobody answers: stop after the assistant
    assert [m.role for m in traj.messages] == ["system", "user", "assistant"]
    assert traj.terminated == "max_new_turns" and len(sim.requests) == 1


def test_simulator_fallbacks_are_recorded_by_message_index(tok):
    engine = EngineDouble(tok, ["Tell me more.", "Draft one.", "Draft two."])
    sim = SimClientDouble(
        [
            SimReply(message=FALLBACK_MESSAGE, fallback=True, error="not JSON"),
            SimReply(message="add a joke"),
        ]
    )
    traj = play(tok, engine, sim, task(max_new_turns=5))
    assert traj.sim_fallbacks == [3]
    assert traj.messages[3] == ChatMessage("user", FALLBACK_MESSAGE)
    assert traj.terminated == "max_new_turns" and len(traj.turns) == 3
    assert_consistent(tok, traj)


def test_a_turn_cut_by_max_tokens_is_closed_untrained(tok):
    engine = EngineDouble(tok, ["This reply is much longer than the few tokens it may use here."])
    sim = SimClientDouble([SimReply(message="ok", done=True)])
    traj = play(tok, engine, sim, task(max_tokens=5))
    assert traj.turns[0].finish_reason == "length" and arrays.generated(traj.turns[0]) == 5
    assert_consistent(tok, traj)


def test_max_model_len_ends_the_conversation(tok):
    engine = EngineDouble(tok, ["A reply of a good number of tokens, more than a few for sure."])
    sim = SimClientDouble([SimReply(message="go on")] * 10)
    t = task(max_new_turns=20)
    opening = len(
        tok.apply_chat_template(
            [{"role": "system", "content": t.system_prompt}, {"role": "user", "content": t.prefix[0].content}],
            tokenize=True,
            add_generation_prompt=True,
        )
    )
    traj = play(tok, engine, sim, t, max_model_len=opening + 40)
    assert traj.terminated == "max_model_len"
    assert arrays.token_ids(traj).size <= opening + 40 + 2  # at most the untrained closing of a cut turn beyond
    assert traj.messages[-1].role == "assistant"
    assert_consistent(tok, traj)


def test_next_turn_trains_one_turn_and_samples_futures(tok):
    prefix = [ChatMessage("user", "help me"), ChatMessage("assistant", "With what?"), ChatMessage("user", "a toast")]
    engine = EngineDouble(tok, ["Who is it for?", "Draft.", "Another draft."])
    sim = SimClientDouble(
        [SimReply(message="my sister"), SimReply(message="my friend"), SimReply(message="bye", done=True)]
    )
    traj = play(tok, engine, sim, task(mode="next_turn", prefix=prefix, futures=3, future_turns=2))
    assert traj.mode == "next_turn" and traj.terminated == "max_new_turns"
    assert len(traj.turns) == 1 and traj.turns[0].trained
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert_consistent(tok, traj)
    assert len(traj.futures) == 3
    main = traj.messages
    lengths = sorted(len(f.messages) for f in traj.futures)
    assert lengths == [len(main), len(main) + 2, len(main) + 2]  # the "done" future stops at once
    for f in traj.futures:
        assert f.messages[: len(main)] == main
        extra = f.messages[len(main) :]
        assert [m.role for m in extra] in ([], ["user", "assistant"])
        assert f.assistant_tokens == sum(
            len(tok.encode(m.content, add_special_tokens=False)) + 1 for m in extra if m.role == "assistant"
        )


def test_unplayable_tasks_are_poison():
    for bad in (
        task(mode="monologue"),
        task(n=0),
        task(max_tokens=0),
        task(prefix=[], max_new_turns=1),
        task(prefix=[ChatMessage("tool", "x")]),
    ):
        with pytest.raises(Poison):
            check_task(bad)
    check_task(task(max_new_turns=1))  # prefix ends with the user: one assistant turn fits


class OutageNcDouble:
    """Test double of a NATS client whose simulator is away for the first `down` requests."""

    def __init__(self, down: int):
        self.down, self.requests = down, 0

    async def request(self, subject, data, timeout, headers=None):
        self.requests += 1
        if self.requests <= self.down:
            raise nats.errors.NoRespondersError
        return types.SimpleNamespace(data=codec.encode(SimReply(message="back again")))


def test_sim_client_waits_out_an_outage_instead_of_giving_the_task_back():
    # Before sim_wait_s, four unanswered requests turned into bus.Retry: each outage spent one
    # of the task's deliveries, and an outage of max_deliver of them dead-lettered it.
    nc = OutageNcDouble(down=6)
    client = SimClient(nc, timeout_s=1.0, wait_s=60.0, backoff_s=0.001, max_backoff_s=0.001)
    reply = asyncio.run(client.ask(SimRequest(prompt="lazy_full", messages=[])))
    assert reply.message == "back again" and nc.requests == 7 and client.waits == 6


def test_sim_client_gives_the_task_up_after_sim_wait_s_with_the_reason():
    nc = OutageNcDouble(down=10**9)
    client = SimClient(nc, timeout_s=1.0, wait_s=0.05, backoff_s=0.01, max_backoff_s=0.01)
    with pytest.raises(
        SimUnreachable, match=r"user simulator unreachable on parley.svc.sim for \d+s \(sim_wait_s=0.05"
    ):
        asyncio.run(client.ask(SimRequest(prompt="lazy_full", messages=[])))
    assert isinstance(SimUnreachable("x"), Poison)  # dead-lettered with that reason, not retried


def test_special_tokens_generated_mid_turn_stay_in_the_messages(tok):
    # a weak policy may emit template tokens inside a turn; the readable message keeps them, so
    # the messages still render to exactly the trained ids
    engine = EngineDouble(tok, ["Hello<|im_start|> there<|endoftext|>"])
    sim = SimClientDouble([SimReply(message="ok", done=True)])
    traj = play(tok, engine, sim, task())
    gen = arrays.token_ids(traj)[traj.turns[0].start : traj.turns[0].start + arrays.generated(traj.turns[0])].tolist()
    assert tok.convert_tokens_to_ids("<|im_start|>") in gen
    assert traj.messages[-1].content == "Hello<|im_start|> there<|endoftext|>"
    assert_consistent(tok, traj)


class AnnouncingEngineDouble(EngineDouble):
    """EngineDouble whose `at`-th generation ends after the learner announced version `to`."""

    def __init__(self, tok, texts, announced: list[int], at: int, to: int):
        super().__init__(tok, texts)
        self.announced, self.at, self.to = announced, at, to

    async def generate(self, *a, **kw):
        out = await super().generate(*a, **kw)
        if len(self.calls) == self.at:
            self.announced[0] = self.to
        return out


def test_a_conversation_stops_at_its_next_turn_once_its_group_can_no_longer_be_trained(tok):
    """max_staleness 1: the first turn is of version 0; while it was generated the learner announced
    version 2, so no sample of the task can be trained any more. The conversation stops before asking
    the simulator again and is published as played (terminated "stale"); a sibling sharing the watch
    does not play a turn. At max_staleness 2 the same conversation plays to its end."""
    announced = [0]
    engine = AnnouncingEngineDouble(tok, ["Who is it for?", "Draft."], announced, at=1, to=2)
    sim = SimClientDouble([SimReply(message="my sister")] * 3)
    watch = StaleWatch(lambda: announced[0], max_staleness=1)
    traj = play(tok, engine, sim, task(), watch=watch)
    assert traj.terminated == ABANDONED_STALE and [t.version for t in traj.turns] == [0]
    assert sim.requests == [] and len(engine.calls) == 1
    assert_consistent(tok, traj)
    assert "lags the announced version 2 by 2 > max_staleness 1" in watch.why()
    sibling = play(tok, engine, sim, task(), sample=1, watch=watch)
    assert sibling.terminated == ABANDONED_STALE and sibling.turns == [] and len(engine.calls) == 1

    announced = [0]
    engine = AnnouncingEngineDouble(tok, ["Who is it for?", "Draft."], announced, at=1, to=2)
    sim = SimClientDouble([SimReply(message="my sister")] * 3)
    traj = play(tok, engine, sim, task(max_new_turns=4), watch=StaleWatch(lambda: announced[0], max_staleness=2))
    assert traj.terminated == "max_new_turns" and len(traj.turns) == 2


def test_next_turn_skips_its_futures_once_its_group_can_no_longer_be_trained(tok):
    prefix = [ChatMessage("user", "help me"), ChatMessage("assistant", "With what?"), ChatMessage("user", "a toast")]
    announced = [5]
    engine = AnnouncingEngineDouble(tok, ["Who is it for?"], announced, at=1, to=6)
    sim = SimClientDouble([SimReply(message="my sister")] * 3)
    traj = play(
        tok,
        engine,
        sim,
        task(mode="next_turn", prefix=prefix, futures=3, future_turns=2),
        version_fn=lambda: 5,
        watch=StaleWatch(lambda: announced[0], max_staleness=0),
    )
    assert traj.terminated == ABANDONED_STALE and traj.futures == [] and len(engine.calls) == 1 and not sim.requests


class HangingEngineDouble(EngineDouble):
    """EngineDouble whose second generation never ends by itself: the learner announces `to` while it
    runs; records whether it was cancelled (vLLM aborts a cancelled request)."""

    def __init__(self, tok, texts, announced: list[int], to: int):
        super().__init__(tok, texts)
        self.announced, self.to, self.cancelled = announced, to, False

    async def generate(self, *a, **kw):
        out = await super().generate(*a, **kw)
        if len(self.calls) == 2:
            self.announced[0] = self.to
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return out


def test_a_generation_running_when_the_group_becomes_untrainable_is_cut_and_left_out(tok):
    announced = [0]
    engine = HangingEngineDouble(tok, ["Who is it for?", "A very long draft"], announced, to=1)
    sim = SimClientDouble([SimReply(message="my sister")] * 3)
    traj = play(tok, engine, sim, task(), watch=StaleWatch(lambda: announced[0], max_staleness=0))
    assert engine.cancelled and traj.terminated == ABANDONED_STALE
    assert [t.version for t in traj.turns] == [0] and [m.role for m in traj.messages][-1] == "user"
    assert len(sim.requests) == 1
    # the cut turn is not in the tokens: the trajectory still reads back as its messages
    msgs = [{"role": m.role, "content": m.content} for m in traj.messages]
    assert tok.decode(arrays.token_ids(traj).tolist()) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def _follower(tmp_path, version=0):
    """A real weights.follow.WeightFollower (no bus: nothing here reads it) over an engine at `version`:
    its `announced` setter and announcement() event are what the actor's StaleWatch waits on."""
    from parley.weights.follow import WeightFollower

    return WeightFollower(None, "r", types.SimpleNamespace(version=version), dest_root=tmp_path)


class HangingOnEventEngineDouble(EngineDouble):
    """EngineDouble whose second generation runs until cancelled; as it starts, `on_second()` runs
    (an announcement, a sibling's turn). Records whether it was cancelled."""

    def __init__(self, tok, texts, on_second):
        super().__init__(tok, texts)
        self.on_second, self.cancelled = on_second, False

    async def generate(self, *a, **kw):
        out = await super().generate(*a, **kw)
        if len(self.calls) == 2:
            await _hang_until_cancelled(self)
        return out


async def _hang_until_cancelled(double) -> None:
    """double.on_second(), then wait until cancelled (recorded in double.cancelled)."""
    double.on_second()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        double.cancelled = True
        raise


def _play_within(tok, engine, sim, t, watch, version_fn=lambda: 0, timeout_s=20.0):
    policy = PolicySettings(max_model_len=2048, model="tiny-double", actor="a1")
    return asyncio.run(
        asyncio.wait_for(
            run_conversation(engine, sim, t, 0, version_fn, tokenizer=tok, policy=policy, watch=watch), timeout_s
        )
    )


def test_a_generation_is_cut_when_the_announcement_arrives_not_at_the_next_poll(tok, tmp_path, monkeypatch):
    """With the follower's announcement event the cut does not wait for the watch's poll: the poll is
    an hour here, and the hanging generation is still cut (an hour-long wait would time out)."""
    monkeypatch.setattr(StaleWatch, "POLL_S", 3600.0)
    follower = _follower(tmp_path)
    fired = follower.announcement()

    def announce():
        follower.announced = 1

    engine = HangingOnEventEngineDouble(tok, ["Who is it for?", "A very long draft"], announce)
    sim = SimClientDouble([SimReply(message="my sister")] * 3)
    watch = StaleWatch(lambda: follower.announced, 0, changed=follower.announcement)
    traj = _play_within(tok, engine, sim, task(), watch)
    assert fired.is_set() and not follower.announcement().is_set()  # set once, then replaced
    assert engine.cancelled and traj.terminated == ABANDONED_STALE and [t.version for t in traj.turns] == [0]


def test_a_generation_is_cut_when_a_siblings_older_turn_dooms_the_group(tok, monkeypatch):
    """The learner is at version 1 and max_staleness 0; this sample's first turn is of version 1, and
    while its second runs a sibling trains a turn of version 0 (`saw(0)`): the group cannot be trained
    any more, and the running generation is cut then, not at the next poll (an hour here)."""
    monkeypatch.setattr(StaleWatch, "POLL_S", 3600.0)
    watch = StaleWatch(lambda: 1, 0)
    engine = HangingOnEventEngineDouble(tok, ["Who is it for?", "A very long draft"], lambda: watch.saw(0))
    sim = SimClientDouble([SimReply(message="my sister")] * 3)
    traj = _play_within(tok, engine, sim, task(), watch, version_fn=lambda: 1)
    assert engine.cancelled and traj.terminated == ABANDONED_STALE and [t.version for t in traj.turns] == [1]
    assert "lags the announced version 1 by 1 > max_staleness 0" in watch.why()


class HangingSimDouble(SimClientDouble):
    """SimClientDouble whose second request runs until cancelled; `on_second()` runs as it starts."""

    def __init__(self, replies, on_second):
        super().__init__(replies)
        self.on_second, self.cancelled = on_second, False

    async def ask(self, req):
        reply = await super().ask(req)
        if len(self.requests) == 2:
            await _hang_until_cancelled(self)
        return reply


def test_a_simulator_call_running_when_the_group_becomes_untrainable_is_cut(tok, tmp_path, monkeypatch):
    """The learner announces version 1 while the simulator answers the first assistant turn (version
    0, max_staleness 0): the call is cut, and the conversation ends on that assistant turn."""
    monkeypatch.setattr(StaleWatch, "POLL_S", 3600.0)
    follower = _follower(tmp_path)

    def announce():
        follower.announced = 1

    engine = EngineDouble(tok, ["Who is it for?", "Draft."])
    sim = HangingSimDouble([SimReply(message="a toast")] * 3, announce)
    t = task(prefix=[])  # the simulator opens: its second request answers the assistant's first turn
    traj = _play_within(tok, engine, sim, t, StaleWatch(lambda: follower.announced, 0, changed=follower.announcement))
    assert sim.cancelled and traj.terminated == ABANDONED_STALE
    assert [m.role for m in traj.messages][-2:] == ["user", "assistant"] and len(engine.calls) == 1
    assert_consistent(tok, traj)


def test_the_stop_and_cut_lines_are_the_ones_part_ps_breakdown_counts(tok, tmp_path, monkeypatch, caplog):
    """bench/peer_compare.py counts stopped conversations and cut calls from the actor's log: the lines
    rollout.conversation writes for a boundary stop, a cut generation and a cut simulator call must
    be the ones it counts, one each."""
    import logging

    from bench import peer_compare

    monkeypatch.setattr(StaleWatch, "POLL_S", 3600.0)
    caplog.set_level(logging.INFO, logger="parley.rollout")
    announced = [0]
    engine = AnnouncingEngineDouble(tok, ["Who is it for?", "Draft."], announced, at=1, to=2)
    play(
        tok,
        engine,
        SimClientDouble([SimReply(message="my sister")] * 3),
        task(),
        watch=StaleWatch(lambda: announced[0], max_staleness=1),
    )  # stopped at the boundary
    follower = _follower(tmp_path)

    def announce():
        follower.announced += 1

    watch = StaleWatch(lambda: follower.announced, 0, changed=follower.announcement)
    engine = HangingOnEventEngineDouble(tok, ["Who is it for?", "A very long draft"], announce)
    _play_within(tok, engine, SimClientDouble([SimReply(message="my sister")] * 3), task(), watch)  # turn cut
    watch = StaleWatch(lambda: follower.announced - 1, 0, changed=follower.announcement)
    sim = HangingSimDouble([SimReply(message="a toast")] * 3, announce)
    _play_within(tok, EngineDouble(tok, ["Who is it for?"]), sim, task(prefix=[]), watch)  # simulator call cut
    counts = peer_compare.step_breakdown([], [r.getMessage() for r in caplog.records])
    assert (counts["conversations_stopped"], counts["generations_cut"], counts["simulator_calls_cut"]) == (1, 1, 1)


class RecordingJudgeDouble:
    """Test double of rollout.judge.Judge: records the messages of every call, answers a fixed verdict."""

    def __init__(self):
        self.seen: list[tuple[str, list[ChatMessage]]] = []

    async def ask(self, op, messages, *, seed=0):
        from parley.protocol.messages import JudgeReply

        self.seen.append((op, list(messages)))
        last = next(m.content for m in reversed(messages) if m.role == "assistant")
        raw = (
            f'{{"document": "{last}"}}'
            if op == "extract"
            else '{"understanding": 1, "clarification": 1, "suggestions": 1}'
        )
        levels = {} if op == "extract" else {"understanding": 1, "clarification": 1, "suggestions": 1}
        return JudgeReply(ok=True, raw=raw, document=last, levels=levels, model="judge-double")


def test_a_next_turn_sample_is_judged_with_its_conversation_once_per_future(tok):
    """The actor stores each future as the whole branch (the conversation, then its own messages); the
    judge must see the conversation once, followed by the future's own messages."""
    from parley.config.scorer import ScorerConfig
    from parley.rollout.score import conversations, score_trajectory

    prefix = [ChatMessage("user", "help me"), ChatMessage("assistant", "With what?"), ChatMessage("user", "a toast")]
    engine = EngineDouble(tok, ["Who is it for?", "Draft one.", "Draft two."])
    sim = SimClientDouble([SimReply(message="my sister"), SimReply(message="my friend")])
    traj = play(tok, engine, sim, task(mode="next_turn", prefix=prefix, futures=2, future_turns=2))
    main = list(traj.messages)
    own = sorted(([m.content for m in conv[len(main) :]] for conv, _ in conversations(traj)))
    assert own == [["my friend", "Draft two."], ["my sister", "Draft one."]]
    judge = RecordingJudgeDouble()
    asyncio.run(score_trajectory(traj, judge, ScorerConfig()))
    assert len(judge.seen) == 4  # extract and interactivity on each of the 2 futures
    for _, messages in judge.seen:
        assert messages[: len(main)] == main and len(messages) == len(main) + 2
        assert [m.role for m in messages[len(main) :]] == ["user", "assistant"]
    # the recipe's token_amount counts the words the sample added: the trained turn ("Who is it for?", 4)
    # and each future's own two messages (4), not the conversation a second time
    scored = asyncio.run(score_trajectory(traj, judge, ScorerConfig(token_amount="future_words")))
    assert scored.metrics["token_amount"] == 8.0
