"""hidden_goal: the programmatic user answers truthfully and only what was asked, the reward's
values by hand, goals and split determined by the seed, no goal on both sides of the split, and
one conversation played by the actor's own loop with the user in-process."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from parley.config.learner import DataConfig, RolloutConfig
from parley.environments.base import LocalUser, find_overlap, leaking
from parley.environments.hidden_goal import (
    NAME,
    TURN_COST,
    Goal,
    all_goals,
    environment,
    generate,
    respond,
    system_prompt,
    world,
)
from parley.protocol.messages import ChatMessage
from parley.rewards.reward import total_reward
from tests import factories

PIZZA = Goal("pizza", (("size", "large"), ("crust", "thin"), ("topping", "ham")))


def user(text):
    return ChatMessage("user", text)


def assistant(text):
    return ChatMessage("assistant", text)


def conv(*messages, goal=PIZZA):
    return factories.trajectory(
        "r",
        "t",
        0,
        item_id=goal.item_id,
        messages=list(messages),
        token_ids=[],
        loss_mask=[],
        turns=[],
        reference=goal.hidden(),
    )


def answered(reply: str) -> dict[str, str]:
    """'size: large, crust: thin.' -> {'size': 'large', 'crust': 'thin'}"""
    return dict(part.split(": ", 1) for part in reply.rstrip(".").split(", "))


# ---- the user --------------------------------------------------------------------------------


def test_the_user_answers_every_question_truthfully_and_nothing_more():
    for goal in all_goals():
        domain = world().domains[goal.domain]
        names = [s.name for s in domain.slots]
        for k in range(1, len(names) + 1):
            for asked in itertools.combinations(names, k):
                question = "What " + " and what ".join(asked) + " would you like?"
                turn = respond([user(domain.opening), assistant(question)], goal.hidden())
                assert not turn.done
                expected = {n: v for n, v in goal.values if n in asked}
                assert answered(turn.message) == expected, (goal, question, turn.message)


def test_the_user_opens_nudges_and_stops_at_the_final_answer():
    hidden = PIZZA.hidden()
    assert respond([], hidden).message == "I want to order a pizza."
    assert (
        respond([user("I want to order a pizza."), assistant("Sure, happy to help!")], hidden).message == world().nudge
    )
    # a value or a cue word is a question about its slot too
    assert answered(respond([assistant("Thin or stuffed?")], hidden).message) == {"crust": "thin"}
    assert answered(respond([assistant("Anything on top?")], hidden).message) == {"topping": "ham"}
    done = respond([assistant("FINAL: size=large, crust=thin, topping=ham")], hidden)
    assert done.done and done.message == world().thanks
    # the user answers the assistant's last message, not an earlier one
    assert (
        respond([assistant("What size?"), user("size: large."), assistant("Great.")], hidden).message == world().nudge
    )


def test_a_hidden_state_that_is_not_a_goal_is_named():
    with pytest.raises(ValueError, match="hidden state 'a lisbon blog post' is not a hidden_goal goal"):
        respond([assistant("What size?")], "a lisbon blog post")


# ---- the reward, by hand ---------------------------------------------------------------------


def test_reward_values_by_hand():
    env = environment(n_items=4)
    weights = env.reward.default_weights()
    assert weights == {"goal_match": 1.0, "assistant_turns": -TURN_COST}

    ask_all = assistant("Which size, crust and topping?")
    best = conv(
        user("I want to order a pizza."),
        ask_all,
        user("size: large, crust: thin, topping: ham."),
        assistant("FINAL: size=large, crust=thin, topping=ham"),
    )
    m = env.reward.evaluate(best)
    assert m == {"goal_match": 1.0, "exact": 1.0, "assistant_turns": 2.0}
    assert total_reward(m, weights) == pytest.approx(1.0 - 2 * 0.05)  # 0.9

    # guessing at once: one turn, one slot of three right
    guess = conv(user("I want to order a pizza."), assistant("FINAL: size=large, crust=thick, topping=olive"))
    m = env.reward.evaluate(guess)
    assert m == {"goal_match": pytest.approx(1 / 3), "exact": 0.0, "assistant_turns": 1.0}
    assert total_reward(m, weights) == pytest.approx(1 / 3 - 0.05)

    # one question per turn: right, but four turns
    slow = conv(
        user("."),
        assistant("Size?"),
        user("size: large."),
        assistant("Crust?"),
        user("crust: thin."),
        assistant("Topping?"),
        user("topping: ham."),
        assistant("FINAL: size=large, crust=thin, topping=ham"),
    )
    assert total_reward(env.reward.evaluate(slow), weights) == pytest.approx(1.0 - 4 * 0.05)


@pytest.mark.parametrize(
    "last, match",
    [
        ("Final: Size = Large; Crust: THIN; topping=ham.", 1.0),  # case, spacing, separators and a full stop
        ("FINAL: size=large, size=small, crust=thin, topping=ham", 2 / 3),  # a hedged slot is wrong
        ("FINAL: crust=thin", 1 / 3),  # a missing slot is wrong
        ("size=large, crust=thin, topping=ham", 0.0),  # no final line: no answer
        ("FINAL: size=large, crust=thin, topping=ham, sauce=tomato", 1.0),  # an extra key costs nothing
    ],
)
def test_final_answer_parsing(last, match):
    env = environment(n_items=4)
    assert env.reward.evaluate(conv(user("."), assistant(last)))["goal_match"] == pytest.approx(match)


def test_only_the_last_assistant_message_counts():
    env = environment(n_items=4)
    c = conv(user("."), assistant("FINAL: size=large, crust=thin, topping=ham"), user("Thanks."), assistant("Bye."))
    assert env.reward.evaluate(c)["goal_match"] == 0.0


# ---- data: seed, split, tasks ----------------------------------------------------------------


def test_goals_are_determined_by_the_seed():
    assert generate(50, seed=7) == generate(50, seed=7)
    assert generate(50, seed=7) != generate(50, seed=8)
    assert len({g.item_id for g in generate(203, seed=1)}) == 203 == len(all_goals())
    with pytest.raises(ValueError, match=r"n_items=204 must be in 1..203"):
        generate(204, seed=0)
    a = environment(n_items=60, seed=5).tasks.train_eval(DataConfig(split_seed=2))
    b = environment(n_items=60, seed=5).tasks.train_eval(DataConfig(split_seed=2))
    assert a == b


@pytest.mark.parametrize("seed, split_seed", [(0, 0), (1, 3), (9, 9)])
def test_the_split_shares_no_goal(seed, split_seed):
    env = environment(n_items=120, seed=seed)
    train, held = env.tasks.train_eval(DataConfig(eval_fraction=0.25, split_seed=split_seed))
    assert len(held) == 30 and len(train) == 90
    assert not {g.hidden() for g in train} & {g.hidden() for g in held}
    assert find_overlap(env.tasks, train, held) == {"goal": []} and leaking(env.tasks, train, held) == {}


def test_data_files_are_refused_with_the_fix():
    env = environment(n_items=10)
    with pytest.raises(ValueError, match="hidden_goal draws its goals from a seed; leave \\[data\\] path = 'bundled'"):
        env.tasks.train_eval(DataConfig(path="my.jsonl"))


def test_a_task_carries_the_opening_and_the_hidden_goal():
    env = environment(n_items=4)
    rollout = RolloutConfig(max_new_turns=8)
    t = env.tasks.task(PIZZA, run="r", task_id="r-g000001", n=4, rollout=rollout, seed=11, version=3)
    assert t.prefix == [user("I want to order a pizza.")]
    assert json.loads(t.reference) == {"domain": "pizza", "goal": {"size": "large", "crust": "thin", "topping": "ham"}}
    assert t.system_prompt == system_prompt(world().domains["pizza"])
    assert "FINAL: size=<size>, crust=<crust>, topping=<topping>" in t.system_prompt
    assert (t.sim_prompt, t.item_id, t.n, t.max_new_turns, t.admitted_version) == (
        NAME,
        "pizza/large.thin.ham",
        4,
        8,
        3,
    )
    assert not env.needs_judge and not env.needs_simulator
    # the benchmark plays a held-out goal exactly as training plays one
    e = env.eval_task(PIZZA, run="r", task_id="eval/x/0", n=1, rollout=rollout, seed=0, version=0)
    assert e.split == "eval" and (e.prefix, e.reference, e.system_prompt) == (t.prefix, t.reference, t.system_prompt)


# ---- played by the actor's loop --------------------------------------------------------------


class ScriptedEngine:
    """Test double of engines.engine.PolicyEngine.generate: says the scripted texts in order."""

    def __init__(self, tok, texts):
        self.tok, self.texts = tok, list(texts)
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop_token_ids=None):
        from parley.engines.engine import GenOut

        text = self.texts.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False) + [self.end]
        return GenOut(ids, [-0.1] * len(ids), "stop", text)


def test_the_actor_loop_plays_the_user_in_process(tiny_model):
    from transformers import AutoTokenizer

    from parley.rollout.conversation import PolicySettings, run_conversation

    tok = AutoTokenizer.from_pretrained(tiny_model)
    env = environment(n_items=4)
    task = env.tasks.task(PIZZA, run="r", task_id="t", n=2, rollout=RolloutConfig(max_new_turns=8), seed=1, version=0)
    engine = ScriptedEngine(tok, ["What size, crust and topping?", "FINAL: size=large, crust=thin, topping=ham"])
    traj = asyncio.run(
        run_conversation(
            engine, LocalUser(env.user), task, 0, lambda: 0, tokenizer=tok, policy=PolicySettings(max_model_len=2048)
        )
    )
    assert traj.terminated == "sim_done"
    assert [m.content for m in traj.messages if m.role == "user"] == [
        "I want to order a pizza.",
        "size: large, crust: thin, topping: ham.",
    ]
    assert env.reward.evaluate(traj) == {"goal_match": 1.0, "exact": 1.0, "assistant_turns": 2.0}


# ---- the options: nudge = "slots", answer = "mentions" ---------------------------------------


def test_the_default_options_are_the_plain_world():
    env = environment(n_items=4)
    said = [user("I want to order a pizza."), assistant("A large thin ham pizza, then.")]
    # the plain world reads a message naming values as a question about those slots, and rewards no final line
    assert answered(env.user.respond(said, PIZZA.hidden()).message) == {
        "size": "large",
        "crust": "thin",
        "topping": "ham",
    }
    assert env.reward.evaluate(conv(*said))["goal_match"] == 0.0
    assert env.user.respond([user("."), assistant("Hello!")], PIZZA.hidden()).message == "What do you need to know?"


def test_the_slots_nudge_names_the_slots_not_asked_yet():
    hidden = PIZZA.hidden()
    nudge = dict(nudge="slots")
    assert (
        respond([user("I want to order a pizza."), assistant("Hello!")], hidden, **nudge).message
        == "Ask me about the size, crust and topping."
    )
    assert (
        respond([assistant("What size?"), user("size: large."), assistant("Great.")], hidden, **nudge).message
        == "Ask me about the crust and topping."
    )
    assert (
        respond(
            [assistant("Size and crust?"), user("size: large, crust: thin."), assistant("Great.")], hidden, **nudge
        ).message
        == "Ask me about the topping."
    )
    # every slot was asked about: the plain nudge; a question is still answered as in the plain world
    asked_all = [assistant("Size, crust, topping?"), user("size: large, crust: thin, topping: ham."), assistant("Ok.")]
    assert respond(asked_all, hidden, **nudge).message == world().nudge
    assert answered(respond([assistant("What crust?")], hidden, **nudge).message) == {"crust": "thin"}


@pytest.mark.parametrize(
    "last, match",
    [
        ("A large pizza, thin crust, ham.", 1.0),
        ("FINAL: size=large, crust=thin, topping=ham", 1.0),  # a final line is words too
        ("Large or small? Thin crust with ham.", 2 / 3),  # two sizes named: the size is wrong
        ("A large thin-crust pizza with ham.", 2 / 3),  # 'thin-crust' is one word, not 'thin'
        ("A medium thick pizza with olive.", 0.0),
        ("What would you like?", 0.0),
    ],
)
def test_mentions_answer_by_hand(last, match):
    env = environment(n_items=4, answer="mentions")
    assert env.reward.evaluate(conv(user("."), assistant(last)))["goal_match"] == pytest.approx(match)


def test_a_value_inside_a_longer_value_is_not_a_rival():
    shirt = Goal("t-shirt", (("color", "red"), ("size", "extra large"), ("material", "cotton")))
    env = environment(n_items=4, answer="mentions")

    def match(text):
        return env.reward.evaluate(conv(user("."), assistant(text), goal=shirt))["goal_match"]

    assert match("A red extra large cotton t-shirt.") == 1.0
    assert match("A red large cotton t-shirt.") == pytest.approx(2 / 3)
    assert match("Red, cotton: large or extra large?") == pytest.approx(2 / 3)  # two sizes named


def test_under_mentions_a_message_naming_one_value_per_slot_ends_the_conversation():
    hidden, opts = PIZZA.hidden(), dict(answer="mentions")
    done = respond([user("."), assistant("A large thin ham pizza, then.")], hidden, **opts)
    assert done.done and done.message == world().thanks
    assert respond([assistant("FINAL: size=large")], hidden, **opts).done  # a final line still ends it
    # two values of a slot, or a slot not named: a question, answered as in the plain world
    assert answered(respond([assistant("Large or small, thin, ham?")], hidden, **opts).message) == {
        "size": "large",
        "crust": "thin",
        "topping": "ham",
    }
    assert answered(respond([assistant("A large thin one?")], hidden, **opts).message) == {
        "size": "large",
        "crust": "thin",
    }


def test_reward_under_mentions_by_hand():
    env = environment(n_items=4, nudge="slots", answer="mentions")
    weights = env.reward.default_weights()
    assert weights == {"goal_match": 1.0, "assistant_turns": -TURN_COST}  # the same reward terms
    c = conv(
        user("I want to order a pizza."),
        assistant("Hello!"),
        user("Ask me about the size, crust and topping."),
        assistant("Which size, crust and topping?"),
        user("size: large, crust: thin, topping: ham."),
        assistant("A large pizza, thin crust, topping ham, coming up."),
    )
    m = env.reward.evaluate(c)
    assert m == {"goal_match": 1.0, "exact": 1.0, "assistant_turns": 3.0}
    assert total_reward(m, weights) == pytest.approx(1.0 - 3 * 0.05)  # 0.85


def test_unknown_option_values_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"options.answer='json' is not one of \('final', 'mentions'\)"):
        environment(answer="json")
    with pytest.raises(ValueError, match=r"options.nudge='loud' is not one of \('fixed', 'slots'\)"):
        environment(nudge="loud")


def test_the_options_resolve_through_the_registry_and_the_actor_loop(tiny_model):
    from transformers import AutoTokenizer

    from parley.environments import registry
    from parley.rollout.conversation import PolicySettings, run_conversation

    tok = AutoTokenizer.from_pretrained(tiny_model)
    env = registry.load(NAME, {"n_items": 4, "nudge": "slots", "answer": "mentions"})
    task = env.tasks.task(PIZZA, run="r", task_id="t", n=1, rollout=RolloutConfig(max_new_turns=8), seed=1, version=0)
    engine = ScriptedEngine(tok, ["Hello! How can I help?", "Size, crust, topping?", "Large, thin, ham. Coming up!"])
    traj = asyncio.run(
        run_conversation(
            engine, LocalUser(env.user), task, 0, lambda: 0, tokenizer=tok, policy=PolicySettings(max_model_len=2048)
        )
    )
    assert traj.terminated == "sim_done"
    assert [m.content for m in traj.messages if m.role == "user"] == [
        "I want to order a pizza.",
        "Ask me about the size, crust and topping.",
        "size: large, crust: thin, topping: ham.",
    ]
    assert env.reward.evaluate(traj) == {"goal_match": 1.0, "exact": 1.0, "assistant_turns": 3.0}
