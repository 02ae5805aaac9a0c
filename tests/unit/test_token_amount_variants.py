"""[scorer] token_amount: the paper's count (assistant tokens / 1000) and verl's recipe count (words
after the dataset prefix, user and assistant, unscaled), each selected by name."""

import pytest

from parley.config.run import ConfigError, load_config
from parley.environments import collabllm
from parley.environments.base import Conversation
from parley.protocol.messages import ChatMessage, FutureRollout, Trajectory
from parley.rewards.reward import total_reward
from parley.rollout.score import new_from


def _amount(env, conv):
    (metric,) = [m for m in env.reward.metrics if m.name == "token_amount"]
    return metric.compute(conv)


def _conv(new_from=0):
    msgs = [
        ChatMessage("user", "write me a memo"),  # the dataset prefix
        ChatMessage("assistant", "Who reads it?"),  # the trained turn: 3 words
        ChatMessage("user", "the whole team please"),  # 4
        ChatMessage("assistant", "Here is a short draft."),  # 5
    ]
    return Conversation(messages=msgs, reference="ref", assistant_tokens=1500, new_from=new_from)


def test_the_default_is_the_papers_assistant_tokens_in_thousands():
    assert load_config().scorer.token_amount == "assistant_tokens_k"
    assert _amount(collabllm.environment(), _conv(new_from=1)) == 1.5


def test_future_words_counts_every_message_after_the_prefix_unscaled():
    env = collabllm.environment(token_amount="future_words")
    assert _amount(env, _conv(new_from=1)) == 12.0
    assert _amount(env, _conv(new_from=0)) == 16.0


def test_the_recipe_clamp_saturates_the_word_count_at_minus_one():
    # verl clamps the weighted term to [-1, 1]; at weight -0.1 that is the metric clamped to [0, 10]
    metrics = {"bleu": 0.5, "interactivity": 1.0, "token_amount": 250.0}
    weights = {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1}
    assert total_reward(metrics, weights, {"token_amount": (0.0, 10.0)}) == pytest.approx(0.5)


def test_new_from_is_the_trained_turn_in_next_turn_mode_and_the_first_reply_in_conversation_mode():
    msgs = [
        ChatMessage("user", "a"),
        ChatMessage("assistant", "b"),
        ChatMessage("user", "c"),
        ChatMessage("assistant", "d"),
    ]
    base = dict(traj_id="t/0", task_id="t", sample=0, run="r", item_id="i", messages=msgs, turns=[])
    assert new_from(Trajectory(**base, mode="next_turn", futures=[FutureRollout(messages=[])])) == 3
    assert new_from(Trajectory(**base, mode="conversation")) == 1


def test_an_unknown_variant_is_refused_with_the_allowed_names():
    with pytest.raises(ConfigError, match="token_amount.*assistant_tokens_k.*future_words"):
        load_config(overrides=['scorer.token_amount="words"'])


def test_single_quotes_write_the_documents_double_quotes_as_single_before_bleu():
    from parley.protocol.messages import JudgeReply

    reference = "She said 'go' and left."
    reply = JudgeReply(ok=True, document='She said "go" and left.')
    conv = Conversation(messages=[ChatMessage("assistant", "x")], reference=reference)
    keep, single = (collabllm.environment(bleu_variant="char", extract_quotes=q) for q in ("keep", "single"))
    bleu = {id(env): next(m for m in env.reward.metrics if m.name == "bleu") for env in (keep, single)}
    assert bleu[id(single)].value(reply, conv) == pytest.approx(1.0)
    assert bleu[id(keep)].value(reply, conv) < 1.0
