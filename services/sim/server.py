"""The user simulator: an LLM playing the user who wants a document written, served on
topology.SIM_SUBJECT (queue group SIM_QUEUE) by `parley sim`; actors call it once per user turn.

The simulator sees the conversation with roles swapped (it is the "assistant" of its own chat, so
the policy's messages reach it as "user"), under a system prompt rendered from a variant file in
services/sim/prompts/. It must answer {"message": str, "done": bool}; malformed output is retried,
then replaced by a neutral stand-in flagged fallback=True. A request never goes unanswered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import string
from collections import Counter
from functools import cache
from importlib import resources
from pathlib import Path

import msgspec

from parley.config.actor import SimConfig
from parley.config.run import RunConfig
from parley.engines.backend import Backend, BackendError
from parley.errors import BadMessage
from parley.protocol import codec, topology
from parley.protocol.messages import ChatMessage, SimReply, SimRequest
from parley.services.sim.client import FALLBACK_MESSAGE

log = logging.getLogger(__name__)

SIM_SCHEMA = {
    "type": "object",
    "properties": {"message": {"type": "string"}, "done": {"type": "boolean"}},
    "required": ["message", "done"],
    "additionalProperties": False,
}

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class BadRequest(BadMessage):
    """A request the simulator cannot serve (unknown prompt variant, undecodable bytes)."""


def prompts_dir() -> Path:
    """The prompt variants' folder, beside this module (installed: parley/services/sim/prompts)."""
    return Path(str(resources.files("parley.services.sim") / "prompts"))


def prompt_names() -> list[str]:
    """The prompt variants: every services/sim/prompts/<name>.txt."""
    return sorted(p.stem for p in prompts_dir().glob("*.txt"))


@cache
def load_prompt(name: str) -> string.Template:
    path = prompts_dir() / f"{name}.txt"
    if not _NAME.match(name) or not path.is_file():
        raise BadRequest(f"unknown user-simulator prompt {name!r}; known: {', '.join(prompt_names())}")
    return string.Template(path.read_text())


@cache
def opening_note() -> str:
    return (prompts_dir().parent / "opening.txt").read_text().strip()


def swap_roles(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The assistant's conversation as the simulator's chat: assistant <-> user. The assistant's
    own system prompt is not something its user knows, so it is left out."""
    swapped = {"user": "assistant", "assistant": "user"}
    return [{"role": swapped[m.role], "content": m.content} for m in messages if m.role in swapped]


def sim_messages(template: string.Template, req: SimRequest) -> list[dict[str, str]]:
    """System prompt (the variant, filled in) + an opening stage direction + the swapped chat.

    The stage direction is a user message, so the simulator's chat always starts with a user turn
    and alternates, which strict chat templates require, and an empty conversation still has a
    user query to answer."""
    system = template.substitute(title=req.title, reference=req.reference, summary=req.summary)
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": opening_note()},
        *swap_roles(req.messages),
    ]


def _json_object(raw: str) -> dict:
    text = raw.strip()
    # Endpoints without schema support sometimes wrap the object in a code fence or prose.
    fenced = re.match(r"^```(?:json)?\s*(.*?)\s*```$", text, re.S)
    if fenced:
        text = fenced.group(1)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end <= start:
            raise ValueError(f"not JSON: {raw[:120]!r}") from None
        try:
            obj = json.loads(text[start : end + 1])
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e.msg}): {raw[:120]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_reply(raw: str) -> tuple[str, bool]:
    """Validate the simulator's output; returns (message, done) or raises ValueError saying why."""
    obj = _json_object(raw)
    message, done = obj.get("message"), obj.get("done")
    if not isinstance(done, bool):
        raise ValueError(f"'done' must be true or false, got {done!r}")
    if not isinstance(message, str):
        raise ValueError(f"'message' must be a string, got {type(message).__name__}")
    # A "\udxxx" escape decodes to a lone surrogate, which no UTF-8 reply can carry: replace it.
    message = message.encode("utf-8", "replace").decode("utf-8").strip()
    # An empty goodbye is fine; an empty turn in a continuing conversation is not.
    if not message and not done:
        raise ValueError("'message' is empty and the conversation is not done")
    return message, done


class Simulator:
    """Answers SimRequests with one backend. `handle` is the service handler (bytes in/out)."""

    def __init__(self, backend: Backend, cfg: SimConfig, *, default_prompt: str | None = None):
        self.backend = backend
        self.cfg = cfg
        self.default_prompt = default_prompt or cfg.prompt
        load_prompt(self.default_prompt)  # fail at start, not on the first request
        self.counters: Counter[str] = Counter()

    def fallback(self, error: str, attempts: int) -> SimReply:
        self.counters["fallback"] += 1
        return SimReply(
            message=FALLBACK_MESSAGE,
            done=False,
            fallback=True,
            attempts=attempts,
            error=error[:1000],
            model=self.backend.model_name,
        )

    async def reply(self, req: SimRequest) -> SimReply:
        try:
            template = load_prompt(req.prompt or self.default_prompt)
            messages = sim_messages(template, req)
        except (BadRequest, KeyError, ValueError) as e:
            self.counters["bad_request"] += 1
            return self.fallback(f"bad request: {e}", attempts=0)
        max_tokens = min(req.max_tokens, self.cfg.max_tokens) if req.max_tokens > 0 else self.cfg.max_tokens
        errors = []
        attempts = self.cfg.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                # A new seed per attempt, or a seeded retry would repeat the same bad output.
                raw = await self.backend.chat_json(
                    messages,
                    SIM_SCHEMA,
                    max_tokens=max_tokens,
                    temperature=self.cfg.temperature,
                    seed=(req.seed + attempt - 1) % 2**31,
                )
                message, done = parse_reply(raw)
            except (ValueError, BackendError) as e:
                errors.append(f"attempt {attempt}: {e}")
                self.counters["malformed"] += 1
                continue
            return SimReply(message=message, done=done, attempts=attempt, model=self.backend.model_name)
        log.warning("simulator output unusable after %d attempts; fallback: %s", attempts, errors[-1])
        return self.fallback("; ".join(errors), attempts=attempts)

    async def handle(self, data: bytes) -> bytes:
        try:
            req = codec.decode("sim.request", data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters["bad_request"] += 1
            return codec.encode(self.fallback(f"bad request: {e}", attempts=0))
        return codec.encode(await self.reply(req))

    def on_error(self, subject: str, data: bytes, exc: BaseException) -> bytes:
        return codec.encode(self.fallback(f"internal error: {type(exc).__name__}: {exc}", attempts=0))

    def service(self, nc):
        from parley.engines.backend import is_fatal
        from parley.engines.service import Service

        return Service(
            nc,
            {topology.SIM_SUBJECT: self.handle},
            queue=topology.SIM_QUEUE,
            concurrency=self.cfg.concurrency,
            on_error=self.on_error,
            name="sim",
            counters=self.counters,
            fatal=is_fatal,
        )


async def main(stop: asyncio.Event, cfg: RunConfig, ident: str, default_prompt: str | None = None) -> int:
    """`parley sim`: load the backend, serve until stopped."""
    from parley.engines.service import serve_backend

    def build(nc, backend):
        sim = Simulator(backend, cfg.sim, default_prompt=default_prompt)
        log.info("sim %s: default prompt %s", ident, sim.default_prompt)
        return [(sim.service(nc), "sim", ident, cfg.sim.timeout_s)]

    return await serve_backend(stop, cfg, ident=ident, roles=[("sim", ident)], backend_cfg=cfg.sim, build=build)


def start_problems(cfg: RunConfig) -> list[str]:
    """What stops the simulator before it starts (and `parley sim --dry-run` refuses), one line each:
    a local engine whose model does not resolve, an OpenAI-compatible endpoint named without the
    model it serves. Checked before any engine starts, which takes a minute on CPU."""
    from parley.engines.models import ModelNotFound, check_model

    if cfg.sim.backend == "openai":
        if cfg.sim.model_name:
            return []
        return ["sim.model_name is empty; with backend='openai' name the served model (--model-name)"]
    try:
        check_model(cfg.sim.engine.model)
    except ModelNotFound as e:
        return [f"sim.engine.model={cfg.sim.engine.model!r}: {e}"]
    return []


def run(cfg: RunConfig, ident: str) -> int:
    """`parley sim`'s entry: serve the simulator until SIGINT/SIGTERM; returns the exit code."""
    from parley.runtime.process import run_async

    return run_async(main, cfg, ident)
