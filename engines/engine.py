"""PolicyEngine: the actor's handle on one vLLM AsyncLLM — token-in/token-out generation with
per-token log-probs, JSON-constrained generation for the simulator/judge services, and
in-place weight reloads. Created by actor / service processes; vLLM is imported lazily.

Log-prob convention (the learner must compute the same thing), chosen per engine by
EngineSettings.sampled_logprobs:
- False (services: the judge reads level probabilities): every returned log-prob is log_softmax
  of the model's *raw* logits at that position, before temperature, top-p or any constraint
  (vLLM's logprobs_mode="raw_logprobs").
- True (the actor's policy): log_softmax(logits / temperature), after top-p: the distribution
  the token was drawn from (vLLM's "processed_logprobs"). The learner recomputes exactly that
  from Trajectory.temperature (engines.logprobs; training refuses top_p < 1). At temperature 1.0
  and top_p 1.0 the two conventions give the same numbers.
In fp32 the behaviour log-prob equals what the learner's forward pass gives for the same ids
(tests/reference.py computes it with transformers; tests/e2e/test_logprob_agreement.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parley.engines.config import START_METHODS
from parley.errors import ConfigError, StateError
from parley.weights.worker import REFUSED, STAGED_ADAPTER_PATH

MiB = 1 << 20

# vLLM names each ZeroMQ socket between an engine's client and its engine core by a uuid in
# $VLLM_RPC_BASE_PATH (the temp directory when unset), and a killed engine leaves them there: they pile
# up at every run of the tests (the CI machine's count: docs/benchmarks.md, "Observations behind the code").
RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, less the NUL


def engine_socket_dir(environ=os.environ) -> str | None:
    """Points vLLM's engine sockets at a scratch directory of this process (runtime.scratch, kind
    "vllm": removed at this process's exit, and by the next process that makes one on this host
    once this one is gone, killed included) and returns it; a second engine of the process finds it
    in the environment. An operator's VLLM_RPC_BASE_PATH is kept (None), as is vLLM's default where
    the directory's name would leave a socket's path over the 107 bytes a Unix socket allows (a long
    host name). A parent's directory, inherited through the environment, is replaced by one of this
    process. vLLM's own engine-core processes inherit this process's (they are started after it is set)."""
    from parley.runtime.scratch import owner, scratch_dir

    current = environ.get(RPC_DIR_ENV)
    mine = owner(current, "vllm") if current else None
    if mine == os.getpid():
        return current
    # a name not of ours is the operator's, kept; a parent's (a test session or a role that started
    # this process) goes when the parent does, so this process makes its own
    if current and mine is None:
        return None
    import atexit
    import logging
    import shutil

    path = str(scratch_dir("vllm"))
    if len(path) + 1 + len(str(uuid.uuid4())) > SOCKET_PATH_MAX:
        os.rmdir(path)
        logging.getLogger(__name__).warning(
            "engine sockets stay in vLLM's default directory: %s/<uuid> would pass the %d bytes a Unix "
            "socket's path may have (set %s to a short directory to move them)",
            path,
            SOCKET_PATH_MAX,
            RPC_DIR_ENV,
        )
        return None
    environ[RPC_DIR_ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@dataclass
class EngineSettings:
    """Everything needed to start a PolicyEngine. On CPU give kv_cache_bytes (vLLM treats a
    memory fraction as a share of host RAM, which breaks with two engines on one machine); on a
    GPU of its own set gpu_memory_utilization and leave kv_cache_bytes None; on a GPU shared with
    other processes give kv_cache_bytes (no profiling: see _engine_args)."""

    model: str
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_bytes: int | None = 512 * MiB
    # the KV cache's format (EngineConfig.kv_cache_dtype): "auto" leaves vLLM's default, the model's dtype
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    seed: int = 0
    enforce_eager: bool = True
    # with enforce_eager False: vLLM's torch.compile (True) or decode CUDA graphs alone (EngineConfig.torch_compile)
    torch_compile: bool = True
    # JSON-constrained output without optional whitespace (small models otherwise spend their
    # token budget on spaces and newlines). vLLM only offers this engine-wide, with the
    # xgrammar (or guidance) backend, so it pins backend="xgrammar".
    json_compact: bool = True
    # the module docstring: log-probs of the sampling distribution (True) or of the raw model (False)
    sampled_logprobs: bool = False
    # LoRA adapter versions (weights.lora): the highest adapter rank served (0 = no LoRA) and how
    # many adapters the engine holds at once (the newest and those open conversations started on)
    max_lora_rank: int = 0
    max_loras: int = 2
    # keep the prefix cache across whole-weight swaps (EngineConfig.prefix_cache_across_versions)
    prefix_cache_across_versions: bool = False
    # [up] gpu_share = "phased": built with vLLM's sleep mode (sleep/wake_up), where the platform has it
    sleep_mode: bool = False
    # how vLLM starts the engine-core process: "env", "fork" or "spawn" (start_method_choice)
    start_method: str = "env"
    # vLLM's scheduler limits (EngineConfig.max_num_seqs / max_num_batched_tokens); None: vLLM's default
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # the most one weights load may take (EngineConfig.load_timeout_s)
    load_timeout_s: float = 600.0
    # the longest requests may wait on an engine that takes no step (EngineConfig.stall_timeout_s)
    stall_timeout_s: float = 300.0
    # extra AsyncEngineArgs fields, for what the above does not cover
    extra: dict[str, Any] = field(default_factory=dict)


START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"  # vLLM reads it when it starts the engine-core process


@dataclass(frozen=True)
class StartMethodChoice:
    """What an engine's start_method does to the process environment before vLLM starts the engine core:
    `value` for START_METHOD_ENV (None: left as it is), the method vLLM will use, and the line to log
    (`warn`: the method asked for is not the one vLLM will use)."""

    value: str | None
    method: str
    line: str
    warn: bool = False


def start_method_choice(
    setting: str, current: str | None, cuda_initialized: bool, cpu: bool, earlier_engines: int = 0
) -> StartMethodChoice:
    """The engine-core start method of `setting` ([*.engine] start_method), with VLLM_WORKER_MULTIPROC_METHOD
    at `current` (None: unset), decided as vLLM will then decide it (vllm.utils.system_utils's
    _maybe_force_spawn: spawn where CUDA is initialized in the process; the CPU platform always spawns).
    "fork" saves the engine core its own import of torch and vLLM; where CUDA is already initialized vLLM
    would take spawn silently instead, so that is refused (ConfigError) rather than paid unnoticed. A process's
    engines after its first (`earlier_engines` > 0) are spawned whatever the setting: with fork the second
    engine of one process failed to initialize CUDA on the H200 (docs/gpu.md), where vLLM saw nothing to
    force spawn for; the first engine of the actor or of the eval child, the one on the path to step 1,
    keeps fork."""
    if setting not in START_METHODS:
        raise ConfigError(f"start_method = {setting!r}: expected one of {', '.join(map(repr, START_METHODS))}")
    if setting == "fork" and cuda_initialized and not cpu:
        raise ConfigError(
            'start_method = "fork" ([actor.engine] or the engine\'s section): CUDA is already initialized in '
            f"this process (pid {os.getpid()}), so vLLM would start the engine core with spawn instead; set "
            'start_method = "spawn" (or "env")'
        )
    if setting == "fork" and earlier_engines > 0 and not cpu:
        return StartMethodChoice(
            "spawn",
            "spawn",
            f'engine core start method: spawn, not fork (start_method = "fork"): this process started '
            f"{earlier_engines} engine(s) before, and a second forked engine of one process fails to initialize CUDA",
            warn=True,
        )
    value = None if setting == "env" else setting
    asked = value or current or "fork"  # vLLM's default where the variable is unset
    if setting != "env":
        why = f'start_method = "{setting}"'
    else:
        why = f"{START_METHOD_ENV}={current}" if current else "vLLM's default"
    if cpu and asked != "spawn":
        return StartMethodChoice(
            value,
            "spawn",
            f"engine core start method: spawn, not {asked} ({why}): vLLM's CPU platform always spawns",
            warn=setting == "fork",
        )
    if asked != "spawn" and cuda_initialized:
        line = f"engine core start method: spawn, not {asked} ({why}): CUDA is initialized in this process"
        return StartMethodChoice(value, "spawn", line, warn=True)
    return StartMethodChoice(value, asked, f"engine core start method: {asked} ({why})")


_engines_made = 0  # engines this process has asked vLLM for (apply_start_method)


def apply_start_method(setting: str, environ=os.environ) -> StartMethodChoice:
    """start_method_choice for this process (its CUDA state, platform and engines before this one),
    applied to `environ` and logged; called right before each engine is made."""
    import logging

    import torch
    from vllm.platforms import current_platform

    global _engines_made
    cuda = bool(torch.cuda._is_compiled() and torch.cuda.is_initialized())
    choice = start_method_choice(
        setting, environ.get(START_METHOD_ENV), cuda, current_platform.is_cpu(), earlier_engines=_engines_made
    )
    _engines_made += 1
    if choice.value is not None:
        environ[START_METHOD_ENV] = choice.value
    logging.getLogger(__name__).log(logging.WARNING if choice.warn else logging.INFO, choice.line)
    return choice


@dataclass
class GenOut:
    token_ids: list[int]
    logprobs: list[float]  # one per token in token_ids: raw log-prob of the sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str
    # Only when asked for (top_logprobs=k): per position, the sampled token's text and the raw
    # log-probs of the k likeliest tokens by their text (tokens that decode alike are summed).
    top: list[tuple[str, dict[str, float]]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens vLLM took from its prefix cache (computed by an earlier request)
    # of those, the tokens whose KV weights older than the request's computed (prefix_cache_across_versions
    # only; 0 otherwise, where every cached token is the same weights')
    stale_cached_tokens: int = 0


class EngineCounts:
    """What an engine's scheduler did that parley reports (the actor's heartbeat): requests preempted,
    their KV cache given up for lack of room and recomputed later (a KV cache sized under the demand of
    the conversations in flight). Filled by the stat logger counting_logger builds, which vLLM calls at
    every batch of outputs."""

    def __init__(self) -> None:
        self.preemptions = 0
        # over every finished request: prompt tokens, those vLLM took from its prefix cache, and of
        # those the ones older weights computed (and the requests that had any: turns over a stale prefix)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.stale_cached_tokens = 0
        self.stale_prefix_requests = 0
        # batches of outputs the engine core has sent (every step that produced or reported anything):
        # PolicyEngine.watch's evidence that the engine is stepping
        self.steps = 0

    def prompt(self, prompt_tokens: int, cached: int, stale: int) -> None:
        """One finished request's prompt: its length, its tokens from the prefix cache, the stale ones."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached
        self.stale_cached_tokens += stale
        self.stale_prefix_requests += stale > 0

    def counters(self) -> dict[str, float]:
        """The heartbeat's engine.* counters."""
        return {
            "engine.preemptions": float(self.preemptions),
            "engine.prompt_tokens": float(self.prompt_tokens),
            "engine.cached_tokens": float(self.cached_tokens),
            "engine.stale_cached_tokens": float(self.stale_cached_tokens),
            "engine.stale_prefix_requests": float(self.stale_prefix_requests),
        }

    def record(self, iteration_stats) -> None:
        """One batch of outputs' IterationStats (None when the batch had no output)."""
        self.steps += 1
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)


def counting_logger(counts: EngineCounts):
    """A vLLM stat-logger factory writing into `counts`, or None where this vLLM has no such interface.
    vLLM 0.24 (the GPU's) and 0.32 (the CPU's) both take `stat_loggers` in AsyncLLM.from_engine_args
    and call StatLoggerBase.record(scheduler_stats, iteration_stats, ...) with IterationStats counting
    the PREEMPTED events; a custom logger turns the engine's stats on without vLLM's default loggers
    (no periodic log lines), so disable_log_stats stays as it is."""
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:
        return None

    class PreemptionLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, *args, **kwargs):
            counts.record(iteration_stats)

        def log_engine_initialized(self):
            pass

    return PreemptionLogger


class PrefixEpochs:
    """Which weights (by PolicyEngine._weights_epoch) computed the KV blocks parley's requests leave in
    vLLM's prefix cache, under prefix_cache_across_versions, so that each request can say how many of
    the prompt tokens vLLM took from its cache older weights computed (GenOut.stale_cached_tokens).

    vLLM reports only how many prompt tokens it found cached (a whole number of blocks, from the
    start); this follows its block layout from outside: a block is keyed by its tokens and all before
    them (a chained hash, as vLLM's block hash; `key` stands for what else vLLM hashes, the adapter),
    and is stamped with the epoch of the request that computed it: prompt blocks past the cached ones
    and the blocks of the generated tokens. A block stamped by none (its request was cancelled, or its
    stamp aged out of `capacity`) counts as stale: the count errs towards "stale". A request that spans
    a swap is stamped with the epoch it started in (its later blocks are newer: also erring stale)."""

    def __init__(self, block_size: int, capacity: int):
        from collections import OrderedDict

        self.block_size = max(1, int(block_size))
        self.capacity = max(1, int(capacity))
        self._epochs: OrderedDict[int, int] = OrderedDict()  # chained block hash -> epoch that computed it

    def _chain(self, key: str, tokens: Sequence[int]) -> list[int]:
        """The chained hash of each whole block of `tokens`."""
        b, h, out = self.block_size, hash(key), []
        for i in range(len(tokens) // b):
            h = hash((h, tuple(tokens[i * b : (i + 1) * b])))
            out.append(h)
        return out

    def stale(self, key: str, prompt: Sequence[int], cached: int, epoch: int) -> int:
        """Of the first `cached` tokens of `prompt` (vLLM's cache hit of a request started in `epoch`),
        how many KV blocks of an older epoch (or of none known) held."""
        blocks = self._chain(key, prompt[: cached - cached % self.block_size])
        old = sum(1 for h in blocks if self._epochs.get(h, -1) < epoch)
        return min(cached, old * self.block_size)

    def computed(self, key: str, tokens: Sequence[int], cached: int, epoch: int) -> None:
        """A request started in `epoch` computed the KV of `tokens` (its prompt and its output) past
        the `cached` tokens it took from the cache; the cached blocks were used (kept as the newest)."""
        first = cached // self.block_size
        for i, h in enumerate(self._chain(key, tokens)):
            if i >= first:
                self._epochs[h] = epoch
            elif h not in self._epochs:
                continue  # from the cache, computed by weights unknown here: stays counted stale
            self._epochs.move_to_end(h)
        while len(self._epochs) > self.capacity:
            self._epochs.popitem(last=False)


GPU_START_CHECK = 0.02  # the share of the GPU an engine with an explicit KV size asks to be free at start


# An engine without torch.compile: vLLM's compilation mode NONE (0) with full CUDA graphs of decode steps
# only. Not "FULL" (mixed prefill and decode steps in the graphs too, which FlashAttention 3 allows on
# Hopper): on an H100 (2026-12-07, bench/logprob_gpu.py --prefix and --reload) such graphs put a prefill
# over cached context up to 15 nats off the learner's log-probs (7% of tokens' ratios outside [0.8, 1.28]),
# and two training runs on them never reached their target; decode-only graphs matched as the compiled
# engine does.
NO_COMPILE = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


def _engine_args(settings: EngineSettings, cpu_bind: str | None = None):
    """AsyncEngineArgs for settings; cpu_bind is the CPU thread binding on a CPU platform, None on GPU."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(
        model=str(settings.model),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        seed=settings.seed,
        enforce_eager=settings.enforce_eager,
        logprobs_mode="processed_logprobs" if settings.sampled_logprobs else "raw_logprobs",
        disable_log_stats=True,
        # adds parley_reload_weights to vLLM's workers (resolved by name in the workers)
        worker_extension_cls="parley.weights.worker.WorkerExtension",
    )
    if not settings.enforce_eager and not settings.torch_compile:
        kwargs["compilation_config"] = dict(NO_COMPILE)
    if settings.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_bytes)
    if settings.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = settings.kv_cache_dtype
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.json_compact:
        from vllm.config import StructuredOutputsConfig

        kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
    if settings.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    elif settings.kv_cache_bytes is not None and cpu_bind is None:
        # A GPU engine with an explicit KV size skips vLLM's memory profiling, which charges the engine
        # with whatever the GPU's other processes allocate or free meanwhile (it measures free memory
        # device-wide: with several engines and a learner starting on one GPU that shrinks the KV cache,
        # or fails its "Error in memory profiling" check). vLLM still checks at start that
        # gpu_memory_utilization x the GPU is free (0.9 by default, which a shared GPU never has):
        # the engine asks only that a small share is free, and `parley up` plans the rest.
        kwargs["gpu_memory_utilization"] = GPU_START_CHECK
    if settings.prefix_cache_across_versions and not settings.extra.get("enable_prefix_caching", True):
        raise ValueError(
            "prefix_cache_across_versions = true with enable_prefix_caching = False: there is no prefix "
            "cache to keep; set prefix_cache_across_versions = false or leave vLLM's prefix cache on"
        )
    if settings.max_lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=settings.max_lora_rank, max_loras=settings.max_loras)
    if settings.sleep_mode and sleep_available():
        kwargs["enable_sleep_mode"] = True
    executor = cpu_executor(cpu_bind, settings.tensor_parallel_size) if cpu_bind is not None else None
    if executor is not None:
        kwargs["distributed_executor_backend"] = executor
    kwargs.update(settings.extra)
    return AsyncEngineArgs(**kwargs)


def sleep_available() -> bool:
    """Whether this platform's vLLM has sleep mode (CUDA, ROCm, XPU; not the CPU build, whose engine
    refuses enable_sleep_mode at start): vLLM's own answer, current_platform.is_sleep_mode_available."""
    from vllm.platforms import current_platform

    return bool(getattr(current_platform, "is_sleep_mode_available", lambda: False)())


def _top_by_text(sampled: int, pos: dict) -> tuple[str, dict[str, float]]:
    """One position of vLLM's logprobs (token id -> Logprob): the sampled token's text and the
    candidates' log-probs keyed by text, tokens that decode alike merged (log-sum-exp)."""
    probs: dict[str, float] = {}
    for lp in pos.values():
        text = lp.decoded_token or ""
        probs[text] = probs.get(text, 0.0) + math.exp(float(lp.logprob))
    by_text = {text: math.log(p) if p > 0 else float("-inf") for text, p in probs.items()}
    return pos[sampled].decoded_token or "", by_text


# vLLM's CPU build pins each engine's worker threads to cores it picks as if it owned the machine:
# on a 2-core machine "auto" gives every engine core 0 and leaves core 1 to the engine's scheduler, so
# the engines of one machine (parley up: actor, services, an eval child) all share one core while the
# other idles. Unless the operator chose a binding, the OS places them (measured: docs/operations.md).
CPU_BIND_ENV, CPU_BIND_DEFAULT = "VLLM_CPU_OMP_THREADS_BIND", "nobind"
# Unbound, each engine's torch would start one OpenMP thread per core: `parley up`'s three engines on
# two cores ran six threads that spin at every barrier waiting for one another. The launcher that knows
# how many engines share the machine (deploy/up.py) says so here, and each engine takes its share.
CPU_ENGINES_ENV = "PARLEY_CPU_ENGINES"


def share_cpu_cores(environ=os.environ, cpus: int | None = None) -> str:
    """Set the CPU binding the engine's workers inherit (unless already set); returns it.

    Unbound, with PARLEY_CPU_ENGINES=k set and no OMP_NUM_THREADS of the operator's, the workers get
    OMP_NUM_THREADS = max(1, cpus // k), cpus being the cores this process may run on."""
    bind = environ.setdefault(CPU_BIND_ENV, CPU_BIND_DEFAULT)
    engines = environ.get(CPU_ENGINES_ENV)
    if bind == "nobind" and engines and "OMP_NUM_THREADS" not in environ:
        try:
            k = int(engines)
            if k < 1:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{CPU_ENGINES_ENV}={engines!r}: the number of engines sharing this machine's cores "
                "must be a whole number >= 1 (or unset)"
            ) from None
        cpus = cpus or len(os.sched_getaffinity(0))
        environ["OMP_NUM_THREADS"] = str(max(1, cpus // k))
    return bind


START_STACKS_ENV = "PARLEY_START_STACKS_S"


@contextlib.contextmanager
def start_stacks(environ=os.environ, file=None):
    """While vLLM makes an engine (a minute or more on a GPU, most of a run's start): with
    PARLEY_START_STACKS_S=N set, every thread's Python stack is written to stderr (the role's log) every
    N seconds, so a slow or stuck start shows where it waits. Unset or empty: nothing. Only this process's
    threads: the engine core's own start logs from its process."""
    import faulthandler
    import sys

    raw = environ.get(START_STACKS_ENV, "")
    if not raw:
        yield
        return
    try:
        every = float(raw)
        if not math.isfinite(every) or every <= 0:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"{START_STACKS_ENV}={raw!r}: seconds between stack dumps while an engine starts, a number > 0 (or unset)"
        ) from None
    faulthandler.dump_traceback_later(every, repeat=True, file=file or sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# vLLM's CPU build runs the model in a worker process of its own, spawned by the engine-core process
# (itself spawned), so that it can set up OpenMP thread binding before torch starts. An unbound engine
# (CPU_BIND_DEFAULT) has no binding to set up: its one worker runs inside the engine core, with the same
# threads, which saves a spawn and a second import of torch and vLLM per engine (docs/operations.md).
# Named by qualname because vLLM's CPU platform turns the name "uni" back into "mp".
IN_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def cpu_executor(bind: str, tensor_parallel_size: int) -> str | None:
    """The executor a CPU engine with this binding uses: in the engine core when unbound and on one
    worker; None (vLLM's multiprocess executor) when the operator binds threads or runs several workers."""
    return IN_CORE_EXECUTOR if bind == CPU_BIND_DEFAULT and tensor_parallel_size == 1 else None


class EngineFailed(StateError):
    """The engine serves nothing more: vLLM's engine core died, or it held requests without taking a step
    for [*.engine] stall_timeout_s (PolicyEngine.watch). The role stops; its unfinished work is handed on."""


class PolicyEngine:
    """One vLLM engine. Construction blocks while vLLM loads the model (tens of seconds on CPU)
    and spawns its engine-core process; call it from the process's main module guarded by
    `if __name__ == "__main__":` (spawn re-imports the main module).

    generate/generate_json are safe to call concurrently from one event loop; vLLM batches
    them. `version` is the policy version of the loaded weights; the caller stamps it.
    """

    _removing: asyncio.Task | None = None  # adapters a new version replaced, being removed (_adopt_adapter)
    _requests = 0  # generate/generate_json calls waiting on vLLM now
    _loading = 0  # weights-load steps (_bounded) running now: the engine core may not step meanwhile
    # what sleep() freed and wake_up has not given back yet ("weights", "kv_cache"): a load made meanwhile
    # leaves vLLM's scheduler paused (_resume)
    _asleep: frozenset[str] = frozenset()
    # a load failed after changing weights and no whole version has been loaded since: generation stays
    # paused (_resume), so no token of a mixed model is stamped with the version it had; the caller
    # loads a whole version next (weights.follow: the new one once more, or the served one) or stops
    _mixed: bool = False

    def __init__(self, settings: EngineSettings, version: int = 0):
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cpu_bind = share_cpu_cores() if current_platform.is_cpu() else None
        engine_socket_dir()
        apply_start_method(settings.start_method)
        self.settings = settings
        self.version = version
        self.counts = EngineCounts()
        logger = counting_logger(self.counts)
        self._steps_counted = logger is not None  # watch() can tell a stalled engine from a busy one
        with start_stacks():
            self._llm = AsyncLLM.from_engine_args(
                _engine_args(settings, cpu_bind), stat_loggers=[logger] if logger is not None else None
            )
        self._reload_lock = asyncio.Lock()
        self.adapters: dict[int, Any] = {}  # version -> its vLLM LoRARequest, loaded (load_adapter)
        self._users: dict[int, int] = {}  # adapter version -> open conversations started on it (pin)
        self.base_version = version  # the version of the base alone, no adapter (before the first one)
        self._next_lora_id = 1
        self._staged: set[int] = set()  # LoRA ids of adapters added from memory (parley_stage_adapter)
        # Counts whole-weight swaps; every prompt carries it as vLLM's cache_salt (cache_salt()), so a
        # swap needs no prefix-cache reset: new requests never match blocks computed by the weights
        # before it, and requests in flight keep their KV instead of being preempted and recomputed (a
        # reset with running requests preempts them all). With it, generation during a cuda_ipc update
        # keeps its tokens/s (docs/benchmarks.md, "Weight path"). An adapter is part of vLLM's own
        # block hash already. Under prefix_cache_across_versions the salt leaves the epoch out.
        self._weights_epoch = 0
        self._prefix_epochs = self._track_prefix_epochs() if settings.prefix_cache_across_versions else None
        self.packed_name: str | None = None  # table digest of the workers' packed copy (keep_packed), None: none

    def _track_prefix_epochs(self) -> PrefixEpochs:
        """A PrefixEpochs laid out as this engine's KV cache (vLLM's block size), holding twice as many
        blocks as the cache does (where vLLM does not say: blocks of 16 tokens, a cache of 32,768 blocks)."""
        cache = getattr(getattr(self._llm, "vllm_config", None), "cache_config", None)
        block_size = getattr(cache, "block_size", None) or 16
        blocks = getattr(cache, "num_gpu_blocks", None) or 1 << 15
        return PrefixEpochs(block_size, 2 * blocks)

    def cache_salt(self) -> str:
        """vLLM's cache_salt for a prompt now: it names the weights, so a prompt's cached KV is reused only
        under the weights that computed it; under prefix_cache_across_versions it names none, and KV
        computed before a whole-weight swap is reused after it (adapters: vLLM hashes the adapter,
        whatever the salt)."""
        if self.settings.prefix_cache_across_versions:
            return "parley-weights"
        return f"parley-weights-{self._weights_epoch}"

    # -- generation ---------------------------------------------------------------------------

    async def _run(
        self, prompt_ids: Sequence[int], params, top_logprobs: int = 0, version: int | None = None
    ) -> GenOut:
        from vllm.inputs import TokensPrompt

        epoch = self._weights_epoch
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=self.cache_salt())
        renderer = getattr(self._llm, "renderer", None)
        if hasattr(renderer, "render_cmpl_async"):
            # vLLM 0.32 wants prompts pre-processed by its renderer (passing a raw prompt is
            # deprecated); for token prompts this only validates them. Older vLLM lacks it.
            (prompt,) = await renderer.render_cmpl_async([prompt])
        final = None
        lora = self.adapters.get(self.version if version is None else version)
        if version is not None and lora is None and version != self.base_version:
            raise KeyError(f"adapter version {version} is not loaded (loaded: {sorted(self.adapters)})")
        self._requests += 1
        try:
            async for out in self._llm.generate(prompt, params, uuid.uuid4().hex, lora_request=lora):
                final = out
        finally:
            self._requests -= 1
        if final is None or not final.outputs:
            return GenOut([], [], "abort", "")
        if final.prompt_token_ids is not None and list(final.prompt_token_ids) != list(prompt_ids):
            # token-in/token-out is the whole point: vLLM must not have added e.g. a BOS
            raise RuntimeError("vLLM changed the prompt token ids")
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        lps = []
        # logprobs=0 gives, per position, a dict holding just the sampled token
        for tok, pos in zip(ids, comp.logprobs or []):
            lps.append(float(pos[tok].logprob))
        if len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
        top = [_top_by_text(tok, pos) for tok, pos in zip(ids, comp.logprobs or [])] if top_logprobs else []
        cached = int(getattr(final, "num_cached_tokens", None) or 0)
        stale = 0
        if self._prefix_epochs is not None:
            key = lora.lora_name if lora is not None else ""
            stale = self._prefix_epochs.stale(key, prompt_ids, cached, epoch)
            self._prefix_epochs.computed(key, [*prompt_ids, *ids[:-1]], cached, epoch)  # the last token has no KV yet
        self.counts.prompt(len(prompt_ids), cached, stale)
        return GenOut(
            ids, lps, comp.finish_reason or "abort", comp.text, top, cached_tokens=cached, stale_cached_tokens=stale
        )

    def _params(self, max_tokens, temperature, top_p, seed, stop_token_ids, structured=None, top_logprobs=0):
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
            logprobs=top_logprobs,
            # we never stream partial outputs
            output_kind=RequestOutputKind.FINAL_ONLY,
            # the text is for logs; keep special tokens out of it
            skip_special_tokens=True,
            structured_outputs=structured,
        )

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        version: int | None = None,
    ) -> GenOut:
        """Sample a continuation of prompt_ids. The model's eos (from its generation config)
        always stops; stop_token_ids adds more. A stop token is included in token_ids. With adapter
        versions loaded (load_adapter), `version` picks one (None: the newest, `self.version`)."""
        params = self._params(max_tokens, temperature, top_p, seed, stop_token_ids)
        return await self._run(prompt_ids, params, version=version)

    async def generate_json(
        self,
        prompt_ids: Sequence[int],
        schema: dict,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        top_logprobs: int = 0,
    ) -> GenOut:
        """Like generate, but decoding is constrained to JSON matching `schema`. The text
        parses if finish_reason == "stop"; a "length" finish means max_tokens cut it off.
        Whitespace between JSON tokens follows EngineSettings.json_compact. top_logprobs=k also
        returns, per position, the k likeliest tokens' raw log-probs (GenOut.top)."""
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(json=schema)
        params = self._params(max_tokens, temperature, 1.0, seed, None, structured, top_logprobs)
        return await self._run(prompt_ids, params, top_logprobs)

    # -- weights ------------------------------------------------------------------------------

    async def reload_weights(
        self, weights_dir: str | Path, version: int | None = None, abort_inflight: bool = False
    ) -> None:
        """Load new weights (safetensors in HF naming, as save_pretrained writes them) in place.

        Generation is paused for the swap. By default in-flight requests are kept with their KV
        cache (computed by the old weights) and go on with the new ones, so a request that spans
        the swap has tokens from both versions (its earlier log-probs stay those of the old
        weights). abort_inflight=True ends them with "abort" instead. Requests started after the
        swap never reuse KV the old weights computed: prompts are salted by weights
        (_weights_epoch), so no prefix-cache reset is needed. Under prefix_cache_across_versions they
        do (cache_salt): a conversation's next turn takes its history's KV from the cache.
        """
        async with self._reload_lock:
            await self._llm.pause_generation(mode="abort" if abort_inflight else "keep", clear_cache=False)
            loaded = False
            try:
                await self._bounded_rpc(
                    "parley_reload_weights", f"reloading the weights from {weights_dir}", weights_path=str(weights_dir)
                )
                loaded = True
            finally:
                self._weights_epoch += 1  # also after a failed reload: the weights may be mixed
                self._mixed = not loaded
                await self._resume()
            if version is not None:
                self.version = version

    async def load_gpu(self, announcement: bytes, hold_s: float, version: int | None = None) -> None:
        """Load a GPU-transport version (cuda_ipc, nccl; its encoded WeightVersion) in place: the worker
        receives the learner's packed buffer (opening its CUDA IPC handle, or over its own process
        group with rank 0) and checks it, then loads it, in a keep-mode pause as reload_weights does.
        The buffer is checked before any parameter changes, so a refusal (weights.common.WeightVerifyError:
        a mismatch, for good) or a failure that passes (WeightUnavailable: it did not open, the receive
        broke or timed out, out of memory) leaves the served weights intact. hold_s bounds the whole wait (the learner holds the buffer
        that long); past it a TimeoutError says so."""
        from parley.weights.common import WeightUnavailable, WeightVerifyError

        async with self._reload_lock:
            await self._prepare_gpu_load()
            await self._llm.pause_generation(
                mode="keep", clear_cache=False
            )  # salted prompts: no reset (reload_weights)
            reasons = None
            try:
                reasons = await self._bounded_rpc(
                    "parley_load_gpu",
                    "loading weights from the learner's GPU buffer",
                    hold_s,
                    announcement=announcement,
                )
            finally:
                self._weights_epoch += 1  # also after a failure: the weights may be mixed until restored
                if reasons is None:  # raised (or timed out) after weights may have changed
                    self._mixed = True
                elif not any(reasons):  # a whole version; a refusal (reasons) changed nothing
                    self._mixed = False
                await self._resume()
            bad = [r for r in reasons if r]
            refused = [why for kind, why in bad if kind == REFUSED]
            if refused:  # one worker's mismatch refuses the version, whatever the others say
                raise WeightVerifyError(refused[0])
            if bad:
                raise WeightUnavailable(bad[0][1])
            if version is not None:
                self.version = version

    # --- [weights] delta_format = "packed" (weights.gpu_delta): a packed copy of the served weights in
    # each worker, which a version's packed delta is applied to and loaded from

    async def keep_packed(self, announcement: bytes, weights_dir: str | Path) -> str | None:
        """After reload_weights(weights_dir) of a version whose announcement carries its packed table:
        each worker keeps a packed copy of it (the model's bytes on its device), checked against the
        table. None when kept (`packed_name` names it), else why not (logged by the caller; the next
        packed delta is not applied here, its full version is fetched)."""
        from parley.weights.cuda_ipc import table_digest

        self.packed_name = None
        async with self._reload_lock:
            await self._prepare_gpu_load()  # the checksum kernel compiled before, not inside, the first fill
            reasons = await self._bounded_rpc(
                "parley_packed_fill",
                "filling the packed copy of the weights",
                announcement=announcement,
                weights_path=str(weights_dir),
            )
        bad = [r for r in reasons if r]
        if bad:
            await self.drop_packed()
            return bad[0]
        from parley.protocol import codec

        self.packed_name = table_digest(codec.decode("weights", announcement).packed)
        return None

    async def load_packed_delta(self, announcement: bytes, delta_path: str | Path, version: int) -> None:
        """Load a version from its packed delta (a file on this host): each worker applies it to its
        packed copy and checks the result against the announced table while generation runs, then
        the copy is loaded in a keep-mode pause as reload_weights does. A delta whose base the copy
        does not hold raises WeightUnavailable (fetch the full version), a malformed or mismatching
        one WeightVerifyError; neither changed what is served. A load that fails after that raises
        (the weights may be mixed: the caller restores them, restore_packed)."""
        from parley.protocol import codec
        from parley.weights.common import WeightUnavailable, WeightVerifyError
        from parley.weights.cuda_ipc import table_digest

        async with self._reload_lock:
            reasons = await self._bounded_rpc(
                "parley_packed_stage",
                f"applying the packed delta {delta_path}",
                announcement=announcement,
                delta_path=str(delta_path),
            )
            bad = [r for r in reasons if r]
            if bad:  # the workers whose stage took go back
                await self._bounded_rpc("parley_packed_revert", "reverting the packed delta")
                refused = [why for kind, why in bad if kind == REFUSED]
                raise WeightVerifyError(refused[0]) if refused else WeightUnavailable(bad[0][1])
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            loaded = False
            try:
                await self._bounded_rpc(
                    "parley_packed_load", f"loading version {version} from the packed copy", version=version
                )
                loaded = True
            finally:
                self._weights_epoch += 1  # also after a failure: the weights may be mixed until restored
                self._mixed = not loaded
                await self._resume()
            self.packed_name = table_digest(codec.decode("weights", announcement).packed)
            self.version = version

    async def restore_packed(self, version: int, revert: bool = False) -> None:
        """Load the packed copy again as `version` (the weights may be mixed after a failed load); with
        `revert`, after a failed load_packed_delta, what the copy held before that delta."""
        async with self._reload_lock:
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            loaded = False
            try:
                await self._bounded_rpc(
                    "parley_packed_load",
                    f"loading version {version} again from the packed copy",
                    version=version,
                    revert=revert,
                )
                loaded = True
            finally:
                self._weights_epoch += 1
                self._mixed = not loaded
                await self._resume()
            self.version = version

    async def drop_packed(self) -> None:
        self.packed_name = None
        await self._bounded_rpc("parley_packed_drop", "dropping the packed copy")

    async def _bounded_rpc(self, method: str, what: str, hold_s: float | None = None, **kwargs):
        """The workers' `method` (weights.worker.WorkerExtension), bounded as _bounded bounds it."""
        return await self._bounded(self._llm.collective_rpc(method, kwargs=kwargs), what, hold_s)

    async def _bounded(self, aw, what: str, hold_s: float | None = None):
        """`aw`, a step of a weights load, at most load_timeout_s, or `hold_s` (the learner's hold time on a
        GPU buffer): a TimeoutError past it says what was being done and what bounds it (a hung worker
        would otherwise keep generation paused for good)."""
        limit = self.settings.load_timeout_s if hold_s is None else hold_s
        self._loading += 1
        try:
            return await asyncio.wait_for(aw, timeout=limit)
        except TimeoutError:
            if hold_s is None:
                why = "[actor.engine] load_timeout_s); is the engine stuck?"
            else:
                why = "the learner's hold time); is the engine stuck, or the learner unreachable?"
            raise TimeoutError(f"{what} took over {limit:g} s ({why}") from None
        finally:
            self._loading -= 1

    async def _resume(self) -> None:
        """Resume generation after a load's pause, unless part of the engine still sleeps ([up] gpu_share
        = "phased" wakes the weights, loads a version, then wakes the KV cache): vLLM's resume_generation
        unpauses the scheduler whatever sleeps, and a request queued meanwhile would then run on KV cache
        memory that is not mapped. vLLM's own wake_up resumes the scheduler once nothing sleeps. Nor
        while the weights are mixed (_mixed): requests kept across the failed load wait for the whole
        version loaded next."""
        if not self._asleep and not self._mixed:
            await self._llm.resume_generation()

    async def _prepare_gpu_load(self) -> None:
        if not getattr(self, "_gpu_load_prepared", False):  # once, outside the hold-time bound of a load
            await self._bounded_rpc("parley_prepare_gpu_load", "preparing the GPU-buffer loads (the checksum kernel)")
            self._gpu_load_prepared = True

    async def load_adapter(self, adapter_dir: str | Path, version: int) -> None:
        """Load a LoRA adapter version (weights.lora.as_vllm_adapter's directory) beside the base, under a
        new adapter id; it becomes the newest (`self.version`). Nothing is paused: the base and the
        adapters loaded before keep serving."""
        from vllm.lora.request import LoRARequest

        await self._settled()
        request = LoRARequest(f"v{version}-{self._next_lora_id}", self._next_lora_id, str(adapter_dir))
        self._next_lora_id += 1
        if not await self._bounded(self._llm.add_lora(request), f"adding adapter version {version} from {adapter_dir}"):
            raise RuntimeError(f"vLLM did not load the adapter of version {version} from {adapter_dir}")
        await self._adopt_adapter(request, version)

    async def load_adapter_gpu(self, announcement: bytes, version: int, hold_s: float) -> None:
        """Load a LoRA adapter version that the learner packed into a GPU buffer (cuda_ipc; its encoded
        WeightVersion): each worker checks the buffer and copies the adapter's tensors out of it
        (WorkerExtension.parley_stage_adapter), then vLLM adds it from memory as load_adapter adds one
        from files, beside the base, nothing paused. A mismatch raises WeightVerifyError, a failure
        that passes WeightUnavailable, a copy past hold_s TimeoutError; nothing served changes then."""
        await self._prepare_gpu_load()
        await self._stage_adapter(version, hold_s, announcement=announcement)

    async def load_adapter_tensors(self, tensors: dict, adapter_config: dict, version: int) -> None:
        """Load a LoRA adapter version from tensors in this process (peft names; adapter_config: its
        peft config) through the same in-memory path as load_adapter_gpu, without a GPU buffer or a file."""
        from safetensors.torch import save

        from parley.weights.lora import config_json

        blob = save({k: v.contiguous() for k, v in tensors.items()})
        await self._stage_adapter(version, None, tensors=blob, config=config_json(adapter_config))

    async def _stage_adapter(self, version: int, hold_s: float | None, **source) -> None:
        """Stage the adapter in every worker and add it to vLLM there, in one RPC
        (WorkerExtension.parley_stage_adapter with lora_name), then make it the newest."""
        from vllm.lora.request import LoRARequest

        from parley.weights.common import WeightUnavailable, WeightVerifyError

        await self._settled()
        lora_id, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        request = LoRARequest(f"v{version}-{lora_id}", lora_id, f"{STAGED_ADAPTER_PATH}{lora_id}")
        try:
            reasons = await self._bounded_rpc(
                "parley_stage_adapter",
                f"staging adapter version {version}" + ("" if hold_s is None else " out of the learner's GPU buffer"),
                hold_s,
                lora_id=lora_id,
                lora_name=request.lora_name,
                **source,
            )
        except BaseException:  # the add failed in a worker (it unstaged there) or timed out; the others may hold it
            await self._forget(request)
            raise
        bad = [r for r in reasons if r]
        if bad:
            await self._forget(request)
            refused = [why for kind, why in bad if kind == REFUSED]
            raise WeightVerifyError(refused[0]) if refused else WeightUnavailable(bad[0][1])
        self._staged.add(lora_id)
        await self._adopt_adapter(request, version)

    async def _forget(self, request) -> None:
        """What a failed _stage_adapter may have left in some workers: the adapter added, its tensors staged."""
        await self._llm.remove_lora(request.lora_int_id)
        await self._unstage(request.lora_int_id)

    async def _unstage(self, lora_id: int) -> None:
        self._staged.discard(lora_id)
        await self._bounded_rpc("parley_unstage_adapter", f"unstaging adapter {lora_id}", lora_id=lora_id)

    async def _adopt_adapter(self, request, version: int) -> None:
        """`request` (added to vLLM) now serves `version`, the newest; what it replaces goes: the
        request it replaces and every older one no open conversation started on leave `adapters` at
        once and are removed from vLLM in the background (two RPCs each, off the version's path to
        serving); the next adapter load and every unload wait for that removal first (_settled), so
        vLLM never holds more adapters than it did when removals were awaited in line."""
        gone = [self.adapters.pop(version)] if version in self.adapters else []
        self.adapters[version] = request
        self.version = version
        gone += [self.adapters.pop(v) for v in [v for v in self.adapters if v != version and not self._users.get(v)]]
        if gone:
            before = self._removing

            async def remove() -> None:
                if before is not None:
                    await before
                for r in gone:
                    await self._remove_lora(r)

            self._removing = asyncio.ensure_future(remove())

    async def _settled(self) -> None:
        """Wait for the background removal of replaced adapters (_adopt_adapter); raises what it raised."""
        task, self._removing = self._removing, None
        if task is not None:
            await task

    async def _remove_lora(self, request) -> None:
        await self._llm.remove_lora(request.lora_int_id)
        if request.lora_int_id in self._staged:
            await self._unstage(request.lora_int_id)

    @property
    def serves_adapters(self) -> bool:
        """Whether this engine serves LoRA adapter versions (EngineSettings.max_lora_rank > 0)."""
        return self.settings.max_lora_rank > 0

    def adapter_name(self, version: int) -> str:
        """The vLLM adapter name `version` is served under ("" for the base alone)."""
        request = self.adapters.get(version)
        return request.lora_name if request is not None else ""

    def pin(self, version: int) -> None:
        """A conversation starts on adapter `version` (or the base): it stays loaded until every such one unpins."""
        if version not in self.adapters and version != self.base_version:
            raise KeyError(f"adapter version {version} is not loaded (loaded: {sorted(self.adapters)})")
        self._users[version] = self._users.get(version, 0) + 1

    async def unpin(self, version: int) -> None:
        """A conversation started on `version` is over; an older version nobody uses is unloaded."""
        left = self._users.get(version, 0) - 1
        if left > 0:
            self._users[version] = left
            return
        self._users.pop(version, None)
        if version != self.version:
            await self.drop_adapter(version)

    async def drop_adapter(self, version: int) -> None:
        """Unload an adapter version no conversation uses any more (never the newest)."""
        if version == self.version:
            raise ValueError(f"adapter version {version} is the newest; it stays loaded")
        await self._settled()
        request = self.adapters.pop(version, None)
        if request is not None:
            await self._remove_lora(request)

    # -- phased sharing ([up] gpu_share = "phased", actors/phases.py) ------------------------------

    @property
    def can_sleep(self) -> bool:
        """Whether sleep() frees GPU memory: built with sleep mode on a platform that has it."""
        return self.settings.sleep_mode and sleep_available()

    async def sleep(self, level: int) -> None:
        """Free the engine's GPU memory until wake_up: level 1 moves the weights to host memory and
        discards the KV cache, level 2 discards both (vLLM's sleep levels). The caller makes sure no
        request is in flight: vLLM would abort it. One added while the engine sleeps waits in vLLM's
        queue until both are awake again (its scheduler stays paused: _resume, wake_up). vLLM resets
        its prefix cache here (the KV is gone).
        A no-op where the engine cannot sleep (can_sleep: the CPU build)."""
        await self._settled()  # no adapter removal runs into the sleep
        if self.can_sleep:
            self._asleep = frozenset(("weights", "kv_cache"))  # before: a sleep that fails half-way may have freed them
            await self._llm.sleep(level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Give back what sleep freed: "weights" (after level 2 they hold no version: load one before
        serving), "kv_cache", or both (None). A no-op where the engine cannot sleep. vLLM resumes its
        scheduler (paused by the sleep, and by any load made since: _resume) once both are awake, so a
        wake that would leave nothing asleep while the weights are mixed (_mixed: a load failed half-way
        and nothing whole was loaded since) is refused with a RuntimeError: the requests vLLM holds
        would run on a mixed model, which _resume never allows either."""
        if self.can_sleep:
            rest = frozenset() if tags is None else self._asleep - set(tags)
            if self._mixed and not rest:
                raise RuntimeError(
                    f"not waking the engine ({', '.join(tags or ('all',))}): its weights are mixed after a load "
                    f"that failed half-way (served version {self.version} not restored), and once awake vLLM "
                    "resumes its scheduler on them"
                )
            await self._llm.wake_up(tags=None if tags is None else list(tags))
            self._asleep = frozenset() if tags is None else self._asleep - set(tags)

    # -- liveness -------------------------------------------------------------------------------

    def paused_here(self) -> bool:
        """Whether parley itself keeps the engine from stepping now: a weights load (bounded on its own by
        load_timeout_s or the learner's hold time), a sleep, weights mixed by a failed load."""
        return self._reload_lock.locked() or self._loading > 0 or bool(self._asleep) or self._mixed

    async def watch(self, stop: asyncio.Event, tick_s: float | None = None) -> None:
        """Until `stop`: raise EngineFailed once vLLM's engine core has died, or once requests have waited on
        the engine for stall_timeout_s while it took no step and parley did not pause it (paused_here). A
        hung engine core (a GPU kernel that never returns, a wedged worker) otherwise holds every request,
        and the conversations and tasks behind them, until the learner's group timeout or for good; a dead
        one fails each request as it comes, and its role would go on taking work it cannot do. The role
        stops instead, and its unfinished work is handed on (the actor's tasks are redelivered)."""
        limit = self.settings.stall_timeout_s
        tick = tick_s if tick_s is not None else min(5.0, limit / 4)
        steps, since = self.counts.steps, time.monotonic()
        last = since
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=tick)
            if stop.is_set() or self._llm is None:
                return
            if getattr(self._llm, "errored", False):
                raise EngineFailed(f"the engine of {self.settings.model} has died (vLLM's engine core is gone)")
            now = time.monotonic()
            # a tick far later than asked: this process did not run (SIGSTOP, a suspended machine, a blocked
            # loop), and the engine's outputs wait unread; not the engine's stall
            late, last = now - last > 2 * tick + 1.0, now
            if (
                late
                or self.counts.steps != steps
                or not self._requests
                or self.paused_here()
                or not self._steps_counted
            ):
                steps, since = self.counts.steps, now
            elif now - since > limit:
                raise EngineFailed(
                    f"the engine of {self.settings.model} held {self._requests} requests for {now - since:.0f} s "
                    f"without taking a step ([*.engine] stall_timeout_s = {limit:g}); is its GPU or worker hung?"
                )

    def shutdown(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.shutdown()


def parse_json(out: GenOut) -> Any:
    """json.loads of a generate_json result (raises ValueError on truncated output)."""
    return json.loads(out.text)
