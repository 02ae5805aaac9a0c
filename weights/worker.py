"""The project's side of each vLLM worker (engines.engine.PolicyEngine's engines load it through
vLLM's `worker_extension_cls`): in-place weight loads from files and from the GPU transports
(cuda_ipc, nccl), with the checks that make a wrong transfer a refusal, and LoRA adapters staged in
memory for vLLM's LoRA manager. Runs in the worker process, so it imports little at module level.
"""

from __future__ import annotations

import logging
import time

# What a worker's parley_load_gpu says of a version it did not load (its reasons cross vLLM's collective_rpc)
UNAVAILABLE = "unavailable"  # it passes: weights.common.WeightUnavailable, tried again
REFUSED = "refused"  # for good: weights.common.WeightVerifyError
# in a vLLM worker, under the logger vLLM configures in every process (so it reaches the engine's log)
_worker_log = logging.getLogger("vllm.parley")


class WorkerExtension:
    """Mixed into each vLLM worker through `worker_extension_cls`; runs in the worker process,
    so this module must stay import-safe and light."""

    def parley_reload_weights(self, weights_path: str) -> None:
        # vLLM's own in-place reload (Worker.reload_weights -> model_runner.reload_weights)
        self.reload_weights(weights_path=weights_path)
        _refresh_cpu_prepacked(self.model_runner.get_model())

    def parley_prepare_gpu_load(self) -> None:
        """Before this worker's first GPU-transport load, outside its hold-time bound: the checksum's
        implementation is chosen (the fused Triton kernel compiled and checked on CUDA, a second or
        two), so the load itself does not pay for it."""
        import torch

        if torch.cuda.is_available():
            from parley.weights.cuda_ipc import prepare_checksums

            _worker_log.info(
                "parley: GPU weight checksums by %s",
                prepare_checksums(torch.device("cuda", torch.cuda.current_device())),
            )

    def parley_stage_adapter(
        self,
        lora_id: int,
        announcement: bytes | None = None,
        tensors: bytes | None = None,
        config: str = "",
        lora_name: str = "",
    ) -> tuple[str, str] | None:
        """Keep a LoRA adapter's tensors in this worker under `lora_id`, for vLLM's LoRA manager to
        load from memory when the engine adds LoRARequest(lora_int_id=lora_id) (_stage_hook): from a
        GPU-transport announcement (cuda_ipc: the learner's packed buffer, checked, then copied out of
        it, so the learner may refill it), or `tensors` handed over as safetensors bytes (vLLM's RPC
        carries no tensors). `config`: the peft config's JSON (the announcement's LoraAdapter.config
        when none is given). With `lora_name`, the adapter is then added to this worker's LoRA manager
        as vLLM's add_lora would (LoRARequest(lora_name, lora_id, STAGED_ADAPTER_PATH + id)): one RPC
        from the engine instead of two; a failed add unstages it and raises. Returns None, or
        (UNAVAILABLE or REFUSED, why) as parley_load_gpu does; nothing served changes then."""
        import json

        from parley.protocol import codec
        from parley.weights.common import WeightUnavailable

        t0 = time.perf_counter()
        state: dict = {}
        if tensors is not None:
            from safetensors.torch import load

            tensors = load(tensors)
        else:
            wv = codec.decode("weights", announcement)
            transport = _gpu_transport(wv)
            if transport is None or wv.adapter is None:
                return REFUSED, f"version {wv.version}: announced as {wv.transport!r} without its GPU source or adapter"
            try:  # own=True: views into one copy of the whole buffer (the learner may refill its own)
                named, reason = transport.receive(wv, state, own=True)
            except WeightUnavailable as e:
                return UNAVAILABLE, f"adapter version {wv.version}: {e.reason}"
            if reason:
                return REFUSED, f"adapter version {wv.version}: {reason}"
            tensors = dict(named)
            del named
            broken = transport.loaded(wv, state)
            if broken:
                return UNAVAILABLE, f"adapter version {wv.version}: {broken}"
            config = config or wv.adapter.config
        if not hasattr(self, "_parley_adapters"):
            self._parley_adapters = {}
            _stage_hook(self.model_runner.lora_manager, self._parley_adapters)
        self._parley_adapters[lora_id] = (tensors, json.loads(config))
        t_staged = time.perf_counter()
        if lora_name:
            from vllm.lora.request import LoRARequest

            try:
                added = self.add_lora(LoRARequest(lora_name, lora_id, f"{STAGED_ADAPTER_PATH}{lora_id}"))
            except BaseException:
                self._parley_adapters.pop(lora_id, None)
                raise
            if not added:
                self._parley_adapters.pop(lora_id, None)
                raise RuntimeError(f"vLLM's LoRA manager did not add adapter {lora_name} (id {lora_id}) from memory")
        parts = state.get("receive_s") or {}
        _worker_log.info(
            "parley: adapter %d staged in memory (%d tensors) in %.4f s%s%s",
            lora_id,
            len(tensors),
            t_staged - t0,
            f" ({', '.join(f'{k} {v:.4f} s' for k, v in parts.items())})" if parts else "",
            f", added in {time.perf_counter() - t_staged:.4f} s" if lora_name else "",
        )
        return None

    def parley_unstage_adapter(self, lora_id: int) -> None:
        """Forget a staged adapter the engine removed (parley_stage_adapter)."""
        getattr(self, "_parley_adapters", {}).pop(lora_id, None)

    def parley_load_gpu(self, announcement: bytes) -> tuple[str, str] | None:
        """Load a GPU-transport version (cuda_ipc, nccl): receive the learner's packed buffer and check
        it, then reload the model's weights from it. Returns None when loaded, or (UNAVAILABLE or
        REFUSED, why) when not (nothing was changed then): a failure that passes, or one for good
        (a checksum mismatch, no longer held); raises when the source changed during the load (the
        transport's `loaded` says so: the served weights may be mixed, the actor restores them)."""
        import torch

        from parley.protocol import codec
        from parley.weights.common import WeightUnavailable

        t_start = time.perf_counter()
        wv = codec.decode("weights", announcement)
        transport = _gpu_transport(wv)
        if transport is None:
            return REFUSED, f"version {wv.version}: announced as {wv.transport!r} without its GPU source"
        if not hasattr(self, "_parley_weights"):
            self._parley_weights = {}  # what a transport keeps between versions (nccl: its joined group)
        try:
            named, reason = transport.receive(wv, self._parley_weights)
        except WeightUnavailable as e:  # passes (did not open, receive broke, out of memory): tried again
            return UNAVAILABLE, f"version {wv.version}: {e.reason}"
        if reason:
            return REFUSED, f"version {wv.version}: {reason}"
        t_received = time.perf_counter()
        how = self._parley_load_named(named, wv.version)
        del named  # views of the learner's buffer, or of the staged copy (its memory goes back to torch's cache)
        broken = transport.loaded(wv, self._parley_weights)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t_loaded = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # a staged copy or the layer-wise reload's layers go back to the GPU
        if broken:
            raise RuntimeError(f"version {wv.version}: {broken}")
        parts = self._parley_weights.pop("receive_s", None) or {}
        _worker_log.info(
            "parley: version %d loaded (%s) in %.4f s: receive+check %.4f s (%s), load %.4f s, release %.4f s",
            wv.version,
            how,
            time.perf_counter() - t_start,
            t_received - t_start,
            ", ".join(f"{k} {v:.4f} s" for k, v in parts.items()) or "-",
            t_loaded - t_received,
            time.perf_counter() - t_loaded,
        )
        return None

    def _parley_load_named(self, named, version: int) -> str:
        """Load (checkpoint name, tensor) pairs into the served model in place; says how."""
        model = self.model_runner.get_model()
        if not hasattr(self, "_parley_bare_why"):  # the model's layers do not change while it serves
            self._parley_bare_why = bare_load_refusal(model)
        if self._parley_bare_why is None:
            # Every layer of this model takes its weights as loaded (no post-load processing on this
            # platform): the model's own load_weights copies each received tensor into its parameter
            # through that parameter's weight_loader (stacking q/k/v, gate/up in place), so the
            # served tensors keep their addresses (CUDA graphs) and nothing points into the buffer.
            missing = _not_loaded(model, model.load_weights(iter(named)))
            if missing:  # never seen: then this model needs the layer-wise reload, now and from now on
                self._parley_bare_why = (
                    f"a bare load_weights left {len(missing)} parameters unloaded (first: {missing[0]})"
                )
                _worker_log.warning(
                    "parley: version %d: %s; reloading it layer by layer", version, self._parley_bare_why
                )
        if self._parley_bare_why is not None:
            # vLLM's in-place layer-wise reload, fed our tensors instead of files: the same machinery
            # as parley_reload_weights (it redoes each layer's post-load processing, which a bare
            # load_weights misses: on CPU the packed linear layers lose their weight_loader). It
            # materializes each layer anew, loads it, processes it and copies the result into the
            # engine's own tensors.
            self.reload_weights(weights_iterator=iter(named))
        _refresh_cpu_prepacked(model)
        return "bare load_weights" if self._parley_bare_why is None else f"layer-wise reload: {self._parley_bare_why}"

    # --- [weights] delta_format = "packed": a packed copy of the served weights (weights.gpu_delta.Mirror)

    def parley_packed_fill(self, announcement: bytes, weights_path: str) -> str | None:
        """After a file load of a version whose announcement carries its packed table: keep a packed
        copy of it on this worker's device, from the file just loaded, checked against the table's
        checksums. None when held; else why not (nothing held then: the next packed delta is not
        applied here, the full version is fetched)."""
        import torch
        from safetensors.torch import load_file

        from parley.protocol import codec
        from parley.weights.common import WeightVerifyError
        from parley.weights.gpu_delta import Mirror

        wv = codec.decode("weights", announcement)
        if not hasattr(self, "_parley_mirror"):
            self._parley_mirror = Mirror()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        t0 = time.perf_counter()
        try:  # read on the host and copied into place: the file's tensors never sit beside the copy on the GPU
            self._parley_mirror.fill(load_file(f"{weights_path}/model.safetensors"), wv.packed, device)
        except (WeightVerifyError, OSError, RuntimeError) as e:  # OOM too: nothing held, deltas not applied here
            self._parley_mirror.drop()
            return f"version {wv.version}: no packed copy kept: {e}"
        _worker_log.info(
            "parley: version %d kept packed (%.1f MB) in %.4f s",
            wv.version,
            self._parley_mirror.buffer.numel() / 1e6,
            time.perf_counter() - t0,
        )
        return None

    def parley_packed_stage(self, announcement: bytes, delta_path: str) -> tuple[str, str] | None:
        """Apply a version's packed delta (a file fetched beside the served files) to the packed copy,
        checked against the announced table, before the engine pauses to load it (parley_packed_load).
        None when staged; (UNAVAILABLE, why) when the copy does not hold the delta's base or the apply
        failed for a passing reason (out of memory: the full version is fetched), (REFUSED, why) for
        a delta that is malformed or does not give the announced checksums (the copy holds its base
        again)."""
        from pathlib import Path

        from parley.protocol import codec
        from parley.weights.common import WeightVerifyError

        wv = codec.decode("weights", announcement)
        mirror = getattr(self, "_parley_mirror", None)
        if mirror is None or mirror.name != wv.delta.base_sha256:
            return UNAVAILABLE, f"version {wv.version}: the packed copy here does not hold its delta's base"
        t0 = time.perf_counter()
        try:
            mirror.apply(Path(delta_path).read_bytes(), wv.packed)
        except WeightVerifyError as e:
            return REFUSED, f"version {wv.version}: {e.reason}"
        except (OSError, RuntimeError) as e:  # unreadable, out of memory: the copy holds its base (apply put it back)
            return UNAVAILABLE, f"version {wv.version}: packed delta not applied: {type(e).__name__}: {e}"
        _worker_log.info(
            "parley: version %d: packed delta (%.2f MB) applied and checked in %.4f s",
            wv.version,
            Path(delta_path).stat().st_size / 1e6,
            time.perf_counter() - t0,
        )
        return None

    def parley_packed_load(self, version: int, revert: bool = False) -> None:
        """Load the packed copy into the served model (after parley_packed_stage; with `revert`, the
        version it held before the staged delta: a restore after a failed load)."""
        import torch

        mirror = self._parley_mirror
        if revert:
            mirror.revert()
        t0 = time.perf_counter()
        how = self._parley_load_named(mirror.named(), version)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        mirror.settle()
        _worker_log.info(
            "parley: version %d loaded from the packed copy (%s) in %.4f s", version, how, time.perf_counter() - t0
        )

    def parley_packed_revert(self) -> None:
        """Put back what the packed copy held before a staged delta another worker refused."""
        mirror = getattr(self, "_parley_mirror", None)
        if mirror is not None:
            mirror.revert()

    def parley_packed_drop(self) -> None:
        """Forget the packed copy (the served weights came from elsewhere)."""
        mirror = getattr(self, "_parley_mirror", None)
        if mirror is not None:
            mirror.drop()


def _gpu_transport(wv):
    """The GPU transport that announced `wv`, or None when it names none or carries no GPU source."""
    from parley.weights import registry

    transport = registry.get(wv.transport)
    return transport if transport is not None and transport.gpu and transport.source(wv) is not None else None


STAGED_ADAPTER_PATH = "/parley/staged-adapter/"  # + lora id: a LoRARequest path of an adapter held in memory


def _stage_hook(manager, staged: dict) -> None:
    """Make vLLM's worker LoRA manager build an adapter from the tensors staged under its LoRA id
    (WorkerExtension.parley_stage_adapter) instead of reading lora_path, through the same LoRAModel
    factory (from_lora_tensors) and the same config checks (PEFTHelper.validate_legal) as its
    loader from files; any other adapter loads from its files as before. The manager adds and
    activates what this returns exactly as a file-loaded adapter, also after an eviction."""
    import inspect

    from vllm.lora.peft_helper import PEFTHelper

    from_files = manager._load_adapter

    def load(lora_request):
        entry = staged.get(lora_request.lora_int_id)
        if entry is None:
            return from_files(lora_request)
        tensors, config = entry
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        options = {
            "device": str(next(iter(tensors.values())).device),
            "dtype": manager.lora_config.lora_dtype,
            "model_vocab_size": manager.vocab_size,
            "weights_mapper": mapper.get_rename_mapper() if mapper is not None else None,
            "skip_prefixes": getattr(model, "lora_skip_prefixes", None),
        }
        factory = manager._lora_model_cls.from_lora_tensors
        known = inspect.signature(factory).parameters
        return scaled_in_place(
            factory(lora_request.lora_int_id, tensors, helper, **{k: v for k, v in options.items() if k in known})
        )

    manager._load_adapter = load


def scaled_in_place(lora_model):
    """Fold each module's LoRA scaling into its B matrix now, as vLLM's LoRALayerWeights.optimize
    does when the manager adds the adapter (`lora_b * scaling`, then scaling 1, so optimize finds
    nothing left to do), but in one multi-tensor kernel per scaling value instead of one multiply per
    module: for the 4B shape's 252 modules that was 252 launches inside vLLM's add_lora.

    Out of place: the B matrices are new tensors, and the staged ones stay as the learner sent them.
    vLLM's optimize multiplies in place, and from_lora_tensors hands it the staged tensors themselves
    (same device and dtype: no copy), so an adapter that vLLM's cache evicted and builds again from
    them (_stage_hook's load) would have been scaled twice. Only a scaling the B matrix's dtype holds
    exactly (alpha / rank = 2, 4, 0.5, 1.5, ...) goes through the multi-tensor multiply: torch's may
    round the scalar to that dtype first (it does on CPU), which would change the numbers for any other
    value; those are multiplied one module at a time, as optimize does, bit for bit the same."""
    import torch

    groups: dict[tuple[float, torch.dtype], list] = {}
    for weights in lora_model.loras.values():
        scaling, b = getattr(weights, "scaling", 1), getattr(weights, "lora_b", None)
        if not isinstance(scaling, (int, float)) or scaling == 1 or not isinstance(b, torch.Tensor):
            continue
        if float(torch.tensor(scaling, dtype=b.dtype)) == scaling:
            groups.setdefault((float(scaling), b.dtype), []).append(weights)
        else:
            weights.lora_b, weights.scaling = b * scaling, 1
    for (scaling, _), members in groups.items():
        for w, scaled in zip(members, torch._foreach_mul([w.lora_b for w in members], scaling)):
            w.lora_b, w.scaling = scaled, 1
    return lora_model


def bare_load_refusal(model) -> str | None:
    """None when the model's own load_weights alone loads a new version exactly, decided from vLLM's
    per-layer metadata; else why vLLM's layer-wise reload is needed (the first layer that says so).

    A bare load is exact when no layer processes its weights after loading on this platform:
    unquantized linear and embedding layers do so only on CPU (they repack into oneDNN handles
    there), attention layers only when they carry quantization scales, and any other quantization
    method (fp8, int4, ...) always does. That is the case of a bf16 or fp32 model on a GPU: its
    reload then skips the layer-wise machinery, which materializes every layer a second time."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "vLLM's CPU build repacks linear weights after loading"
    plain = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    for name, module in model.named_modules():
        if hasattr(module, "base_layer"):  # a LoRA wrapper: its parameters are named under base_layer
            return f"{name} is wrapped for LoRA"
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, plain):
            return f"{name or 'the model'} processes its weights after loading ({type(method).__name__})"
    return None


def _not_loaded(model, loaded) -> list[str]:
    """The model's parameters a load_weights call did not report as loaded (none known when the
    model's load_weights reports nothing)."""
    if loaded is None:
        return []
    loaded = set(loaded)
    return [n for n, _ in model.named_parameters() if n not in loaded]


def _refresh_cpu_prepacked(model) -> None:
    """Work around stale prepacked GEMM weights after an in-place reload on CPU (vLLM 0.32).

    On CPU, vLLM prepacks every linear weight into a oneDNN (or AMX) handle when the model
    loads. The in-place reload repacks the layers it loads into, but a tied lm_head shares its
    weight with embed_tokens and receives nothing of its own, so its handle keeps the *old*
    embedding: logits come out of the previous lm_head (measured: log-probs off by >1 nat on
    the toy model, while the embedding lookup saw the new weights). Layers that keep their
    weight tensor next to the packed copy (embeddings, lm_head) are repacked from it here;
    linear layers drop the tensor after packing and were repacked by the reload itself.
    GPUs read the shared weight directly and need none of this.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            hasattr(module, "cpu_linear")
            and not getattr(module, "_cpu_skip_gemm_dispatch", False)
            and isinstance(weight, torch.Tensor)
            and weight.ndim == 2
            and weight.numel() > 0
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
