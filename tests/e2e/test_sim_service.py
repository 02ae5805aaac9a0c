"""The simulator service over a real nats-server, with a test-double model: bounded concurrency,
replicas splitting requests in the queue group, bad requests answered, a dead backend stopping
the service; and the OpenAI-compatible backend against an endpoint double speaking HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import nats.errors
import pytest

from parley.config.actor import SimConfig
from parley.engines.backend import OpenAIBackend, make_backend
from parley.engines.config import EngineConfig
from parley.protocol import codec, topology
from parley.protocol.messages import ChatMessage, SimRequest
from parley.services.sim.server import FALLBACK_MESSAGE, SIM_SCHEMA, Simulator

pytestmark = pytest.mark.integration


class SlowBackendDouble:
    """Test double of a Backend: answers after `delay` seconds, tracking how many calls overlap."""

    def __init__(self, name: str, delay: float = 0.2, fail: Exception | None = None):
        self.model_name = name
        self.delay, self.fail = delay, fail
        self.now = self.peak = self.calls = 0

    async def chat_json(self, messages, schema, *, max_tokens, temperature, seed):
        self.calls += 1
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise self.fail
            return json.dumps({"message": f"reply to {len(messages)} messages", "done": False})
        finally:
            self.now -= 1

    async def close(self):
        pass


def req(i: int = 0) -> bytes:
    return codec.encode(SimRequest(prompt="cooperative", messages=[ChatMessage("user", f"hi {i}")], seed=i))


async def ask(nc, data: bytes, timeout: float = 5.0):
    return codec.decode("sim.reply", (await nc.request(topology.SIM_SUBJECT, data, timeout=timeout)).data)


async def test_requests_run_concurrently_up_to_the_limit_and_replicas_share_them(nc):
    a, b = SlowBackendDouble("a"), SlowBackendDouble("b")
    services = [Simulator(x, SimConfig(concurrency=3)).service(nc) for x in (a, b)]
    for s in services:
        await s.start()
    replies = await asyncio.gather(*(ask(nc, req(i)) for i in range(16)))
    assert all(not r.fallback and r.message == "reply to 3 messages" for r in replies)
    assert Counter(r.model for r in replies).keys() == {"a", "b"}  # the queue group split them
    assert a.calls + b.calls == 16
    assert a.peak == 3 and b.peak == 3  # bounded by each replica's concurrency
    for s in services:
        await s.stop()


async def test_bad_requests_get_an_answer_and_stop_lets_in_flight_requests_finish(nc):
    backend = SlowBackendDouble("slow", delay=0.5)
    service = Simulator(backend, SimConfig()).service(nc)
    await service.start()
    bad = await ask(nc, b"not msgpack at all")
    assert bad.fallback and bad.message == FALLBACK_MESSAGE and "bad request" in bad.error
    pending = asyncio.ensure_future(ask(nc, req()))
    await asyncio.sleep(0.1)
    await service.stop(grace_s=5)  # unsubscribed at once, the request in flight still answered
    assert not (await pending).fallback
    with pytest.raises(nats.errors.NoRespondersError):
        await ask(nc, req())


class EngineDeadError(RuntimeError):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError (backend.is_fatal matches by name)."""


async def test_a_dead_backend_stops_the_service_instead_of_faking_users(nc):
    backend = SlowBackendDouble("dead", delay=0.0, fail=EngineDeadError("engine core died"))
    service = Simulator(backend, SimConfig()).service(nc)
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run_until(stop, run="simtest", role="sim", ident="s1"))
    await asyncio.sleep(0.2)
    with pytest.raises(nats.errors.TimeoutError):  # no made-up reply
        await ask(nc, req(), timeout=1.0)
    with pytest.raises(RuntimeError, match="backend failed: EngineDeadError"):
        await asyncio.wait_for(runner, 5)


class ChatEndpointDouble(BaseHTTPRequestHandler):
    """Test double of an OpenAI-compatible /v1/chat/completions endpoint: records the request
    and answers with one JSON message."""

    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ChatEndpointDouble.seen.append((self.path, self.headers.get("Authorization"), body))
        out = json.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": '{"message": "shorter please", "done": false}'},
                    }
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


async def test_openai_backend_sends_a_json_schema_request(nc, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), ChatEndpointDouble)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("SIM_TEST_KEY", "sk-test")
    cfg = SimConfig(
        backend="openai",
        base_url=f"http://127.0.0.1:{server.server_port}/v1",
        model_name="Qwen/Qwen3.5-9B",
        api_key_env="SIM_TEST_KEY",
        max_tokens=64,
        temperature=0.3,
        engine=EngineConfig(template_kwargs={"enable_thinking": False}),
    )
    backend = make_backend(cfg)
    assert isinstance(backend, OpenAIBackend)
    service = Simulator(backend, cfg).service(nc)
    await service.start()
    try:
        r = await ask(nc, req(7))
    finally:
        await service.stop()
        await backend.close()
        server.shutdown()
    assert (r.message, r.done, r.fallback, r.model) == ("shorter please", False, False, "Qwen/Qwen3.5-9B")
    path, auth, body = ChatEndpointDouble.seen[-1]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body["model"] == "Qwen/Qwen3.5-9B" and body["max_tokens"] == 64 and body["temperature"] == 0.3
    assert body["seed"] == 7
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"] == SIM_SCHEMA
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant"]


async def test_a_dead_backend_stops_the_judge_instead_of_answering_failures_forever(nc):
    """The judge retried an engine that had died as it retries a malformed verdict, answered ok=False,
    and kept its place in the queue group: every scorer's request failed there for good while the
    process looked alive. Now a fatal error is not retried and the service stops (a fresh judge, or a
    replica, answers the requester's retry)."""
    from parley.config.scorer import JudgeConfig
    from parley.protocol.messages import JudgeRequest
    from parley.services.judge.server import Judge, judge_service

    backend = SlowBackendDouble("dead", delay=0.0, fail=EngineDeadError("engine core died"))
    service = judge_service(nc, Judge(backend, JudgeConfig(max_retries=3)), name="j1")
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run_until(stop, run="judgetest", role="judge", ident="j1"))
    await asyncio.sleep(0.2)
    request = codec.encode(JudgeRequest(op="extract", messages=[ChatMessage("user", "hi")]))
    with pytest.raises(nats.errors.TimeoutError):  # no ok=False verdict to retry against a dead engine
        await nc.request(topology.judge_subject("extract"), request, timeout=1.0)
    assert backend.calls == 1  # not retried
    with pytest.raises(RuntimeError, match="backend failed: EngineDeadError"):
        await asyncio.wait_for(runner, 5)
