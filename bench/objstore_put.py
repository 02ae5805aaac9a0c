"""Upload throughput into the NATS object store: nats.py's ObjectStore.put (waits for each chunk's
ack before it reads the next) against weights.objstore._put_object (up to PUT_WINDOW chunks awaiting
their acks, the next chunk read and hashed in a thread meanwhile), alternating in one run on one real
nats-server in a temporary directory, the same file of --mb random bytes, the same chunk size
(weights.objstore.chunk_size). Then reads the last upload back with _get_object (what an actor does).
Prints one line per upload and JSON (and writes it with --json). On a shared VM compare the two in
the same run.

    .venv/bin/python bench/objstore_put.py --mb 256 --repeats 3 --json bench/results/raw/objstore_put_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def main(args) -> dict:
    from nats.js import api

    from parley.deploy.natsserver import NatsServer
    from parley.protocol import topology
    from parley.protocol.connect import connect
    from parley.weights import objstore

    with tempfile.TemporaryDirectory(prefix="parley-putbench-", dir=args.work) as tmp:
        work = Path(tmp)
        server = NatsServer(work / "nats", port=0, extra_conf="max_payload: 8MB")
        server.start()
        try:
            nc = await connect(server.url, name="bench-put")
            js = nc.jetstream()
            run = "putbench"
            await topology.ensure_topology(
                js, run, topology.BusSettings(max_bytes=(args.mb << 20) * (2 * args.repeats + 1))
            )
            src = work / "blob"
            src.write_bytes(os.urandom(args.mb << 20))
            store = await js.object_store(topology.object_bucket(run))
            size = objstore.chunk_size(js)
            times: dict[str, list[float]] = {"nats.py ObjectStore.put": [], "parley.weights.objstore._put_object": []}
            for i in range(args.repeats):
                for how in times:
                    t = time.perf_counter()
                    if how.startswith("nats.py"):
                        with src.open("rb") as f:
                            await store.put(
                                f"a{i}",
                                f,
                                meta=api.ObjectMeta(name=f"a{i}", options=api.ObjectMetaOptions(max_chunk_size=size)),
                            )
                    else:
                        await objstore._put_object(js, run, f"b{i}", src)
                    dt = time.perf_counter() - t
                    times[how].append(dt)
                    print(
                        f"[put] {how:30s} {args.mb} MB in {dt:.2f} s = {args.mb / dt:.0f} MB/s",
                        file=sys.stderr,
                        flush=True,
                    )
            t = time.perf_counter()
            await objstore._get_object(js, run, f"b{args.repeats - 1}", work / "out")
            read_s = time.perf_counter() - t
            await nc.close()
        finally:
            server.stop()
    out = {
        "bench": "objstore_put",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mb": args.mb,
        "chunk_bytes": size,
        "put_window": objstore.PUT_WINDOW,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "seconds": times,
        "median_mb_s": {k: round(args.mb / statistics.median(v), 1) for k, v in times.items()},
        "read_back_s": read_s,
        "read_back_mb_s": round(args.mb / read_s, 1),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256, help="object size in MiB")
    p.add_argument("--repeats", type=int, default=3, help="uploads of each kind, alternating")
    p.add_argument("--work", default=None, help="directory for the server's store and the file")
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args()
    result = asyncio.run(main(a))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
