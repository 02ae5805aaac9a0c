"""The judge: extracts the final document of a conversation and rates the assistant's interactivity.

`Judge` answers JudgeRequests with any backend from engines/backend.py (JSON-schema-constrained
decoding, validation, retries); `parley judge` (deploy/cli_services.py) serves it on NATS through
`serve_judge`; scorers reach it with services.judge.client.JudgeClient.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from importlib import resources

import msgspec

from parley.config.run import RunConfig
from parley.config.scorer import JudgeConfig
from parley.engines.backend import is_fatal
from parley.protocol import topology
from parley.protocol.messages import ChatMessage, JudgeReply, JudgeRequest
from parley.rewards.metrics import (
    INTERACTIVITY_3LEVEL,
    INTERACTIVITY_KEYS,
    interactivity_from_3level,
    interactivity_from_distribution,
    interactivity_from_levels,
)

log = logging.getLogger(__name__)

PROMPT_FILES = {
    "extract": "extract_document.txt",
    "interactivity": "interactivity.txt",
    "interactivity_3level": "interactivity_3level.txt",
    "interactivity_expected": "interactivity.txt",  # the rubric, rated by its expected levels
}
RATIONALE_MAX_CHARS = 300  # "one sentence"; bounded so a rambling judge cannot eat max_tokens
# interactivity_expected reads the judge's log-probs of this many likeliest tokens at each level's
# position; the schema leaves only the four level tokens possible there, so 10 holds all of them.
EXPECTED_TOP_LOGPROBS = 10

# The decoder may only produce these; a reply that still fails validation (cut off at max_tokens)
# is retried.
SCHEMAS: dict[str, dict] = {
    "extract": {
        "type": "object",
        "properties": {"document": {"type": "string"}},
        "required": ["document"],
        "additionalProperties": False,
    },
    "interactivity": {
        "type": "object",
        # Levels first, as the rubric asks, so the rationale cannot crowd them out.
        "properties": {
            **{k: {"type": "integer", "enum": [0, 1, 2, 3]} for k in INTERACTIVITY_KEYS},
            "rationale": {"type": "string", "maxLength": RATIONALE_MAX_CHARS},
        },
        "required": [*INTERACTIVITY_KEYS, "rationale"],
        "additionalProperties": False,
    },
    "interactivity_3level": {
        "type": "object",
        # The thought comes first, as in CollabLLM's judge (reason, then rate); bounded like the
        # rubric's rationale so it cannot crowd out the level.
        "properties": {
            "thought": {"type": "string", "maxLength": RATIONALE_MAX_CHARS},
            "interactivity": {"type": "number", "enum": list(INTERACTIVITY_3LEVEL)},
        },
        "required": ["thought", "interactivity"],
        "additionalProperties": False,
    },
}
# interactivity_expected reads its score from the log-probs at the three level positions, which
# come first; a rationale written after them cannot change them, and was most of the op's tokens
# (on the embedded default, the judge's share of the services' engine). So it writes the levels only.
SCHEMAS["interactivity_expected"] = {
    "type": "object",
    "properties": {k: SCHEMAS["interactivity"]["properties"][k] for k in INTERACTIVITY_KEYS},
    "required": list(INTERACTIVITY_KEYS),
    "additionalProperties": False,
}


class ExtractVerdict(msgspec.Struct, forbid_unknown_fields=True):
    document: str


class InteractivityVerdict(msgspec.Struct, forbid_unknown_fields=True):
    understanding: int
    clarification: int
    suggestions: int
    rationale: str = ""


class Interactivity3Verdict(msgspec.Struct, forbid_unknown_fields=True):
    thought: str
    interactivity: float


_VERDICT_TYPES = {
    "extract": ExtractVerdict,
    "interactivity": InteractivityVerdict,
    "interactivity_3level": Interactivity3Verdict,
    "interactivity_expected": InteractivityVerdict,
}

ROLE_LABELS = {"user": "USER", "assistant": "ASSISTANT"}
_SEPARATOR = "\n\n"


def load_prompts() -> dict[str, string.Template]:
    """The judge prompt templates (services/judge/prompts/*.txt), each with one ${conversation} slot."""
    prompts = {}
    for op, name in PROMPT_FILES.items():
        text = (resources.files("parley.services.judge") / "prompts" / name).read_text(encoding="utf-8")
        template = string.Template(text)
        if "conversation" not in template.get_identifiers():
            raise ValueError(f"judge prompt services/judge/prompts/{name} has no ${{conversation}} slot")
        prompts[op] = template
    return prompts


def _cut_to(text: str, budget: int, count: Callable[[str], int]) -> str:
    """The longest head of `text` (on a character boundary) that `count` says fits `budget`."""
    lo, hi = 0, len(text)
    while lo < hi:  # binary search: count() may be a tokenizer, so call it O(log n) times
        mid = (lo + hi + 1) // 2
        if count(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def render_conversation(
    messages: Sequence[ChatMessage],
    max_tokens: int | None = None,
    count: Callable[[str], int] = len,
) -> str:
    """The transcript the judge reads: "USER: ...\\n\\nASSISTANT: ...", system messages left out.

    When it is longer than `max_tokens` (measured by `count`; characters by default), the newest
    messages are kept, since the final document is usually in the last assistant turns; the
    opening request is added back if it still fits, with a marker for what was left out. If even
    the last message alone is too long, its beginning is kept (the document's title and start).
    """
    blocks = [f"{ROLE_LABELS.get(m.role, m.role.upper())}: {m.content.strip()}" for m in messages if m.role != "system"]
    full = _SEPARATOR.join(blocks)
    if max_tokens is None or count(full) <= max_tokens:
        return full

    def marker(n: int) -> str:
        return f"[... {n} earlier message{'s' if n != 1 else ''} left out ...]"

    # Room for the longest marker we could need, so adding it never breaks the budget.
    budget = max_tokens - count(marker(len(blocks)) + _SEPARATOR * 2)
    kept: list[str] = []
    used = 0
    for block in reversed(blocks):
        cost = count(block + _SEPARATOR)
        if used + cost > budget:
            break
        kept.insert(0, block)
        used += cost
    if not kept:
        return _cut_to(blocks[-1], max_tokens, count)

    head: list[str] = []
    omitted = len(blocks) - len(kept)
    if omitted > 1 and used + count(blocks[0] + _SEPARATOR) <= budget:
        head, omitted = [blocks[0]], omitted - 1  # the user's opening request frames the rest
    if omitted == 0:
        return _SEPARATOR.join(head + kept)
    return _SEPARATOR.join(head + [marker(omitted)] + kept)


def parse_verdict(op: str, raw: str) -> JudgeReply:
    """A valid judge reply from the model's raw JSON text; raises ValueError if it is not usable."""
    try:
        # strict=False: the schema grammar lets raw control characters into strings, which strict
        # JSON forbids; the text is still unambiguous, so accept it rather than burn a retry.
        verdict = msgspec.convert(json.loads(raw, strict=False), _VERDICT_TYPES[op])
    except (ValueError, msgspec.ValidationError) as e:
        raise ValueError(f"not a valid {op} reply ({e}): {raw[:200]!r}") from None
    if op == "extract":
        # A "\udxxx" escape decodes to a lone surrogate, which no UTF-8 reply can carry: replace it.
        document = verdict.document.encode("utf-8", "replace").decode("utf-8")
        return JudgeReply(ok=True, document=document.strip(), raw=raw)
    if op == "interactivity_3level":
        try:
            score = interactivity_from_3level(verdict.interactivity)
        except ValueError as e:
            raise ValueError(f"not a valid {op} reply ({e}): {raw[:200]!r}") from None
        return JudgeReply(ok=True, score=score, raw=raw)
    levels = {k: getattr(verdict, k) for k in INTERACTIVITY_KEYS}
    return JudgeReply(ok=True, levels=levels, score=interactivity_from_levels(levels), raw=raw)


def level_distribution(
    tokens: Sequence[tuple[str, dict[str, float]]], keys: Sequence[str] = INTERACTIVITY_KEYS, max_level: int = 3
) -> dict[str, dict[str, float]]:
    """The judge's own distribution over each key's level, read where it wrote the level.

    `tokens` is the generated reply token by token: (the token's text, log-probs of the likeliest
    tokens by text), as LocalBackend.chat_json_tokens returns it. For each key, the position is the
    first token after `"key":` that is not whitespace; the probabilities of the candidates that are
    a level ("0".."max_level", surrounding whitespace ignored) are summed per level and
    normalised over the levels. Levels must be single tokens: a value that starts with anything
    else, a key never written, or no level among the candidates is a ValueError (the judge retries).
    """
    labels = {str(level) for level in range(max_level + 1)}
    text = ""
    out: dict[str, dict[str, float]] = {}
    waiting = {key: re.compile(r'"' + re.escape(key) + r'"\s*:\s*$') for key in keys}
    for sampled, candidates in tokens:
        if sampled.strip():
            for key, ends_with_key in list(waiting.items()):
                if not ends_with_key.search(text):
                    continue
                del waiting[key]
                if sampled.strip() not in labels:
                    raise ValueError(
                        f"the judge's {key!r} value starts with token {sampled!r}, not a level "
                        f"{sorted(labels)} in one token; an expected rating needs single-token levels"
                    )
                probs = {lab: 0.0 for lab in sorted(labels)}
                for cand, lp in candidates.items():
                    if cand.strip() in labels:
                        probs[cand.strip()] += math.exp(lp)
                mass = math.fsum(probs.values())
                if not mass > 0:
                    raise ValueError(
                        f"no level {sorted(labels)} among the judge's candidates for {key!r}: {candidates}"
                    )
                out[key] = {lab: p / mass for lab, p in probs.items()}
        text += sampled
    if waiting:
        raise ValueError(f"the judge's reply never wrote {sorted(waiting)}: {text[:200]!r}")
    return out


class Judge:
    """Answers judge requests with one backend: renders the prompt, decodes under the op's JSON
    schema, validates, retries malformed output up to cfg.max_retries times, and reports a
    failure as JudgeReply(ok=False) - never as a score."""

    def __init__(self, backend, cfg: JudgeConfig, prompts: dict[str, string.Template] | None = None):
        self.backend = backend
        self.cfg = cfg
        self.prompts = prompts or load_prompts()
        self.count, self.conversation_budget = self._budget()

    def _budget(self) -> tuple[Callable[[str], int], int | None]:
        tokenizer = getattr(self.backend, "tokenizer", None)
        if tokenizer is not None:

            def count(text: str) -> int:
                return len(tokenizer.encode(text, add_special_tokens=False))
        else:
            # No tokenizer at hand (remote endpoint): about 3 characters per token, erring long.
            def count(text: str) -> int:
                return len(text) // 3 + 1

        if self.cfg.max_conversation_tokens:
            return count, self.cfg.max_conversation_tokens
        max_len = getattr(self.backend, "max_model_len", None)
        if not max_len:
            return count, None  # a remote model's context is its own business
        # What the prompt around the conversation and the answer need, measured on the longest prompt.
        overhead = max(self._prompt_tokens(op, "") for op in self.prompts)
        budget = max_len - self.cfg.max_tokens - overhead - 16  # 16: slack for the join of template and text
        if budget < 64:
            raise ValueError(
                f"judge max_tokens={self.cfg.max_tokens} leaves only {budget} tokens for the conversation within "
                f"max_model_len={max_len}; raise [judge.engine] max_model_len or lower [judge] max_tokens"
            )
        return count, budget

    def _prompt_tokens(self, op: str, conversation: str) -> int:
        messages = self._messages(op, conversation)
        prompt_ids = getattr(self.backend, "prompt_ids", None)
        if prompt_ids is not None:
            return len(prompt_ids(messages))
        return self.count(messages[0]["content"])

    def _messages(self, op: str, conversation: str) -> list[dict]:
        return [{"role": "user", "content": self.prompts[op].substitute(conversation=conversation)}]

    async def handle(self, op: str, req: JudgeRequest) -> JudgeReply:
        model = self.backend.model_name
        if op not in topology.JUDGE_OPS or req.op != op:
            return JudgeReply(
                ok=False,
                error=f"request op {req.op!r} on the {op!r} subject; allowed: {topology.JUDGE_OPS}",
                model=model,
            )
        conversation = render_conversation(req.messages, self.conversation_budget, self.count)
        messages = self._messages(op, conversation)
        errors: list[str] = []
        raw = ""
        attempts = 1 + self.cfg.max_retries
        for attempt in range(1, attempts + 1):
            # The first try uses the configured temperature; retries sample so they can differ.
            first = self.cfg.temperature if req.temperature < 0 else req.temperature
            temperature = first if attempt == 1 else max(first, self.cfg.retry_temperature)
            seed = (req.seed + attempt - 1) % 2**31
            try:
                if op == "interactivity_expected":
                    raw, tokens = await self.backend.chat_json_tokens(
                        messages,
                        SCHEMAS[op],
                        max_tokens=self.cfg.max_tokens,
                        temperature=temperature,
                        seed=seed,
                        top_logprobs=EXPECTED_TOP_LOGPROBS,
                    )
                    reply = parse_verdict(op, raw)
                    reply.distribution = level_distribution(tokens)
                    reply.score = interactivity_from_distribution(reply.distribution)
                else:
                    raw = await self.backend.chat_json(
                        messages, SCHEMAS[op], max_tokens=self.cfg.max_tokens, temperature=temperature, seed=seed
                    )
                    reply = parse_verdict(op, raw)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - backend errors and bad output alike are retried, then reported
                if is_fatal(e):  # the engine is gone: no retry can answer, the service stops (judge_service)
                    raise
                errors.append(f"attempt {attempt}: {type(e).__name__}: {e}")
                log.warning("judge %s attempt %d/%d failed: %s", op, attempt, attempts, e)
                continue
            reply.attempts, reply.model = attempt, model
            return reply
        return JudgeReply(ok=False, raw=raw, attempts=attempts, error="; ".join(errors)[-2000:], model=model)


def judge_routes(judge: Judge, counters: Counter | None = None) -> dict:
    """The service routes of both judge ops: subject -> handler(bytes) -> encoded JudgeReply.
    A request that does not decode gets an ok=False reply naming the error (the requester decides)."""
    from parley.protocol import codec

    counters = counters if counters is not None else Counter()

    def route(op: str):
        async def handler(data: bytes) -> bytes:
            try:
                req = codec.decode("judge.request", data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                counters["bad_request"] += 1
                return codec.encode(
                    JudgeReply(ok=False, error=f"request is not a JudgeRequest: {e}", model=judge.backend.model_name)
                )
            reply = await judge.handle(op, req)
            counters[f"{op}.{'ok' if reply.ok else 'failed'}"] += 1
            return codec.encode(reply)

        return handler

    return {topology.judge_subject(op): route(op) for op in topology.JUDGE_OPS}


def error_reply(subject: str, data: bytes, exc: BaseException) -> bytes:
    """What a requester gets when a handler crashed: a failure it retries, never a verdict."""
    from parley.protocol import codec

    return codec.encode(JudgeReply(ok=False, error=f"judge crashed on {subject}: {type(exc).__name__}: {exc}"))


def judge_service(nc, judge: Judge, *, name: str = "judge"):
    """A Service (engines/service.py) answering both judge subjects in the JUDGE_QUEUE group."""
    from parley.engines.service import Service

    counters: Counter = Counter()
    return Service(
        nc,
        judge_routes(judge, counters),
        queue=topology.JUDGE_QUEUE,
        concurrency=judge.cfg.concurrency,
        on_error=error_reply,
        name=name,
        counters=counters,
        fatal=is_fatal,
    )


async def main(stop: asyncio.Event, cfg: RunConfig, ident: str) -> int:
    """`parley judge`: load the backend, serve until SIGINT/SIGTERM, close the backend."""
    from parley.engines.service import BadServiceConfig, serve_backend

    def build(nc, backend):
        try:
            judge = Judge(backend, cfg.judge)
        except ValueError as e:  # the context cannot hold prompt + answer: a config error
            raise BadServiceConfig(str(e)) from None
        return [(judge_service(nc, judge, name=ident), "judge", ident, cfg.judge.timeout_s)]

    return await serve_backend(stop, cfg, ident=ident, roles=[("judge", ident)], backend_cfg=cfg.judge, build=build)


def run(cfg: RunConfig, ident: str) -> int:
    """`parley judge`'s entry: serve the judge until SIGINT/SIGTERM; returns the exit code."""
    from parley.runtime.process import run_async

    return run_async(main, cfg, ident)
