"""Typed configuration of an LLM engine and of a service's backend, shared by the policy actor,
the user simulator and the judge (sections [actor.engine], [sim], [judge] decode into these)."""

from __future__ import annotations

import msgspec

BACKENDS = ("vllm", "openai")


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
