"""LoRA adapter versions ([learner.lora]): what a version holds when it is an adapter on a frozen
base, the base's identity, and how an adapter travels. The adapter goes through the file transports
(objstore, shared_dir) like whole weights, its tensors as the version's blob and its peft config
(adapter_config.json) among the extra files; the announcement carries protocol.messages.LoraAdapter.
The learner publishes with publish_adapter; the actor fetches with weights.registry.fetch_version,
checks the base (adapter_problem) and hands the directory from as_vllm_adapter to its engine.

Under [weights] kind = "cuda_ipc" the adapter stays in GPU memory instead: the learner packs its
tensors into one of rank 0's shared buffers (as whole weights are, weights.cuda_ipc) and announces it
with publish_adapter_gpu, the peft config inside the announcement (LoraAdapter.config); the actor's
engine worker copies the tensors out of the buffer after checking them and hands them to vLLM's LoRA
manager without a file (engines.engine.PolicyEngine.load_adapter_gpu).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from parley.protocol.messages import LoraAdapter, WeightVersion
from parley.weights.common import MODEL_FILE, announce, fresh_prefix, upload_files

ADAPTER_CONFIG = "adapter_config.json"  # peft's config of the adapter: rank, alpha, target modules
ADAPTER_FILE = "adapter_model.safetensors"  # the name vLLM's LoRA loader reads the tensors from
# Whole-file digests of base shards already hashed, by (path, size, mtime, ctime): in this process, and
# in DIGEST_CACHE across processes, so a restarted learner or actor does not read 8 GB again. A file
# rewritten in place changes its mtime and ctime, and ctime cannot be set back by a user.
_DIGESTS: dict[tuple[str, int, int, int], str] = {}
DIGEST_CACHE = "file-sha256.json"


def _digest_cache_path() -> Path:
    base = os.environ.get("PARLEY_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "parley") / DIGEST_CACHE


def file_sha256(path: Path) -> str:
    """sha256 of the whole file (streamed), cached by (resolved path, size, mtime_ns, ctime_ns)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    cache_file = _digest_cache_path()
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key[0]) if isinstance(cached, dict) else None
    if isinstance(entry, list) and len(entry) == 4 and entry[:3] == list(key[1:]) and isinstance(entry[3], str):
        _DIGESTS[key] = entry[3]
        return entry[3]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    _DIGESTS[key] = digest = h.hexdigest()
    try:  # a cache that cannot be written (read-only home) only costs the next process a re-read
        cached = cached if isinstance(cached, dict) else {}
        cached[key[0]] = [*key[1:], digest]
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cached))
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return digest


def base_identity(model_dir: str | Path) -> str:
    """The identity of a base model directory, the same wherever the files lie: sha256 over its
    config.json (parsed, keys sorted) and, per *.safetensors file by name, its size and the sha256
    of the whole file (file_sha256: read once, then cached). Two bases that differ in architecture,
    layout or any weight byte differ here. Reads every shard the first time (seconds per GB): call
    it off the event loop."""
    d = Path(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((d / "config.json").read_text()), sort_keys=True).encode())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{file_sha256(f)}:".encode())
    return h.hexdigest()[:32]


def adapter_problem(wv: WeightVersion, base: str, max_rank: int) -> str | None:
    """Why this actor cannot serve the adapter version `wv` (None if it can): another base, or a rank
    above its engine's max_lora_rank."""
    a = wv.adapter
    if a.base != base:
        return (
            f"the adapter is for base {a.base!r}, this actor serves base {base!r}: start the actor on the "
            "learner's [policy] model"
        )
    if not 1 <= a.rank <= max_rank:
        return (
            f"adapter rank {a.rank} is outside 1..{max_rank} (the engine's max_lora_rank); raise [actor] max_lora_rank"
        )
    return None


def as_vllm_adapter(version_dir: str | Path) -> Path:
    """The fetched version directory as vLLM's LoRA loader reads it: the verified blob also under
    ADAPTER_FILE (a hard link, no copy)."""
    d = Path(version_dir)
    target = d / ADAPTER_FILE
    if not target.exists():
        os.link(d / MODEL_FILE, target)
    if not (d / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{d / ADAPTER_CONFIG} is missing: an adapter version carries its peft config")
    return d


def write_adapter(state: dict, adapter_config: dict, out_dir: str | Path) -> Path:
    """The adapter's tensors (peft names) as MODEL_FILE and its config as ADAPTER_CONFIG in out_dir:
    what publish_adapter uploads; durable when this returns (weights.snapshot.write_version_files)."""
    from parley.weights.snapshot import write_version_files

    return write_version_files(out_dir, MODEL_FILE, state, {ADAPTER_CONFIG: config_json(adapter_config)})


async def publish_adapter(
    js,
    run: str,
    version: int,
    step: int,
    adapter_dir: str | Path,
    settings,
    *,
    base: str,
    rank: int,
    keep: int = 3,
    protect=frozenset(),
) -> WeightVersion:
    """Upload `adapter_dir` (write_adapter's) by the file transport `settings` selects, announce it
    as an adapter on `base` (the same key and compare-and-set as whole weights), prune old versions."""
    from parley.weights import registry

    transport = registry.of(settings)
    if transport.gpu:
        raise ValueError(
            f"[weights] kind={transport.kind!r} moves whole weights in GPU memory; a LoRA adapter "
            "travels by a file transport: use kind objstore or shared_dir"
        )
    d = Path(adapter_dir)
    if not (d / MODEL_FILE).is_file() or not (d / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{d} lacks {MODEL_FILE} or {ADAPTER_CONFIG}; write it with write_adapter first")
    extras = sorted(p.name for p in d.iterdir() if p.is_file() and p.name != MODEL_FILE)
    stored = await upload_files(transport, js, run, fresh_prefix(version), d, extras, settings)
    wv = WeightVersion(
        version=version,
        step=step,
        transport=transport.kind,
        run=run,
        adapter=LoraAdapter(base=base, rank=rank),
        **stored,
    )
    await announce(js, run, wv)
    await transport.prune(js, run, settings, keep, current=version, protect=set(protect))
    return wv


def config_json(adapter_config: dict) -> str:
    """The peft config as JSON: ADAPTER_CONFIG's text (write_adapter) and LoraAdapter.config (cuda_ipc)."""
    return json.dumps(adapter_config, indent=1, sort_keys=True, default=list)


async def publish_adapter_gpu(
    js, run: str, version: int, step: int, source, *, base: str, rank: int, adapter_config: dict
) -> WeightVersion:
    """Announce an adapter packed into a shared GPU buffer (`source`: the CudaIpcBuffer that
    weights.cuda_ipc.IpcPublisher.pack returned for the adapter's tensors): nothing is uploaded; the
    announcement is whole weights' (weights.registry.gpu_announcement: the tensor table with its
    checksums) with the adapter's base, rank and peft config."""
    import msgspec

    from parley.weights import registry

    wv = registry.gpu_announcement(run, version, step, source)
    if not registry.get(wv.transport).carries_adapters:
        raise ValueError(
            f"[weights] kind={wv.transport!r} does not carry LoRA adapters; use kind cuda_ipc, objstore or shared_dir"
        )
    wv = msgspec.structs.replace(wv, adapter=LoraAdapter(base=base, rank=rank, config=config_json(adapter_config)))
    await announce(js, run, wv)
    return wv
