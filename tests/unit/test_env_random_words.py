"""random_words: the reward's values by hand, its spread over random text within a group of 8, the
user's messages (lengths, determinism, when it is done), items and split from the seed, the
environment by name through the registry and `parley up --env random_words --dry-run`, and groups
played through the actor's conversation loop with a policy double that samples uniform random
token ids, on random_qwen3's word-level tokenizer and on the toy model's BPE one."""

from __future__ import annotations

import asyncio
import random
import statistics
import tomllib
import zlib

import pytest

from parley.config.learner import DataConfig, RolloutConfig
from parley.environments import registry
from parley.environments.base import Conversation, LocalUser, find_overlap
from parley.environments.random_words import NAME, PRESET, THANKS, USER_VOCAB, environment, generate, is_low, respond
from parley.evaluation.leakage import guard_environment
from parley.protocol.messages import ChatMessage
from parley.rewards.reward import total_reward

LOW, HIGH = "t0", "t2"  # crc32 "t0" = 0x2c539ea1, "t2" = 0xc25dff8d: below and above 2^31


def user(text):
    return ChatMessage("user", text)


def assistant(text):
    return ChatMessage("assistant", text)


# ---- the reward, by hand ---------------------------------------------------------------------


def test_low_words_are_the_ones_whose_crc32_is_below_the_threshold():
    assert zlib.crc32(LOW.encode()) < 2**31 <= zlib.crc32(HIGH.encode())
    assert is_low(LOW, 0.5) and not is_low(HIGH, 0.5) and is_low(HIGH, 0.99) and not is_low(LOW, 0.1)
    # any vocabulary: about `threshold` of its words are low
    for threshold in (0.25, 0.5):
        share = sum(is_low(f"t{i}", threshold) for i in range(USER_VOCAB)) / USER_VOCAB
        assert share == pytest.approx(threshold, abs=0.002)


def test_reward_values_by_hand():
    env = environment(n_items=4)
    assert env.reward.default_weights() == {"low_share": 1.0}
    conv = Conversation(
        [user(f"{LOW} {LOW} {LOW}"), assistant(f"{LOW} {HIGH}\n{HIGH} {HIGH}"), user(LOW), assistant(f"  {LOW}  ")]
    )
    m = env.reward.evaluate(conv)
    assert m == {"low_share": pytest.approx(2 / 5), "assistant_words": 5.0}  # the user's words do not count
    assert total_reward(m, env.reward.default_weights()) == pytest.approx(0.4)
    assert env.reward.evaluate(Conversation([user(LOW), assistant("")])) == {"low_share": 0.0, "assistant_words": 0.0}
    # the threshold moves the line: at 0.99 "t2" is low too
    assert environment(n_items=4, threshold=0.99).reward.evaluate(conv)["low_share"] == 1.0
    # any text is words: punctuation and special tokens as written count as words of their own
    text = "Hello, world <|im_end|>"
    words = text.split()
    expected = sum(is_low(w, 0.5) for w in words) / len(words)
    assert env.reward.evaluate(Conversation([user("."), assistant(text)]))["low_share"] == pytest.approx(expected)


def test_bad_options_are_refused_with_the_range():
    with pytest.raises(ValueError, match=r"options.threshold=1.0 must be in \(0, 1\)"):
        environment(threshold=1.0)
    with pytest.raises(ValueError, match=r"options.turns=0 and user_words=64 must both be >= 1"):
        environment(turns=0)
    with pytest.raises(ValueError, match=r"options.n_items=0 must be >= 1"):
        environment(n_items=0)


# ---- the user --------------------------------------------------------------------------------


def test_the_user_says_user_words_seeded_words_per_turn_until_the_assistant_spoke_turns_times():
    hidden = "s0-00001"
    kw = dict(turns=3, user_words=50)
    opening = respond([], hidden, **kw)
    words = opening.message.split()
    assert not opening.done and len(words) == 50
    assert all(w[0] == "t" and 0 <= int(w[1:]) < USER_VOCAB for w in words)
    assert respond([], hidden, **kw) == opening  # pure: a redelivered task replays the same conversation
    assert respond([], "s0-00002", **kw) != opening  # another item, other words
    said = [user(opening.message), assistant("t1 t2")]
    second = respond(said, hidden, **kw)
    assert len(second.message.split()) == 50 and second.message != opening.message
    # the turn is what the user answers, not what the assistant said
    assert respond([user(opening.message), assistant("t9")], hidden, **kw) == second
    third = respond(said + [user(second.message), assistant("t3")], hidden, **kw)
    assert not third.done and third.message not in (opening.message, second.message)
    done = respond(said + [user(second.message), assistant("t3"), user(third.message), assistant("t4")], hidden, **kw)
    assert done.done and done.message == THANKS


# ---- data: seed, split, tasks ----------------------------------------------------------------


def test_items_and_split_come_from_the_seed():
    assert generate(20, seed=3) == generate(20, seed=3) and generate(20, seed=3) != generate(20, seed=4)
    env = environment(n_items=100, seed=1)
    train, held = env.tasks.train_eval(DataConfig(eval_fraction=0.2, split_seed=5))
    assert (len(train), len(held)) == (80, 20) and (train, held) == env.tasks.train_eval(
        DataConfig(eval_fraction=0.2, split_seed=5)
    )
    # the leakage guard: one key kind, reported only, never shared by this split
    assert env.tasks.leaks == () and find_overlap(env.tasks, train, held) == {"item": []}
    assert guard_environment(env.tasks, train, held, allow=False, run_dir=None) == {"item": []}
    # an item on both sides (a split not made by item) is reported, never refused: no label can leak
    assert guard_environment(env.tasks, train, held + train[:1], allow=False, run_dir=None)["item"] == [
        (train[0].item_id, train[0].item_id)
    ]
    with pytest.raises(ValueError, match=f"{NAME} draws its items from a seed"):
        env.tasks.train_eval(DataConfig(path="data.jsonl"))


def test_a_task_opens_with_the_users_words_and_carries_the_item_as_the_hidden_state():
    env = environment(n_items=4, user_words=40)
    item = generate(4, seed=0)[2]
    rollout = RolloutConfig(max_new_turns=5, max_tokens=384)
    t = env.tasks.task(item, run="r", task_id="r-g000001", n=8, rollout=rollout, seed=11, version=3)
    assert t.prefix == [user(env.user.respond([], item.item_id).message)] and len(t.prefix[0].content.split()) == 40
    assert (t.reference, t.item_id, t.system_prompt, t.sim_prompt) == (item.item_id, item.item_id, "", NAME)
    assert (t.n, t.max_new_turns, t.max_tokens, t.admitted_version) == (8, 5, 384, 3)
    assert not env.needs_judge and not env.needs_simulator
    e = env.eval_task(item, run="r", task_id="eval/x/0", n=1, rollout=rollout, seed=0, version=0)
    assert e.split == "eval" and (e.prefix, e.reference) == (t.prefix, t.reference)
    assert env.eval.select == "low_share" and env.eval.columns == ("low_share", "assistant_words")


# ---- by name ---------------------------------------------------------------------------------


def test_it_loads_through_the_registry_by_name_with_its_options():
    env = registry.load(NAME, {"n_items": 10, "seed": 2, "turns": 4, "user_words": 8, "threshold": 0.25})
    assert env.name == NAME and env.preset == PRESET
    assert len(env.tasks.train_eval(DataConfig(eval_fraction=0.2))[0]) == 8
    assert len(env.user.respond([], "x").message.split()) == 8
    assert registry.record(NAME).entry_point == "parley.environments.random_words:environment"


def test_up_env_random_words_dry_run_takes_the_preset():
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    out = CliRunner().invoke(app, ["up", "--env", NAME, "--dry-run"])
    assert out.exit_code == 0, out.output
    assert f"environment {NAME}'s preset" in out.stderr
    dumped = tomllib.loads(out.stdout)
    assert dumped["env"] == {
        "name": NAME,
        "options": {"n_items": 200, "seed": 0, "turns": 3, "user_words": 32, "threshold": 0.5},
    }
    assert dumped["scorer"]["weights"] == {"low_share": 1.0} and dumped["learner"]["eval_metric"] == "low_share"
    assert (dumped["rollout"]["n"], dumped["rollout"]["max_new_turns"], dumped["learner"]["steps"]) == (8, 5, 10)


# ---- played by the actor's loop, with random text --------------------------------------------


class RandomEngine:
    """Test double of engines.engine.PolicyEngine.generate: max_tokens uniform random ids of `ids`,
    seeded by the request's seed; it never ends a turn itself (a random 151,936-token model rarely
    samples its end-of-turn token)."""

    def __init__(self, ids: range | list[int]):
        self.ids = list(ids)

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop_token_ids=None):
        from parley.engines.engine import GenOut

        rng = random.Random(seed)
        ids = [rng.choice(self.ids) for _ in range(max_tokens)]
        return GenOut(ids, [-12.0] * len(ids), "length", "")


def play_group(env, tok, ids, *, n=8, max_tokens=384, turns=3):
    from parley.rollout.conversation import PolicySettings, run_conversation

    item = env.tasks.train_eval(DataConfig(eval_fraction=0.0))[0][0]
    # the opening is the prefix; 2 x turns - 1 new messages are the conversation, one more lets the user end it
    rollout = RolloutConfig(max_new_turns=2 * turns + 1, max_tokens=max_tokens)
    task = env.tasks.task(item, run="r", task_id="r-g000001", n=n, rollout=rollout, seed=7, version=0)

    async def group():
        return await asyncio.gather(
            *(
                run_conversation(
                    RandomEngine(ids),
                    LocalUser(env.user),
                    task,
                    k,
                    lambda: 0,
                    tokenizer=tok,
                    policy=PolicySettings(max_model_len=8192),
                )
                for k in range(n)
            )
        )

    return asyncio.run(group())


@pytest.fixture(scope="module")
def word_tok():
    from bench.common import word_tokenizer

    return word_tokenizer()


def test_a_group_of_random_text_on_the_word_tokenizer_has_exact_lengths_and_spread_rewards(word_tok):
    from bench.common import QWEN3_PAD

    env = environment(n_items=4, turns=3, user_words=64)
    trajs = play_group(env, word_tok, range(QWEN3_PAD))  # every "t<id>" word
    for traj in trajs:
        assert traj.terminated == "sim_done" and [m.role for m in traj.messages] == ["user", "assistant"] * 3
        # a word is a token: 3 x (user: <|im_start|> user, 64 words, <|im_end|>; assistant: <|im_start|>
        # assistant, 384 sampled, <|im_end|> closing the cut turn)
        assert traj.prompt_tokens == 64 + 5 and traj.assistant_tokens == 3 * 384
        assert len(traj.token_ids_i32) // 4 == 3 * (64 + 3) + 3 * (384 + 3)
        assert all(len(m.content.split()) == (64 if m.role == "user" else 384) for m in traj.messages)
    assert len({traj.messages[0].content for traj in trajs}) == 1  # one task: one opening for the group
    assert len({traj.messages[2].content for traj in trajs}) == 1  # ... and the same words every turn
    rewards = [env.reward.evaluate(traj)["low_share"] for traj in trajs]
    # 1152 words of random text: about half are low, spread 0.5 / sqrt(1152) = 0.0147 between samples
    assert statistics.mean(rewards) == pytest.approx(0.5, abs=0.03)
    assert len(set(rewards)) == 8 and 0.007 < statistics.stdev(rewards) < 0.03, rewards


def test_a_group_of_random_text_on_the_toy_models_bpe_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    env = environment(n_items=4, turns=2, user_words=16)
    trajs = play_group(
        env, tok, [i for i in range(len(tok)) if i not in set(tok.all_special_ids)], turns=2, max_tokens=128
    )
    for traj in trajs:
        assert traj.terminated == "sim_done" and traj.assistant_tokens == 2 * 128
        assert len(traj.messages[0].content.split()) == 16 and traj.prompt_tokens > 16  # BPE splits "t123"
    rewards = [env.reward.evaluate(traj)["low_share"] for traj in trajs]
    assert 0.3 < statistics.mean(rewards) < 0.7 and statistics.stdev(rewards) > 0.01, rewards
