"""The judge without a model: transcript rendering and truncation, verdict parsing, retries with a
backend test double, and the request/reply routes' error replies."""

from __future__ import annotations

import json
import math

import pytest

from parley.config.scorer import JudgeConfig
from parley.protocol import codec, topology
from parley.protocol.messages import ChatMessage, JudgeReply, JudgeRequest
from parley.rewards.metrics import INTERACTIVITY_KEYS
from parley.services.judge.server import (
    EXPECTED_TOP_LOGPROBS,
    SCHEMAS,
    Judge,
    error_reply,
    judge_routes,
    level_distribution,
    load_prompts,
    parse_verdict,
    render_conversation,
)

CONV = [
    ChatMessage("system", "You are a helpful assistant."),
    ChatMessage("user", "write me a blog post about lisbon"),
    ChatMessage("assistant", "Happy to. Who is it for, and how long should it be?"),
    ChatMessage("user", "friends, short"),
    ChatMessage("assistant", "A Week in Lisbon\n\nThe trams climb the hills."),
]


def test_render_labels_roles_and_leaves_out_the_system_prompt():
    text = render_conversation(CONV)
    assert text.startswith("USER: write me a blog post about lisbon\n\nASSISTANT: Happy to.")
    assert text.endswith("ASSISTANT: A Week in Lisbon\n\nThe trams climb the hills.")
    assert "helpful assistant" not in text


def test_truncation_keeps_the_newest_turns_and_the_opening_request():
    long_middle = CONV[:2] + [ChatMessage("assistant", "x" * 500), ChatMessage("user", "y" * 500)] + CONV[3:]
    full = render_conversation(long_middle)
    text = render_conversation(long_middle, max_tokens=200)
    assert len(text) <= 200 < len(full)
    assert text.startswith("USER: write me a blog post about lisbon")
    assert "[... 2 earlier messages left out ...]" in text
    assert text.endswith("ASSISTANT: A Week in Lisbon\n\nThe trams climb the hills.")


def test_truncation_without_room_for_the_opening():
    msgs = [ChatMessage("user", "u" * 300), ChatMessage("assistant", "a" * 50), ChatMessage("user", "b" * 50)]
    text = render_conversation(msgs, max_tokens=170)
    assert len(text) <= 170
    assert text.startswith("[... 1 earlier message left out ...]\n\nASSISTANT: aaa") and text.endswith("b" * 50)


def test_a_single_overlong_message_keeps_its_beginning():
    msgs = [ChatMessage("user", "hi"), ChatMessage("assistant", "TITLE\n\n" + "word " * 400)]
    text = render_conversation(msgs, max_tokens=100, count=lambda s: len(s.split()))
    assert text.startswith("ASSISTANT: TITLE") and len(text.split()) <= 100


def test_prompts_have_the_conversation_slot():
    prompts = load_prompts()
    assert set(prompts) == set(topology.JUDGE_OPS)
    assert "USER: hi" in prompts["extract"].substitute(conversation="USER: hi")


def test_interactivity_schema_constrains_levels():
    props = SCHEMAS["interactivity"]["properties"]
    assert all(props[k]["enum"] == [0, 1, 2, 3] for k in ("understanding", "clarification", "suggestions"))
    assert SCHEMAS["extract"]["required"] == ["document"]


def test_parse_verdicts():
    r = parse_verdict("extract", '{"document": "  A Week in Lisbon  "}')
    assert r.ok and r.document == "A Week in Lisbon"
    r = parse_verdict("interactivity", '{"understanding": 3, "clarification": 2, "suggestions": 1, "rationale": "ok"}')
    assert r.levels == {"understanding": 3, "clarification": 2, "suggestions": 1} and r.score == pytest.approx(6 / 9)
    for op, raw in [
        ("extract", '{"document": "cut off'),
        ("extract", '{"doc": "x"}'),
        ("interactivity", '{"understanding": 4, "clarification": 2, "suggestions": 1, "rationale": ""}'),
        ("interactivity", '{"understanding": 3, "clarification": 2}'),
        ("interactivity", '{"understanding": true, "clarification": 2, "suggestions": 1}'),
    ]:
        with pytest.raises(ValueError, match=f"not a valid {op} reply|must be an integer"):
            parse_verdict(op, raw)


def test_3level_schema_and_verdicts():
    props = SCHEMAS["interactivity_3level"]["properties"]
    assert props["interactivity"]["enum"] == [0.0, 0.5, 1.0]
    assert SCHEMAS["interactivity_3level"]["required"] == ["thought", "interactivity"]
    for raw, score in [
        ('{"thought": "asked about tone", "interactivity": 1}', 1.0),
        ('{"thought": "one question", "interactivity": 0.5}', 0.5),
        ('{"thought": "guessed", "interactivity": 0}', 0.0),
    ]:
        r = parse_verdict("interactivity_3level", raw)
        assert r.ok and r.score == score and r.levels == {}
    for raw in [
        '{"thought": "x", "interactivity": 0.7}',
        '{"interactivity": 1}',
        '{"thought": "x", "interactivity": true}',
        '{"thought": "cut off',
    ]:
        with pytest.raises(ValueError, match="not a valid interactivity_3level reply"):
            parse_verdict("interactivity_3level", raw)


class ScriptedBackend:
    """Backend test double: returns the scripted outputs in order (an Exception is raised)."""

    model_name = "scripted"

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.calls: list[dict] = []

    async def chat_json(self, messages, schema, *, max_tokens, temperature, seed):
        self.calls.append(
            dict(messages=messages, schema=schema, max_tokens=max_tokens, temperature=temperature, seed=seed)
        )
        out = self.outputs.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


GOOD = json.dumps({"understanding": 2, "clarification": 3, "suggestions": 1, "rationale": "asked one question"})


async def test_judge_retries_malformed_output_then_succeeds():
    backend = ScriptedBackend(['{"understanding": 2, "clar', RuntimeError("engine hiccup"), GOOD])
    judge = Judge(backend, JudgeConfig(temperature=0.0, retry_temperature=0.7, max_retries=3, max_tokens=64))
    reply = await judge.handle("interactivity", JudgeRequest(op="interactivity", messages=CONV, seed=10))
    assert reply.ok and reply.attempts == 3 and reply.model == "scripted"
    assert reply.score == pytest.approx(6 / 9) and reply.raw == GOOD
    # Greedy first, then sampled retries with fresh seeds; always under the op's schema.
    assert [c["temperature"] for c in backend.calls] == [0.0, 0.7, 0.7]
    assert [c["seed"] for c in backend.calls] == [10, 11, 12]
    assert all(c["schema"] is SCHEMAS["interactivity"] and c["max_tokens"] == 64 for c in backend.calls)
    prompt = backend.calls[0]["messages"][0]["content"]
    assert "ASSISTANT: A Week in Lisbon" in prompt and "${conversation}" not in prompt


async def test_a_request_may_ask_its_first_attempt_sampled():
    """The scorer's second verdicts ([scorer] audit_temperature) sample where the judge is greedy."""
    backend = ScriptedBackend(["not json", GOOD, GOOD])
    judge = Judge(backend, JudgeConfig(temperature=0.0, retry_temperature=0.7, max_retries=3))
    req = JudgeRequest(op="interactivity", messages=CONV, seed=10, temperature=0.9)
    assert (await judge.handle("interactivity", req)).ok
    assert [c["temperature"] for c in backend.calls] == [0.9, 0.9]
    assert (await judge.handle("interactivity", JudgeRequest(op="interactivity", messages=CONV))).ok
    assert backend.calls[-1]["temperature"] == 0.0  # -1, the default: the service's own


async def test_judge_reports_failure_after_max_retries():
    backend = ScriptedBackend(['{"document": "a'] * 3)
    judge = Judge(backend, JudgeConfig(max_retries=2))
    reply = await judge.handle("extract", JudgeRequest(op="extract", messages=CONV))
    assert not reply.ok and reply.attempts == 3 and reply.document == ""
    assert "attempt 3" in reply.error and reply.raw == '{"document": "a'


async def test_op_mismatch_is_an_error_reply():
    judge = Judge(ScriptedBackend([]), JudgeConfig())
    reply = await judge.handle("extract", JudgeRequest(op="interactivity", messages=CONV))
    assert not reply.ok and "op" in reply.error


class TokenBackend(ScriptedBackend):
    """Adds what a local backend exposes: a tokenizer (one token per word) and its context length."""

    max_model_len = 800

    class tokenizer:  # noqa: N801 - stands in for an HF tokenizer object
        @staticmethod
        def encode(text, add_special_tokens=False):
            return text.split()

    def prompt_ids(self, messages):
        return messages[0]["content"].split()


async def test_budget_follows_the_context_length_and_truncates():
    backend = TokenBackend(['{"document": "A Week in Lisbon"}'])
    judge = Judge(backend, JudgeConfig(max_tokens=100))
    prompt_words = max(len(t.substitute(conversation="").split()) for t in judge.prompts.values())
    assert judge.conversation_budget == 800 - 100 - prompt_words - 16
    long_conv = CONV[:2] + [ChatMessage("assistant", "blah " * 900)] + CONV[3:]
    reply = await judge.handle("extract", JudgeRequest(op="extract", messages=long_conv))
    assert reply.ok
    sent = backend.calls[0]["messages"][0]["content"]
    assert len(sent.split()) <= 800 - 100 and "A Week in Lisbon" in sent and "left out" in sent


def test_too_small_context_fails_at_start():
    class Tiny(TokenBackend):
        max_model_len = 500

    with pytest.raises(ValueError, match="max_model_len=500"):
        Judge(Tiny([]), JudgeConfig(max_tokens=200))


async def test_routes_answer_bad_requests_with_an_error_reply():
    routes = judge_routes(Judge(ScriptedBackend(['{"document": "d"}']), JudgeConfig()))
    assert set(routes) == {topology.judge_subject(op) for op in topology.JUDGE_OPS}
    bad = codec.decode("judge.reply", await routes[topology.judge_subject("extract")](b"\x93garbage"))
    assert not bad.ok and "not a JudgeRequest" in bad.error
    good = codec.decode(
        "judge.reply",
        await routes[topology.judge_subject("extract")](codec.encode(JudgeRequest(op="extract", messages=CONV))),
    )
    assert good.ok and good.document == "d"
    crashed = codec.decode("judge.reply", error_reply("parley.svc.judge.extract", b"", RuntimeError("boom")))
    assert crashed == JudgeReply(ok=False, error="judge crashed on parley.svc.judge.extract: RuntimeError: boom")


def test_raw_control_characters_in_strings_are_accepted():
    # The schema grammar lets them into strings (strict JSON does not); the text is still clear.
    r = parse_verdict("extract", '{"document": "Title\x07\n\nBody"}')
    assert r.ok and r.document == "Title\x07\n\nBody"


# The reply of an expected-rating judge as a local engine returns it: per generated token its text
# and the log-probs of the likeliest tokens by text (what the schema's grammar left possible).
LN = math.log


def _expected_tokens():
    return [
        ('{"', {'{"': 0.0}),
        ("understanding", {"understanding": 0.0}),
        ('":', {'":': 0.0}),
        ("2", {"2": LN(0.6), "3": LN(0.3), "1": LN(0.1)}),  # E = 2.2
        (',"', {',"': 0.0}),
        ("clar", {"clar": 0.0}),
        ("ification", {"ification": 0.0}),
        ('":', {'":': 0.0}),
        ("1", {"1": LN(0.5), " 1": LN(0.25), "0": LN(0.25)}),  # " 1" is level 1 too: E = 0.75
        (',"', {',"': 0.0}),
        ("suggestions", {"suggestions": 0.0}),
        ('":', {'":': 0.0}),
        ("0", {"0": LN(0.4), "3": LN(0.4), "x": LN(0.2)}),  # "x" is no level: renormalised, E = 1.5
        (',"rationale":"', {}),
        ("ok", {}),
        ('"}', {}),
    ]


def test_level_distribution_reads_each_level_where_it_was_written():
    dist = level_distribution(_expected_tokens())
    assert dist["understanding"] == pytest.approx({"0": 0.0, "1": 0.1, "2": 0.6, "3": 0.3})
    assert dist["clarification"] == pytest.approx({"0": 0.25, "1": 0.75, "2": 0.0, "3": 0.0})
    assert dist["suggestions"] == pytest.approx({"0": 0.5, "1": 0.0, "2": 0.0, "3": 0.5})


def test_level_distribution_refuses_a_value_that_is_not_one_level_token():
    tokens = _expected_tokens()
    tokens[3] = ("2.", {"2.": 0.0})
    with pytest.raises(ValueError, match="single-token levels"):
        level_distribution(tokens)
    with pytest.raises(ValueError, match=r"never wrote \['suggestions'\]"):
        level_distribution(_expected_tokens()[:10])
    tokens = _expected_tokens()
    tokens[3] = ("2", {"x": 0.0})
    with pytest.raises(ValueError, match="no level"):
        level_distribution(tokens)


class TokensBackend(ScriptedBackend):
    """ScriptedBackend that also answers chat_json_tokens with scripted (text, tokens) pairs."""

    async def chat_json_tokens(self, messages, schema, *, max_tokens, temperature, seed, top_logprobs):
        self.calls.append(dict(schema=schema, seed=seed, top_logprobs=top_logprobs))
        out = self.outputs.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


async def test_expected_interactivity_carries_the_distribution_and_its_expected_score():
    raw = "".join(t for t, _ in _expected_tokens())
    assert json.loads(raw) == {"understanding": 2, "clarification": 1, "suggestions": 0, "rationale": "ok"}
    not_a_level = list(_expected_tokens())
    not_a_level[3] = ("two", {"two": 0.0})
    backend = TokensBackend([(raw, not_a_level), (raw, _expected_tokens())])
    judge = Judge(backend, JudgeConfig(max_retries=2))
    reply = await judge.handle("interactivity_expected", JudgeRequest(op="interactivity_expected", messages=CONV))
    assert reply.ok and reply.attempts == 2  # the first reply had no level token: retried
    assert reply.levels == {"understanding": 2, "clarification": 1, "suggestions": 0}  # what it wrote
    assert set(reply.distribution) == {"understanding", "clarification", "suggestions"}
    assert reply.score == pytest.approx((2.2 + 0.75 + 1.5) / 9)  # 0.49444, not the written levels' 3/9
    assert all(
        c["top_logprobs"] == EXPECTED_TOP_LOGPROBS and c["schema"] is SCHEMAS["interactivity_expected"]
        for c in backend.calls
    )
    # through the wire: the scorer reads the distribution back
    back = codec.decode("judge.reply", codec.encode(reply))
    assert back.distribution == reply.distribution


async def test_expected_interactivity_decodes_the_levels_only():
    """Its score comes from the level positions, which come first: the schema ends after the last
    level (no rationale to pay for), and a levels-only reply scores exactly as one with a rationale."""
    schema = SCHEMAS["interactivity_expected"]
    assert list(schema["properties"]) == list(INTERACTIVITY_KEYS) == schema["required"]
    assert "rationale" not in schema["properties"] and schema["additionalProperties"] is False
    levels_only = _expected_tokens()[:13] + [("}", {})]
    raw = "".join(t for t, _ in levels_only)
    assert json.loads(raw) == {"understanding": 2, "clarification": 1, "suggestions": 0}
    short = await Judge(TokensBackend([(raw, levels_only)]), JudgeConfig()).handle(
        "interactivity_expected", JudgeRequest(op="interactivity_expected", messages=CONV)
    )
    full_raw = "".join(t for t, _ in _expected_tokens())
    full = await Judge(TokensBackend([(full_raw, _expected_tokens())]), JudgeConfig()).handle(
        "interactivity_expected", JudgeRequest(op="interactivity_expected", messages=CONV)
    )
    assert short.ok and short.score == full.score == pytest.approx((2.2 + 0.75 + 1.5) / 9)
    assert short.distribution == full.distribution
