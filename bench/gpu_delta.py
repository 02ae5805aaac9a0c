"""Delta versions built on the learner's GPU and applied on the actor's (weights.gpu_delta), through
the object store of a real nats-server: bytes per version and step end -> the actor's GPU copy of
the weights holds the verified version, phase by phase, from real training.

The learner is bench.weight_delta.GradMaster (the checkpoint as an fp32 model trained by AdamW on
random-token loss, on the GPU when there is one). After each step (synchronized: "step end"):
  pack     its tensors cast to bf16 into a packed buffer (weights.cuda_ipc.plan's layout, what the
           cuda_ipc transport announces), one multi-tensor copy;
  checksum the buffer's per-tensor checksums (weights.cuda_ipc.checksums: fused on CUDA);
  encode   weights.gpu_delta.encode against the buffer of the version before (on the GPU) and the
           copy of its bytes to the host;
  put      weights.objstore._put_object of those bytes (what every objstore upload goes through);
  get      the actor's weights.objstore._get_object into a file (on /dev/shm when there is one);
  apply    read the file, weights.gpu_delta.apply to the actor's own buffer (on the GPU), checked
           against the announced checksums.
The result is compared with the learner's buffer bit for bit (not timed). `blocks4_bytes` is what
bench/weight_delta.py's block candidate (4 bytes a changed word) would have sent for the same pair.
vLLM's load from the rebuilt buffer is not in it: that is the cuda_ipc transport's load
(docs/gpu.md, 0.02-0.07 s at the 4B shape).

    .venv/bin/python bench/gpu_delta.py --model tiny --lrs 1e-4 --steps 2          # CPU smoke run
    python3 bench/gpu_delta.py --model /tmp/m4b --lrs 1e-6 1e-5 --steps 3 --json OUT  # the H200 (gpu_run.sh W4)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def run(args) -> dict:
    import torch

    from bench.weight_delta import GradMaster
    from parley.deploy.natsserver import NatsServer
    from parley.engines.models import ensure_model
    from parley.protocol import topology
    from parley.protocol.connect import connect
    from parley.weights import cuda_ipc, gpu_delta, objstore
    from parley.weights.snapshot import hf_tensors

    model_dir = Path(args.model) if Path(args.model).is_dir() else Path(ensure_model(args.model))
    m = GradMaster(model_dir)
    dev = torch.device(m.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    impl = cuda_ipc.prepare_checksums(dev)
    layout, size = cuda_ipc.plan((n, t.to(torch.bfloat16)) for n, t in hf_tensors(m.model))
    print(
        f"[gpu_delta] {model_dir.name}: {len(layout)} tensors, {size / 1e6:.1f} MB packed, on {dev} "
        f"(checksums: {impl})",
        file=sys.stderr,
        flush=True,
    )
    bufs = [torch.zeros(size, dtype=torch.uint8, device=dev) for _ in range(2)]

    def pack(buf):
        torch._foreach_copy_(cuda_ipc.views(buf, layout), [t for _, t in hf_tensors(m.model)])
        return cuda_ipc.with_checksums(layout, cuda_ipc.checksums(buf, layout))

    # where the actor's fetched delta goes, when it has room for one (a container's is often 64 MB)
    shm = Path("/dev/shm")
    shm_ok = shm.is_dir() and shutil.disk_usage(shm).free > size
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="parley-gpudelta-", dir=args.work) as tmp,
        tempfile.TemporaryDirectory(prefix="parley-gpudelta-", dir=shm if shm_ok else tmp) as fetched,
    ):
        server = NatsServer(Path(tmp) / "nats", port=0, extra_conf="max_payload: 8MB")
        server.start()
        try:
            nc = await connect(server.url, name="bench-gpu-delta")
            js = nc.jetstream()
            run_name = "gpudelta"
            # the streams' reservation (JetStream reserves it on disk); the object store has no limit
            await topology.ensure_topology(js, run_name, topology.BusSettings(max_bytes=256 << 20))
            store = await js.object_store(topology.object_bucket(run_name))
            for lr in args.lrs:
                prev_layout = pack(bufs[0])
                prev = 0
                actor = bufs[0].clone()  # the actor's copy, holding the version before
                for k in range(1, args.steps + 1):
                    m.step(lr)
                    sync()
                    t0 = time.perf_counter()
                    cur = 1 - prev
                    torch._foreach_copy_(cuda_ipc.views(bufs[cur], layout), [t for _, t in hf_tensors(m.model)])
                    sync()
                    t_pack = time.perf_counter()
                    cur_layout = cuda_ipc.with_checksums(layout, cuda_ipc.checksums(bufs[cur], layout))
                    t_sum = time.perf_counter()
                    blob = gpu_delta.encode(
                        bufs[prev],
                        bufs[cur],
                        cuda_ipc.table_digest(prev_layout),
                        cuda_ipc.table_digest(cur_layout),
                        max_share=args.max_share,
                    )
                    t_enc = time.perf_counter()
                    if blob is None:
                        print(
                            f"[gpu_delta] lr {lr:g} step {k}: delta over {args.max_share} of the model, a full version",
                            file=sys.stderr,
                            flush=True,
                        )
                        rows.append(dict(lr=lr, step=k, delta=False))
                        actor.copy_(bufs[cur])
                        prev, prev_layout = cur, cur_layout
                        continue
                    name = f"d-{lr:g}-{k}"
                    await objstore._put_object(js, run_name, name, blob)
                    t_put = time.perf_counter()
                    out = Path(fetched) / name
                    await objstore._get_object(js, run_name, name, out)
                    t_get = time.perf_counter()
                    got = out.read_bytes()
                    gpu_delta.apply(actor, got, cuda_ipc.table_digest(prev_layout), cur_layout)
                    sync()
                    t_apply = time.perf_counter()
                    assert torch.equal(actor, bufs[cur]), "the actor's rebuilt buffer differs from the learner's"
                    header, _ = gpu_delta.read_header(got)
                    out.unlink()
                    await store.delete(name)
                    del got
                    row = dict(
                        lr=lr,
                        step=k,
                        delta=True,
                        packed_bytes=size,
                        changed=header.changed,
                        changed_share=header.changed / header.words,
                        exceptions=header.exceptions,
                        delta_bytes=len(blob),
                        blocks4_bytes=4 * -(-header.words // (1 << 16)) + 4 * header.changed,
                        pack_s=t_pack - t0,
                        checksum_s=t_sum - t_pack,
                        encode_s=t_enc - t_sum,
                        put_s=t_put - t_enc,
                        get_s=t_get - t_put,
                        apply_s=t_apply - t_get,
                        total_s=t_apply - t0,
                    )
                    rows.append(row)
                    print(
                        f"[gpu_delta] lr {lr:g} step {k}: changed {row['changed_share']:.2%} "
                        f"({header.exceptions} exceptions); delta {len(blob) / 1e6:.1f} MB (blocks4 "
                        f"{row['blocks4_bytes'] / 1e6:.1f} MB) of {size / 1e6:.0f} MB; pack {row['pack_s']:.3f} "
                        f"checksum {row['checksum_s']:.3f} encode {row['encode_s']:.3f} put {row['put_s']:.3f} "
                        f"get {row['get_s']:.3f} apply {row['apply_s']:.3f}: step end -> verified "
                        f"{row['total_s']:.3f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    del blob
                    prev, prev_layout = cur, cur_layout
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
            await nc.close()
        finally:
            server.stop()
    summary = {}
    for lr in args.lrs:
        mine = [r for r in rows if r["lr"] == lr and r["delta"]]
        if mine:
            summary[f"{lr:g}"] = {
                k: statistics.median(r[k] for r in mine)
                for k in ("delta_bytes", "changed_share", "encode_s", "put_s", "get_s", "apply_s", "total_s")
            }
    out = {
        "bench": "gpu_delta",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": str(model_dir),
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "checksums": impl,
        "fetched_to": "/dev/shm" if shm_ok else "work",
        "rows": rows,
        "medians": summary,
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="tiny", help="'tiny', 'smol' (engines.models.ensure_model) or a checkpoint directory"
    )
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 1e-5], help="AdamW learning rates, one run each")
    p.add_argument("--steps", type=int, default=3, help="versions per learning rate after its first")
    p.add_argument(
        "--max-share",
        type=float,
        default=0.5,
        help="no delta above this share of the packed bytes ([weights] delta_max_share)",
    )
    p.add_argument("--work", default=None, help="directory for the server's store (default: the system temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    out = asyncio.run(run(args))
    print(json.dumps(out["medians"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
