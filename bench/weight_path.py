"""Weight path benchmark: from the end of a learner step to an actor holding verified weights.

Times, per model and transport: save (state dict -> model.safetensors + config.json), publish
(upload with sha256, KV compare-and-set, until the actor's KV watcher wakes), fetch+verify (the
actor reads the blob into a file and checks sha256 and size), and the total from step end to
verified weights, against a raw copy of the same bytes on the same disk in the same run. A real nats-server is
started in a temporary directory. Writes a markdown table (and --json).

    .venv/bin/python bench/weight_path.py --models tiny smol --repeats 3
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


async def one_model(js, name: str, transport: str, repeats: int, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engines.models import ensure_model
    from learner.weights_io import hf_weights, write_weights
    from protocol import codec, topology
    from protocol.weights import fetch_version, publish_version

    run = f"bench-{name}-{transport}".replace("_", "-")
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
                    path = await fetch_version(js, run, wv, work / f"actor-{name}-{transport}" / f"v{version}",
                                               shared_dir=work / "shared")
                    seen.set_result((t_seen, time.perf_counter(), path, wv))
                    return

        task = asyncio.create_task(actor())
        await asyncio.sleep(0.05)  # the watcher is subscribed
        state_dir = work / f"learner-{name}" / f"v{version}"
        t0 = time.perf_counter()  # step end
        await asyncio.to_thread(lambda: write_weights(hf_weights(model), model.config, state_dir))
        t_saved = time.perf_counter()
        await publish_version(js, run, version, version, state_dir, transport, shared_dir=work / "shared", keep=2)
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
            dict(save=t_saved - t0, publish=t_seen - t_saved, publish_return=t_announced - t_saved,
                 fetch=t_verified - t_seen, total=t_verified - t0, raw_copy=raw, bytes=wv.bytes)
        )
        shutil.rmtree(state_dir.parent, ignore_errors=True)  # next repeat writes from scratch
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med.update(model=name, transport=transport, repeats=repeats)
    return med


async def main(args) -> list[dict]:
    from deploy.natsserver import NatsServer
    from protocol.connect import connect

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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "smol"])
    p.add_argument("--transports", nargs="+", default=["objstore", "shared_dir"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="Directory for the temporary files (default: the system temp dir).")
    p.add_argument("--json", default=None, help="Also write the results as JSON here.")
    args = p.parse_args()
    results = asyncio.run(main(args))
    print(f"machine: {cpu_name()}, {__import__('os').cpu_count()} cores; python {platform.python_version()}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
