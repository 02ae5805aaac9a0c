"""Weight path benchmark: from the end of a learner step to an actor holding verified weights.

Times, per model and transport: save (state dict -> model.safetensors + config.json), publish
(upload with sha256, KV compare-and-set, until the actor's KV watcher wakes), fetch+verify (the
actor reads the blob into a file and checks sha256 and size), and the total from step end to
verified weights, against a raw copy of the same bytes on the same disk in the same run. A real nats-server is
started in a temporary directory. Writes a markdown table (and --json).

    .venv/bin/python bench/weight_path.py --models tiny smol --repeats 3

On a GPU, `--transport cuda_ipc` measures the whole path instead, on one GPU: a learner (this
process, a Qwen3-4B-shaped bf16 model on the GPU) and a vLLM engine process (PolicyEngine, CUDA
graphs) followed by the actor's own WeightFollower; from step end to the engine serving the new
version with generation resumed, for cuda_ipc against shared_dir and objstore in the same run,
plus the tokens/s of 64 in-flight requests with and without an update in the middle:

    python3 bench/weight_path.py --transport cuda_ipc --model /tmp/m4b --build 4b --json $OUT/weight_path.json

`--gpu-transports objstore_packed shared_dir_packed` times [weights] delta_format = "packed" on those
file transports instead; `--grads 1e-6 1e-5` makes each version a real AdamW step at those rates
(bench/gpu_run.sh W5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def file_settings(kind: str, work: Path):
    """The [weights] of a file transport named on the command line (shared_dir: under work)."""
    from parley.weights.config import ObjstoreWeights, SharedDirWeights

    return {"objstore": ObjstoreWeights(), "shared_dir": SharedDirWeights(dir=str(work / "shared"))}[kind]


async def one_model(js, name: str, transport: str, repeats: int, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from parley.engines.models import ensure_model
    from parley.protocol import codec, topology
    from parley.weights.registry import fetch_version, publish_version
    from parley.weights.snapshot import hf_weights, write_weights

    run = f"bench-{name}-{transport}".replace("_", "-")
    settings = file_settings(transport, work)
    await topology.ensure_topology(js, run, topology.BusSettings(max_bytes=256 * 1024**2))
    kv = await js.key_value(topology.kv_bucket(run))
    model = AutoModelForCausalLM.from_pretrained(ensure_model(name), dtype=torch.float32)  # what the CPU learner serves
    rows = []
    for rep in range(repeats):
        version = rep + 1
        watcher = await kv.watch(topology.WEIGHTS_KEY, include_history=False)
        seen = asyncio.get_running_loop().create_future()

        async def actor():
            # The actor side as the follower does it: wake on the key, fetch, verify.
            while True:
                entry = await watcher.updates(timeout=60)
                if entry is None or not entry.value:
                    continue
                wv = codec.decode("weights", entry.value)
                if wv.version == version:
                    t_seen = time.perf_counter()
                    path = await fetch_version(
                        js, run, wv, work / f"actor-{name}-{transport}" / f"v{version}", settings=settings
                    )
                    seen.set_result((t_seen, time.perf_counter(), path, wv))
                    return

        task = asyncio.create_task(actor())
        await asyncio.sleep(0.05)  # the watcher is subscribed
        state_dir = work / f"learner-{name}" / f"v{version}"
        t0 = time.perf_counter()  # step end
        await asyncio.to_thread(lambda: write_weights(hf_weights(model), model.config, state_dir))
        t_saved = time.perf_counter()
        await publish_version(js, run, version, version, state_dir, settings, keep=2)
        t_announced = time.perf_counter()
        t_seen, t_verified, path, wv = await asyncio.wait_for(seen, timeout=300)
        await task
        await watcher.stop()

        raw_dst = work / f"raw-{name}.bin"
        r0 = time.perf_counter()
        await asyncio.to_thread(shutil.copyfile, state_dir / "model.safetensors", raw_dst)
        raw = time.perf_counter() - r0
        raw_dst.unlink()
        # The actor may see the key before publish_version returns (it prunes old versions last).
        rows.append(
            dict(
                save=t_saved - t0,
                publish=t_seen - t_saved,
                publish_return=t_announced - t_saved,
                fetch=t_verified - t_seen,
                total=t_verified - t0,
                raw_copy=raw,
                bytes=wv.bytes,
            )
        )
        shutil.rmtree(state_dir.parent, ignore_errors=True)  # next repeat writes from scratch
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med.update(model=name, transport=transport, repeats=repeats)
    return med


async def main(args) -> list[dict]:
    from parley.deploy.natsserver import NatsServer
    from parley.protocol.connect import connect

    results = []
    with tempfile.TemporaryDirectory(prefix="parley-weightbench-", dir=args.work) as tmp:
        work = Path(tmp)
        server = NatsServer(work / "nats", port=0)
        url = server.start()
        try:
            nc = await connect(url, name="weight-bench")
            js = nc.jetstream()
            for name in args.models:
                for transport in args.transports:
                    r = await one_model(js, name, transport, args.repeats, work)
                    results.append(r)
                    print(
                        f"{name:5s} {transport:10s} {r['bytes'] / 1e6:7.1f} MB  save {r['save']:.3f}s  publish {r['publish']:.3f}s  "
                        f"fetch+verify {r['fetch']:.3f}s  total {r['total']:.3f}s  "
                        f"raw copy {r['raw_copy']:.3f}s  ratio {r['total'] / r['raw_copy']:.1f}x",
                        file=sys.stderr,
                    )
            await nc.close()
        finally:
            server.stop()
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| model | transport | size MB | save s | publish s | fetch+verify s | total s | raw copy s | total / raw copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['transport']} | {r['bytes'] / 1e6:.1f} | {r['save']:.3f} | {r['publish']:.3f} | "
            f"{r['fetch']:.3f} | {r['total']:.3f} | {r['raw_copy']:.3f} | {r['total'] / r['raw_copy']:.1f}x |"
        )
    return "\n".join(lines)


# -- the GPU path: learner -> engine on one GPU ---------------------------------------------------


class TimedEngine:
    """Wraps the PolicyEngine the follower drives, recording when each load starts and ends."""

    def __init__(self, engine):
        self.engine, self.marks = engine, []

    @property
    def version(self):
        return self.engine.version

    async def reload_weights(self, path, version=None):
        t = time.perf_counter()
        await self.engine.reload_weights(path, version=version)
        self.marks.append((t, time.perf_counter()))

    async def load_gpu(self, announcement, hold_s, version=None):
        t = time.perf_counter()
        await self.engine.load_gpu(announcement, hold_s=hold_s, version=version)
        self.marks.append((t, time.perf_counter()))

    # [weights] delta_format = "packed" (objstore_packed below): the engine's packed copy
    @property
    def packed_name(self):
        return self.engine.packed_name

    async def load_packed_delta(self, announcement, delta_path, version):
        t = time.perf_counter()
        await self.engine.load_packed_delta(announcement, delta_path, version)
        self.marks.append((t, time.perf_counter()))

    async def keep_packed(self, announcement, weights_dir):
        t = time.perf_counter()
        why = await self.engine.keep_packed(announcement, weights_dir)
        self.keep_s = time.perf_counter() - t
        return why

    async def drop_packed(self):
        await self.engine.drop_packed()

    async def restore_packed(self, version, revert=False):
        await self.engine.restore_packed(version, revert=revert)


PACKED = ("objstore_packed", "shared_dir_packed")  # [weights] delta_format = "packed" on a file transport


def packed_settings(transport: str, work: Path):
    """objstore_packed, shared_dir_packed: that file transport with [weights] delta_format = "packed"
    and no full-only versions after the first (a delta unless it is over delta_max_share)."""
    import msgspec

    return msgspec.structs.replace(
        file_settings(transport.removesuffix("_packed"), work), full_every=1000, delta_format="packed"
    )


async def gpu_update(js, run, transport, version, model, pub, work, follower, timed, packer=None) -> dict:
    """One update through the real follower: step end -> (pack | save) -> announce -> the follower
    loads it -> the engine serves `version` with generation resumed. Seconds per phase.
    objstore_packed: the learner's packed delta (weights.gpu_delta, `packer`) announced early and the
    full copy written and uploaded after it, as weights.publish does; `full_stored` is step end ->
    that copy announced."""
    from parley.weights import registry
    from parley.weights.snapshot import hf_tensors, hf_weights, write_weights

    if transport in PACKED:
        return await packed_update(js, run, transport, version, model, work, follower, timed, packer)
    gpu = registry.get(transport).gpu
    timed.marks.clear()
    if gpu:  # a buffer to write before the step ends: IpcPublisher skips a version while all are held
        while (wait := pub.writable_in()) > 0:
            await asyncio.sleep(min(wait, 1.0))
    t0 = time.perf_counter()  # step end
    fill = {}
    if gpu:
        ipc = await asyncio.to_thread(pub.pack, hf_tensors(model), version)
        t_ready = time.perf_counter()
        fill = {f"fill_{k}": v for k, v in pub.fill_s.items()}  # of pack_or_save: the copies, the checksum
        wv = await registry.publish_gpu_version(js, run, version, version, ipc)
    else:
        state_dir = work / "learner" / f"v{version}"
        await asyncio.to_thread(lambda: write_weights(hf_weights(model), model.config, state_dir))
        t_ready = time.perf_counter()
        wv = await registry.publish_version(
            js, run, version, version, state_dir, file_settings(transport, work), keep=1
        )
    t_announced = time.perf_counter()
    deadline = t0 + 600
    while follower.serving != (version, wv.sha256):
        if time.perf_counter() > deadline or version in follower.refused:
            raise RuntimeError(
                f"{transport} version {version} not served: {follower.refused.get(version, 'timed out')}"
            )
        await asyncio.sleep(0.001)
    t_served = time.perf_counter()
    load_start, load_end = timed.marks[-1]
    if not gpu:
        import shutil

        shutil.rmtree(work / "learner", ignore_errors=True)
    return dict(
        transport=transport,
        version=version,
        bytes=wv.bytes,
        pack_or_save=t_ready - t0,
        announce=t_announced - t_ready,
        until_load=load_start - t_announced,
        load=load_end - load_start,
        total=t_served - t0,
        **fill,
    )


async def packed_update(js, run, transport, version, model, work, follower, timed, packer) -> dict:
    import shutil

    from parley.weights import registry
    from parley.weights.snapshot import hf_tensors, write_weights

    settings = packed_settings(transport, work)
    timed.marks.clear()
    t0 = time.perf_counter()  # step end
    share = settings.delta_max_share if packer.version is not None else None  # the first one: full only
    table, pending = await asyncio.to_thread(packer.pack, hf_tensors(model), version, share)
    t_ready = time.perf_counter()  # what the learner's step waits for; the rest is the publication's
    state_dir = work / "learner" / f"v{version}"
    encoded: dict = {}

    async def publication():  # weights.publish.Weights.upload: encode, publish, the file from the buffer
        try:
            blob, base_version, base = await asyncio.to_thread(pending.encode)
            encoded["blob"], encoded["s"] = blob, time.perf_counter() - t_ready
            return await registry.publish_version(
                js,
                run,
                version,
                version,
                state_dir,
                settings,
                keep=2,
                packed=(table, blob, base_version, base),
                write=lambda: write_weights(pending.host_state(), model.config, state_dir),
            )
        finally:
            pending.discard()

    def buffers_free() -> float:  # when nothing reads the learner's buffers any more: a learner whose step
        pending.done.wait(600)  # is shorter than this waits at its next pack (weights.publish's packed_waited)
        return time.perf_counter()

    publish = asyncio.create_task(publication())
    released = asyncio.create_task(asyncio.to_thread(buffers_free))
    deadline = t0 + 600
    while follower.version != version:
        if time.perf_counter() > deadline or version in follower.refused or publish.done() and publish.exception():
            publish.cancel()
            why = follower.refused.get(version) or (publish.done() and not publish.cancelled() and publish.exception())
            raise RuntimeError(f"{transport} version {version} not served: {why or 'timed out'}")
        await asyncio.sleep(0.001)
    t_served = time.perf_counter()
    load_start, load_end = timed.marks[-1]
    blob = encoded.get("blob")
    row = dict(
        transport=transport,
        version=version,
        delta=blob is not None,
        bytes=len(blob) if blob is not None else 0,  # a full version: its file's, once stored
        pack_or_save=t_ready - t0,
        pack_waited=pending.pack_waited_s,
        encode=encoded.get("s"),
        announce=load_start - t_ready,
        until_load=0.0,
        load=load_end - load_start,
        total=t_served - t0,
    )
    try:  # the full copy, written and uploaded beside (the next version waits for it, as the publisher would)
        wv = await publish
        row["full_stored"], row["bytes"] = time.perf_counter() - t0, (row["bytes"] or wv.bytes)
    except Exception as e:  # noqa: BLE001 - the version was served; what failed after is recorded
        row["full_error"] = f"{type(e).__name__}: {e}"
        print(
            f"[weights] {transport} v{version}: its full publication failed after serving: {row['full_error']}",
            file=sys.stderr,
            flush=True,
        )
    row["buffers_busy"] = await released - t_ready  # encode + host copy: the shortest step that never waits
    if blob is None:  # a full version: the actor keeps it packed before the next one is timed
        from parley.weights.cuda_ipc import table_digest

        while timed.packed_name != table_digest(table):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{transport} version {version}: no packed copy kept by the actor")
            await asyncio.sleep(0.01)
        row["keep_packed"] = getattr(timed, "keep_s", None)
    shutil.rmtree(work / "learner", ignore_errors=True)
    return row


async def gpu_main(args) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from bench.common import random_qwen3
    from parley.deploy.natsserver import NatsServer
    from parley.engines.engine import EngineSettings, PolicyEngine
    from parley.protocol import topology
    from parley.protocol.connect import connect
    from parley.weights.cuda_ipc import IpcPublisher
    from parley.weights.follow import WeightFollower
    from parley.weights.snapshot import hf_tensors

    if args.build:
        t = time.perf_counter()
        random_qwen3(args.build, args.model)
        print(
            f"[weights] built {args.build} in {args.model}: {time.perf_counter() - t:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    # Without a GPU (a smoke run of the file transports on the toy model) the engine is vLLM's CPU
    # build: fp32 and an explicit KV cache size (docs/gpu.md, ENVIRONMENT.md).
    gpu = torch.cuda.is_available()
    dtype = "bfloat16" if gpu else "float32"
    model = (
        AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype))
        .to("cuda" if gpu else "cpu")
        .eval()
    )
    out: dict = {
        "model": args.model,
        "gpu": torch.cuda.get_device_name(0) if gpu else "none (CPU smoke run)",
        "torch": torch.__version__,
        "grads_lrs": args.grads,
        "updates": [],
        "rounds": [],
    }
    t = time.perf_counter()
    engine = PolicyEngine(
        EngineSettings(
            model=args.model,
            dtype=dtype,
            max_model_len=args.plen + args.tokens + 8,
            kv_cache_bytes=None if gpu else 256 << 20,
            gpu_memory_utilization=args.gpu_mem if gpu else None,
            enforce_eager=args.eager or not gpu,
            json_compact=False,
        )
    )
    out["engine_start_s"] = time.perf_counter() - t
    import vllm

    out["vllm"] = vllm.__version__
    timed = TimedEngine(engine)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    await engine.generate([11, 12, 13], max_tokens=16, seed=0)  # warm-up
    prompts = [rng.integers(10, vocab - 10, size=args.plen).tolist() for _ in range(args.n)]
    probe = rng.integers(10, vocab - 10, size=32).tolist()

    with tempfile.TemporaryDirectory(prefix="parley-weightbench-", dir=args.work) as tmp:
        work = Path(tmp)
        server = NatsServer(work / "nats", port=0)
        url = server.start()
        stop = asyncio.Event()
        try:
            nc = await connect(url, name="weight-bench")
            js = nc.jetstream()
            run = "bench-gpu"
            await topology.ensure_topology(js, run, topology.BusSettings(max_bytes=256 * 1024**2))
            follower_settings = file_settings("shared_dir", work)
            if set(PACKED) & set(args.gpu_transports):  # the actor keeps a packed copy: the model's bytes more
                follower_settings = packed_settings("shared_dir_packed", work)
            follower = WeightFollower(
                js, run, timed, dest_root=work / "actor", poll_s=1.0, base_dir=args.model, settings=follower_settings
            )
            following = asyncio.create_task(follower.run_until(stop))
            pub = IpcPublisher(hold_s=5.0, max_buffers=2)  # updates wait for a free buffer (gpu_update)
            version = 0

            params = [p for _, p in hf_tensors(model)]

            def change(v):  # version v's weights, every tensor by its own factor (a tensor left
                # stale or loaded into the wrong slice moves the probe's log-probs): the "training
                # step", done before the step's end, which is when its GPU work is finished; without
                # the sync its ~400 kernels ran inside the timed pack (and, in a round, inside the
                # update) until 2026-12-03 evening
                with torch.no_grad():
                    for i, t in enumerate(params):
                        t.mul_(1.0 + 0.02 * ((i + v) % 5 - 2))
                if gpu:
                    torch.cuda.synchronize()

            def sparse_change(v):  # what Adam at lr 1e-6 does to bf16 weights: 1.5% of the values move
                # by one step of their last bit (1.4-1.9% changed per version from real gradients at the
                # 4B shape on the H200, bench/gpu_delta.py); seeded by version
                g = torch.Generator(device=model.device).manual_seed(v)
                with torch.no_grad():
                    for t in params:
                        words = t.view(torch.int16)
                        words[torch.rand(words.shape, generator=g, device=t.device) < 0.015] += 1
                if gpu:
                    torch.cuda.synchronize()

            master = None
            if args.grads:  # real training: the fp32 master trained by AdamW, cast into the bf16 model
                # after each step as a bf16 DeepSpeed learner's parameters are (16 + 2 bytes a parameter)
                from bench.weight_delta import GradMaster

                t = time.perf_counter()
                master = GradMaster(Path(args.model))
                pairs = list(zip(params, [p for _, p in hf_tensors(master.model)]))
                print(
                    f"[weights] fp32 master with AdamW on {master.device}: {time.perf_counter() - t:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            lr_now = {"lr": args.grads[0] if args.grads else None}

            def grad_step(v):  # one AdamW step at lr_now on random-token loss; the bf16 model gets the result
                master.step(lr_now["lr"])
                with torch.no_grad():
                    torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()  # the step's freed gradients and casts (16-24 GB) back to the engine

            def mutate(transport, v):  # version v's weights, before its step's end
                if master is not None:
                    grad_step(v)
                else:
                    (sparse_change if transport in PACKED else change)(v)

            from parley.weights.gpu_delta import PackedVersions

            packer = PackedVersions()

            async def update(transport, change_now=True):
                nonlocal version
                version += 1
                if change_now:  # else: unchanged (the file check), or changed before (a round)
                    mutate(transport, version)
                r = await gpu_update(js, run, transport, version, model, pub, work, follower, timed, packer)
                r["lr"] = lr_now["lr"] if master is not None else None
                probed = (await engine.generate(probe, max_tokens=8, temperature=0.0)).logprobs
                first = probed[0]
                r["probe_logprob"], r["probe_logprobs"] = first, list(probed)
                out["updates"].append(r)
                print(
                    f"[weights] {transport:10s} v{version}: {r['bytes'] / 1e9:.2f} GB  pack/save {r['pack_or_save']:.3f}s  "
                    f"announce {r['announce']:.3f}s  until load {r['until_load']:.3f}s  load {r['load']:.3f}s  "
                    f"total {r['total']:.3f}s  probe logprob {first:.5f}"
                    + (f"  lr {r['lr']:g}" if r["lr"] else "")
                    + (f"  full copy stored {r['full_stored']:.1f}s" if r.get("full_stored") else "")
                    + (f"  learner's buffers busy {r['buffers_busy']:.2f}s" if "buffers_busy" in r else ""),
                    file=sys.stderr,
                    flush=True,
                )
                save()  # a run cut short keeps every update measured (defined below, before the first update)
                return r

            async def round_(label, transport=None):
                if transport:
                    mutate(transport, version + 1)
                t = time.perf_counter()
                gen = asyncio.ensure_future(
                    asyncio.gather(
                        *[
                            engine.generate(p, max_tokens=args.tokens, seed=i if gpu else None)
                            for i, p in enumerate(prompts)
                        ]
                    )
                )
                done: list[float] = []  # when the last request finished (a slow update may end later)
                gen.add_done_callback(lambda _: done.append(time.perf_counter()))
                upd = None
                if transport:  # the step's weights changed before the round: what is timed is the update
                    await asyncio.sleep(args.update_after)
                    upd = await update(transport, change_now=False)
                outs = await gen
                dt = done[0] - t
                toks = sum(len(o.token_ids) for o in outs)
                r = dict(
                    label=label,
                    transport=transport,
                    seconds=dt,
                    tokens=toks,
                    tok_s=toks / dt,
                    finished=sum(o.finish_reason == "length" for o in outs),
                    requests=len(outs),
                    update_total=upd["total"] if upd else None,
                )
                out["rounds"].append(r)
                print(
                    f"[weights] round {label}: {toks} tokens in {dt:.2f} s = {toks / dt:.0f} tok/s, "
                    f"{r['finished']}/{len(outs)} finished by length",
                    file=sys.stderr,
                    flush=True,
                )

            def save():  # after each phase: a run cut short by its time limit keeps what it measured
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=2))

            # the slow file transport (objstore: about a minute each way for 8 GB) goes last
            quick = [t for t in args.gpu_transports if t != "objstore"]
            for transport in quick:
                for lr in args.grads or [None]:  # with real gradients: file_repeats versions at each rate
                    lr_now["lr"] = lr
                    for _ in range(args.repeats if transport == "cuda_ipc" else args.file_repeats):
                        await update(transport)
            if gpu and pub.buffers:  # the checksum of one packed version alone, by each implementation
                from parley.weights.cuda_ipc import checksums

                out["checksum_s"] = {}
                for impl in ("torch", "triton"):
                    times = []
                    try:
                        for _ in range(4):
                            torch.cuda.synchronize()
                            t = time.perf_counter()
                            checksums(pub.buffers[0].data, pub.layout, impl=impl)  # ends with a sync (.cpu())
                            times.append(time.perf_counter() - t)
                    except Exception as e:  # noqa: BLE001 - no Triton here: said in the JSON
                        times = [f"{type(e).__name__}: {e}"]
                    out["checksum_s"][impl] = times
                print(
                    f"[weights] checksum of {pub.total / 1e9:.2f} GB: {out['checksum_s']}", file=sys.stderr, flush=True
                )
            if args.check_file:  # the same weights again, loaded from files: the served log-probs must not move
                gpu_probe = out["updates"][-1]
                r = await update(args.check_file, change_now=False)
                diffs = [abs(a - b) for a, b in zip(gpu_probe["probe_logprobs"], r["probe_logprobs"])]
                out["file_check"] = dict(
                    gpu_transport=gpu_probe["transport"],
                    gpu_version=gpu_probe["version"],
                    file_transport=args.check_file,
                    file_version=r["version"],
                    max_abs_diff=max(diffs),
                    equal=diffs == [0.0] * len(diffs),
                )
                print(
                    f"[weights] served log-probs after {gpu_probe['transport']} v{gpu_probe['version']} against the "
                    f"same weights from {args.check_file}: max |diff| {max(diffs):.3g}",
                    file=sys.stderr,
                    flush=True,
                )
            save()
            lr_now["lr"] = args.grads[0] if args.grads else None  # the rounds' update: a step at the first rate
            await round_("no update")
            for transport in args.round_transports:
                await round_(f"{transport} update after {args.update_after:.1f} s", transport)
            await round_("no update (after)")
            save()
            for transport in [t for t in args.gpu_transports if t == "objstore"]:
                for _ in range(args.file_repeats):
                    await update(transport)
            stop.set()
            await following
            await nc.close()
        finally:
            stop.set()
            engine.shutdown()
            server.stop()
    return out


def gpu_table(out: dict) -> str:
    lines = [
        "| transport | version | lr | GB | pack / save s | announce s | seen -> load (file: fetch + verify) s | "
        "load (pause..resume) s | step end -> serving s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["updates"]:
        lr = f"{r['lr']:g}" if r.get("lr") else "-"
        lines.append(
            f"| {r['transport']} | {r['version']} | {lr} | {r['bytes'] / 1e9:.2f} | {r['pack_or_save']:.3f} | "
            f"{r['announce']:.3f} | {r['until_load']:.3f} | {r['load']:.3f} | {r['total']:.3f} |"
        )
    lines += ["", "| round (64 requests in flight) | s | tokens | tokens/s | update s |", "|---|---|---|---|---|"]
    for r in out["rounds"]:
        upd = f"{r['update_total']:.3f}" if r["update_total"] is not None else "-"
        lines.append(f"| {r['label']} | {r['seconds']:.2f} | {r['tokens']} | {r['tok_s']:.0f} | {upd} |")
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--transport",
        default=None,
        choices=["cuda_ipc"],
        help="cuda_ipc: the GPU path into a running engine (needs --model), against the file transports",
    )
    p.add_argument("--model", default=None, help="GPU path: the checkpoint the learner and the engine start from")
    p.add_argument("--build", default=None, choices=["0.6b", "4b"], help="GPU path: build a random Qwen3 there first")
    p.add_argument(
        "--gpu-transports",
        nargs="+",
        default=["cuda_ipc", "shared_dir", "objstore"],
        help="GPU path: what to update through, in order (objstore_packed, shared_dir_packed: that "
        "file transport with "
        '[weights] delta_format = "packed", each version 1.5%% of the values one bf16 step on)',
    )
    p.add_argument(
        "--round-transports",
        nargs="*",
        default=["cuda_ipc", "shared_dir"],
        help="GPU path: transports updated in the middle of a round of in-flight requests",
    )
    p.add_argument(
        "--grads",
        nargs="+",
        type=float,
        default=None,
        metavar="LR",
        help="GPU path: each version from a real AdamW step of an fp32 master (bench.weight_delta."
        "GradMaster) at each of these learning rates in turn (--file-repeats versions each; "
        "a round's update at the first one), not a synthetic change",
    )
    p.add_argument("--file-repeats", type=int, default=1, help="GPU path: repeats of the file transports")
    p.add_argument(
        "--check-file",
        default=None,
        choices=["shared_dir", "objstore"],
        help="GPU path: after the GPU updates, load the same weights through this file transport "
        "and compare the served log-probs of a probe (equal when the GPU load is exact)",
    )
    p.add_argument("--n", type=int, default=64, help="GPU path: requests in flight")
    p.add_argument("--plen", type=int, default=128)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--update-after", type=float, default=1.0, help="GPU path: seconds into a round before the update")
    p.add_argument("--gpu-mem", type=float, default=0.4)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--models", nargs="+", default=["tiny", "smol"])
    p.add_argument("--transports", nargs="+", default=["objstore", "shared_dir"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="Directory for the temporary files (default: the system temp dir).")
    p.add_argument("--json", default=None, help="Also write the results as JSON here.")
    args = p.parse_args()
    if args.transport == "cuda_ipc":
        if not args.model:
            p.error("--transport cuda_ipc needs --model DIR (a checkpoint; --build 4b makes one there)")
        out = asyncio.run(gpu_main(args))
        print(
            f"machine: {out['gpu']}, torch {out['torch']}, vLLM {out['vllm']}; engine start {out['engine_start_s']:.0f} s"
        )
        print(gpu_table(out))
        if "file_check" in out:
            print(
                "served log-probs, GPU load against the same weights from files: {equal} "
                "(max |diff| {max_abs_diff:.3g})".format(**out["file_check"])
            )
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        sys.exit(0)
    results = asyncio.run(main(args))
    print(f"machine: {cpu_name()}, {__import__('os').cpu_count()} cores; python {platform.python_version()}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
