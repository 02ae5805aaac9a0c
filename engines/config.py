"""Typed configuration of an LLM engine and of a service's backend, shared by the policy actor,
the user simulator and the judge (sections [actor.engine], [sim], [judge] decode into these).
They stay beside the engine: engines/ reads them and takes no run configuration."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

Backend = Literal["vllm", "openai"]
BACKENDS = get_args(Backend)
# How vLLM stores the KV cache: "auto" in the model's dtype, or one of vLLM's fp8 formats (half of bf16's
# bytes a token: twice the tokens in the same kv_cache_bytes, half the bytes each decode step reads)
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
# How vLLM starts an engine's engine-core process (engines.engine.start_method_choice): "env" leaves it
# to VLLM_WORKER_MULTIPROC_METHOD (vLLM's default: fork), "fork" skips the engine core's second import
# of torch and vLLM, "spawn" is needed where one process holds several engines (with fork the second
# failed to initialize CUDA on the H200, docs/gpu.md)
StartMethod = Literal["env", "fork", "spawn"]
START_METHODS = get_args(StartMethod)


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A local vLLM engine."""

    model: str = "smol"  # "smol" | "tiny" | path to an HF checkpoint dir
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # float32 on CPU; bfloat16 on GPU
    max_model_len: Annotated[int, Meta(ge=64)] = 4096
    kv_cache_bytes: int = 512 * 1024**2  # explicit KV size; use this on CPU
    # the KV cache's format ("auto": the model's dtype; "fp8": 1 B a value): the behaviour log-probs are
    # the fp8 cache's, a larger gap to the learner's, which its ratio clip corrects (docs/gpu.md)
    kv_cache_dtype: KVCacheDtype = "auto"
    # > 0: a fraction instead of kv_cache_bytes (GPU)
    gpu_memory_utilization: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    tensor_parallel_size: int = 1
    seed: int = 0
    enforce_eager: bool = True
    # With enforce_eager = false: true (vLLM's default) compiles the model with torch.compile (Inductor)
    # and captures piecewise and full CUDA graphs; false compiles nothing and captures full CUDA graphs of
    # decode steps alone over vLLM's own kernels (steps with a prefill run eagerly), so the engine starts
    # sooner: on a warm H100 SmolLM2's compiled engine spent 12-21 s in its init (torch.compile 7-8 s
    # with its cache warm, a kernel warm-up after the graphs up to 16 s), the uncompiled one 3.6 s
    # (docs/gpu.md, "An engine without torch.compile"). Not full graphs of mixed steps: there a prefill
    # over cached context (a conversation's next turn) came out up to 15 nats off the learner's log-probs.
    torch_compile: bool = True
    template_kwargs: dict[str, bool | str | int] = {}  # chat-template options, e.g. {enable_thinking = false} for Qwen3
    # LoRA adapter versions ([learner.lora]): the highest adapter rank served (0 = no LoRA, whole weights)
    max_lora_rank: Annotated[int, Meta(ge=0)] = 0
    # adapters held at once: the newest and those open conversations started on (>= 2 keeps them pinned)
    max_loras: Annotated[int, Meta(ge=1)] = 2
    # Keep vLLM's prefix cache across whole-weight swaps: a conversation's next turn reuses the KV its
    # earlier turns left, computed by the weights served then, instead of prefilling its history again
    # under the new ones. Faster (no re-prefill after each swap); the turn's behaviour log-probs are then
    # the new weights' over an older version's KV (AssistantTurn.stale_prefix_tokens counts it). Off:
    # prompts are salted by the weights, and every turn after a swap is exact (docs/learner.md).
    prefix_cache_across_versions: bool = False
    # how vLLM starts the engine-core process (StartMethod above; docs/gpu.md, "Environment on a GPU machine")
    start_method: StartMethod = "env"
    # vLLM's scheduler. An engine made as parley makes it gets vLLM's library fallbacks, not its tuned
    # H100/H200 defaults: 128 sequences at once and 2048 tokens a step (prefill chunks and decodes).
    # max_num_seqs 0: enough for the requests the role keeps in flight (the actor's concurrency, a
    # service's concurrency), never fewer than vLLM's 128; max_num_batched_tokens 0: vLLM's 2048
    # (on CPU at least max_model_len: prompts are prefilled whole there, engines.backend.cpu_workarounds)
    max_num_seqs: Annotated[int, Meta(ge=0)] = 0
    max_num_batched_tokens: Annotated[int, Meta(ge=0)] = 0
    # One weights version's load into the engine (a file reload, a packed delta, an adapter, putting the
    # served weights back): past it the load raises TimeoutError naming this key, the follower puts the
    # served weights back (bounded too) or stops the actor, instead of generation paused for good behind
    # an engine that hangs. A GPU-buffer load is bounded by the learner's hold time instead.
    load_timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    # The longest requests may wait on the engine while it takes no step (and parley did not pause it
    # for a load or a sleep): past it the role stops with EngineFailed and its unfinished work is handed
    # on, instead of every request held behind a hung engine core (engines.engine.PolicyEngine.watch).
    # Above the longest step the engine may take: a prefill of max_num_batched_tokens, a fresh engine's
    # first request (seconds on CPU), a new JSON schema's grammar.
    stall_timeout_s: Annotated[float, Meta(gt=0)] = 300.0

    def __post_init__(self) -> None:
        if not self.torch_compile and self.enforce_eager:
            raise ValueError(
                "torch_compile = false with enforce_eager = true: an eager engine compiles nothing and "
                "captures no CUDA graphs already; set enforce_eager = false for decode CUDA graphs without "
                "torch.compile, or leave torch_compile = true"
            )


class ServiceBackend(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where a service's LLM runs: a local engine, or an OpenAI-compatible chat endpoint."""

    backend: Backend = "vllm"
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    base_url: str = ""  # openai backend, e.g. http://host:8000/v1
    model_name: str = ""  # openai backend: the served model name
    api_key_env: str = "OPENAI_API_KEY"  # name of the environment variable holding the key
    concurrency: Annotated[int, Meta(ge=1)] = 8  # requests handled at once
    max_retries: Annotated[int, Meta(ge=0)] = 3  # malformed outputs retried before a fallback/failure
    temperature: float = 0.7
    max_tokens: int = 256
    timeout_s: float = 120.0
    # openai backend: the endpoint's price, for the cost counter (backend.usd); 0 = not counted
    usd_per_mtok_in: Annotated[float, Meta(ge=0.0)] = 0.0  # per million prompt tokens
    usd_per_mtok_out: Annotated[float, Meta(ge=0.0)] = 0.0  # per million completion tokens

    def __post_init__(self) -> None:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend='openai' needs base_url (e.g. http://host:8000/v1)")
