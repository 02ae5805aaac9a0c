"""Typed configuration of the rollout side: the policy/service engines, `parley actor` and `parley sim`.

Sections [actor] and [sim] of the run file decode into these Structs (unknown keys rejected);
the judge reuses EngineConfig and ServiceBackend.
"""

from __future__ import annotations

import msgspec

BACKENDS = ("vllm", "openai")
SIM_PROMPTS = ("lazy_full", "lazy_summary", "cooperative")


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A local vLLM engine."""

    model: str = "smol"  # "smol" | "tiny" | path to an HF checkpoint dir
    dtype: str = "float32"  # float32 on CPU; bfloat16 on GPU
    max_model_len: int = 4096
    kv_cache_bytes: int = 512 * 1024**2  # explicit KV size; use this on CPU
    gpu_memory_utilization: float = 0.0  # > 0: a fraction instead of kv_cache_bytes (GPU)
    tensor_parallel_size: int = 1
    seed: int = 0
    enforce_eager: bool = True
    chat_template_kwargs: dict[str, bool | str | int] = {}  # e.g. {enable_thinking = false} for Qwen3

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype={self.dtype!r} not allowed; use float32, bfloat16, float16 or auto")
        if not 0.0 <= self.gpu_memory_utilization < 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in [0, 1)")
        if self.max_model_len < 64:
            raise ValueError(f"max_model_len={self.max_model_len} is too small; use >= 64")


class ServiceBackend(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where a service's LLM runs: a local engine, or an OpenAI-compatible chat endpoint."""

    backend: str = "vllm"  # "vllm" | "openai"
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    base_url: str = ""  # openai backend, e.g. http://host:8000/v1
    model_name: str = ""  # openai backend: the served model name
    api_key_env: str = "OPENAI_API_KEY"  # name of the environment variable holding the key
    concurrency: int = 8  # requests handled at once
    max_retries: int = 3  # malformed outputs retried before a fallback/failure
    temperature: float = 0.7
    max_tokens: int = 256
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} not allowed; use one of {BACKENDS}")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend='openai' needs base_url (e.g. http://host:8000/v1)")
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")


class SimConfig(ServiceBackend, kw_only=True, forbid_unknown_fields=True):
    """[sim]: the user-simulator service."""

    prompt: str = "lazy_full"  # default prompt variant when a request names none

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt not in SIM_PROMPTS:
            raise ValueError(f"prompt={self.prompt!r} not allowed; use one of {SIM_PROMPTS}")


class ActorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[actor]: a rollout actor."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    concurrency: int = 8  # conversations in flight
    temperature: float = 1.0  # behaviour policy; log-probs are of the raw distribution
    top_p: float = 1.0
    sim_timeout_s: float = 180.0  # one simulator request
    weights_poll_s: float = 5.0  # poll the weights key as well as watching it

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
