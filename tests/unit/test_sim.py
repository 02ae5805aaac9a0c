"""The user simulator's logic without a model: reply validation, retries and fallbacks, the
role-swapped view it is given, and bad requests. The model is a scripted test double."""

from __future__ import annotations

import asyncio

import pytest

from parley.config.actor import SimConfig
from parley.engines.backend import BackendError
from parley.protocol import codec
from parley.protocol.messages import ChatMessage, SimReply, SimRequest
from parley.services.sim.server import (
    FALLBACK_MESSAGE,
    SIM_SCHEMA,
    BadRequest,
    Simulator,
    load_prompt,
    opening_note,
    parse_reply,
    prompt_names,
    sim_messages,
    swap_roles,
)


class ScriptedBackendDouble:
    """Test double of engines.backend.Backend: returns (or raises) the scripted outputs in order
    and records every call."""

    model_name = "scripted-double"

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.calls = []

    async def chat_json(self, messages, schema, *, max_tokens, temperature, seed):
        self.calls.append(
            dict(messages=messages, schema=schema, max_tokens=max_tokens, temperature=temperature, seed=seed)
        )
        out = self.outputs.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    async def close(self):
        pass


def request(**kw) -> SimRequest:
    base = dict(
        prompt="lazy_full",
        messages=[ChatMessage("user", "help me write a toast"), ChatMessage("assistant", "Who is it for?")],
        reference="REFERENCE DOC",
        title="A Toast",
        summary="A short wedding toast.",
        seed=11,
    )
    return SimRequest(**{**base, **kw})


def reply_of(sim: Simulator, req: SimRequest) -> SimReply:
    return asyncio.run(sim.reply(req))


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ('{"message": "make it funnier", "done": false}', ("make it funnier", False)),
        ('  {"done": true, "message": "  thanks, perfect  "}\n', ("thanks, perfect", True)),
        ('```json\n{"message": "shorter", "done": false}\n```', ("shorter", False)),
        ('Sure! {"message": "add a joke", "done": false} Hope that helps.', ("add a joke", False)),
        ('{"message": "", "done": true}', ("", True)),  # a silent goodbye ends the conversation
    ],
)
def test_parse_reply_accepts_valid_objects(raw, expected):
    assert parse_reply(raw) == expected


@pytest.mark.parametrize(
    "raw, why",
    [
        ('{"message": "cut off at max_tok', "not JSON"),
        ("", "not JSON"),
        ('["message", "done"]', "JSON object"),
        ('{"message": "hi"}', "'done'"),
        ('{"message": "hi", "done": "no"}', "'done'"),
        ('{"message": 3, "done": false}', "'message'"),
        ('{"message": "   ", "done": false}', "empty"),
    ],
)
def test_parse_reply_rejects_malformed_output(raw, why):
    with pytest.raises(ValueError, match=why):
        parse_reply(raw)


# -- the simulator's view ---------------------------------------------------------------------


def test_roles_are_swapped_and_the_assistant_system_prompt_is_hidden():
    msgs = [
        ChatMessage("system", "secret assistant instructions"),
        ChatMessage("user", "U1"),
        ChatMessage("assistant", "A1"),
        ChatMessage("user", "U2"),
        ChatMessage("assistant", "A2"),
    ]
    assert swap_roles(msgs) == [
        {"role": "assistant", "content": "U1"},
        {"role": "user", "content": "A1"},
        {"role": "assistant", "content": "U2"},
        {"role": "user", "content": "A2"},
    ]


def test_sim_messages_render_the_variant_and_open_with_a_user_turn():
    req = request()
    msgs = sim_messages(load_prompt("lazy_full"), req)
    assert msgs[0]["role"] == "system"
    assert "REFERENCE DOC" in msgs[0]["content"] and '"A Toast"' in msgs[0]["content"]
    assert "${" not in msgs[0]["content"]
    assert msgs[1] == {"role": "user", "content": opening_note()}
    # the user's own opening is the simulator's "assistant" turn; the policy's reply its "user" turn
    assert [m["role"] for m in msgs[2:]] == ["assistant", "user"]
    assert [m["content"] for m in msgs[2:]] == ["help me write a toast", "Who is it for?"]
    # alternation holds from the first non-system message on
    roles = [m["role"] for m in msgs[1:]]
    assert all(a != b for a, b in zip(roles, roles[1:]))


def test_empty_conversation_asks_for_the_opening_request():
    msgs = sim_messages(load_prompt("cooperative"), request(messages=[]))
    assert [m["role"] for m in msgs] == ["system", "user"]


def test_prompt_variants_know_what_they_should():
    assert {"lazy_full", "lazy_summary", "cooperative"} <= set(prompt_names())
    req = request()
    summary_user = sim_messages(load_prompt("lazy_summary"), req)[0]["content"]
    assert "REFERENCE DOC" not in summary_user and "A short wedding toast." in summary_user
    for name in ("lazy_full", "cooperative"):
        assert "REFERENCE DOC" in sim_messages(load_prompt(name), req)[0]["content"]
    with pytest.raises(BadRequest, match="unknown user-simulator prompt"):
        load_prompt("../system/default")


# -- retries and fallbacks --------------------------------------------------------------------


def test_malformed_output_is_retried_with_a_new_seed():
    backend = ScriptedBackendDouble(['{"message": "trunc', '{"message": "who is it for? my sister", "done": false}'])
    sim = Simulator(backend, SimConfig(max_retries=3, max_tokens=64, temperature=0.5))
    r = reply_of(sim, request(max_tokens=256))
    assert (r.message, r.done, r.fallback, r.attempts, r.model) == (
        "who is it for? my sister",
        False,
        False,
        2,
        "scripted-double",
    )
    assert [c["seed"] for c in backend.calls] == [11, 12]
    assert all(c["schema"] == SIM_SCHEMA for c in backend.calls)
    assert {c["max_tokens"] for c in backend.calls} == {64}  # the service's cap wins
    assert {c["temperature"] for c in backend.calls} == {0.5}
    assert sim.counters["malformed"] == 1 and sim.counters["fallback"] == 0


def test_persistently_malformed_output_becomes_a_flagged_fallback():
    outputs = ["not json", BackendError("prompt too long"), '{"message": "", "done": false}']
    backend = ScriptedBackendDouble(outputs)
    sim = Simulator(backend, SimConfig(max_retries=2))
    r = reply_of(sim, request())
    assert r.fallback and not r.done
    assert r.message == FALLBACK_MESSAGE
    assert r.attempts == 3 and len(backend.calls) == 3
    assert "attempt 1: not JSON" in r.error and "prompt too long" in r.error and "empty" in r.error
    assert sim.counters["fallback"] == 1


def test_done_ends_and_empty_prompt_uses_the_default_variant():
    backend = ScriptedBackendDouble(['{"message": "great, thanks!", "done": true}'])
    sim = Simulator(backend, SimConfig(), default_prompt="lazy_summary")
    r = reply_of(sim, request(prompt=""))
    assert r.done and not r.fallback
    assert "A short wedding toast." in backend.calls[0]["messages"][0]["content"]
    assert "REFERENCE DOC" not in backend.calls[0]["messages"][0]["content"]


def test_bad_requests_get_a_fallback_reply_without_calling_the_model():
    backend = ScriptedBackendDouble([])
    sim = Simulator(backend, SimConfig())
    r = reply_of(sim, request(prompt="no_such_variant"))
    assert r.fallback and r.attempts == 0 and "unknown user-simulator prompt" in r.error

    data = asyncio.run(sim.handle(b"\x93 definitely not a SimRequest"))
    r = codec.decode("sim.reply", data)
    assert r.fallback and r.error.startswith("bad request:")

    wrong_shape = codec.encode(SimReply(message="I am a reply, not a request"))
    r = codec.decode("sim.reply", asyncio.run(sim.handle(wrong_shape)))
    assert r.fallback and "bad request" in r.error
    assert backend.calls == [] and sim.counters["bad_request"] == 3


def test_unknown_default_prompt_fails_at_start():
    with pytest.raises(BadRequest):
        Simulator(ScriptedBackendDouble([]), SimConfig(), default_prompt="nope")


def test_a_handler_crash_still_answers_with_a_fallback():
    sim = Simulator(ScriptedBackendDouble([]), SimConfig())
    r = codec.decode("sim.reply", sim.on_error("parley.svc.sim", b"", RuntimeError("engine died")))
    assert r.fallback and "engine died" in r.error


def test_rollout_side_modules_import_without_torch_or_vllm():
    # `parley --help` and the services' option parsing must stay fast
    import subprocess
    import sys

    code = (
        "import sys, parley.deploy.cli_actor, parley.services.sim.server, parley.engines.service, parley.engines.backend, "
        "parley.rollout.conversation, parley.services.sim.client, parley.weights.follow, parley.actors.actor; print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
