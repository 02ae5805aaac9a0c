"""Fan-out of one weight version from the NATS object store to many readers at once (issue 27, item 4):
a real nats-server in a temporary directory holds one object of --full-mb (a full version) and one
of --delta-mb (a delta), and 1, 4, 16 reader processes, each with its own connection, read it at the
same moment the way an actor does (weights.objstore._get_object: direct gets, hashed, checked
against the store's digest), into /dev/null. Per case: wall time, aggregate and per-reader MB/s,
and the server's CPU seconds (from /proc) per GB sent. Prints JSON (and writes it with --json).

Readers are processes because actors are: one Python client tops out at one core. On a small VM the
readers and the server share the cores, so the ratios between cases (one run) are the figure.

    .venv/bin/python bench/objstore_fanout.py --readers 1 4 16 --json bench/results/raw/objstore_fanout_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUN = "fanout"


def _reader(url: str, name: str, ready: mp.Queue, go_event, out: mp.Queue) -> None:
    async def go():
        from parley.protocol import topology
        from parley.protocol.connect import connect
        from parley.weights.objstore import _get_object

        nc = await connect(url, name="fanout-reader")
        js = nc.jetstream()
        await js.object_store(topology.object_bucket(RUN))
        ready.put(1)
        while not go_event.is_set():  # all readers start together, once every one has connected
            await asyncio.sleep(0.001)
        t0, w0 = time.perf_counter(), time.time()
        _, size = await _get_object(js, RUN, name, Path(os.devnull))
        dt = time.perf_counter() - t0
        await nc.close()
        return w0, dt, size

    w0, dt, size = asyncio.run(go())
    out.put((w0, w0 + dt, dt, size))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _put(url: str, objects: dict[str, int], work: Path) -> None:
    from nats.js import api

    from parley.protocol import topology
    from parley.protocol.connect import connect
    from parley.weights.objstore import chunk_size

    nc = await connect(url, name="fanout-writer")
    js = nc.jetstream()
    await topology.ensure_topology(js, RUN, topology.BusSettings(max_bytes=4 * 1024**3))
    store = await js.object_store(topology.object_bucket(RUN))
    for name, nbytes in objects.items():
        path = work / name
        with path.open("wb") as f:  # incompressible, like bf16 weights
            for _ in range(nbytes // (1 << 20)):
                f.write(os.urandom(1 << 20))
            f.write(os.urandom(nbytes % (1 << 20)))
        with path.open("rb") as f:
            await store.put(
                name, f, meta=api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=chunk_size(js)))
            )
        path.unlink()
    await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full-mb", type=float, default=256.0, help="size of the full-version object, MB (1e6 bytes)")
    p.add_argument(
        "--delta-mb",
        type=float,
        default=1.5,
        help="size of the delta object, MB (SmolLM2 at lr 1e-6: 1.2-1.7 MB, bench/weight_delta.py)",
    )
    p.add_argument("--readers", nargs="+", type=int, default=[1, 4, 16], help="concurrent reader processes per case")
    p.add_argument("--repeat", type=int, default=1, help="runs of each case (the median wall is kept)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    from parley.deploy.natsserver import NatsServer

    objects = {"full": int(args.full_mb * 1e6), "delta": int(args.delta_mb * 1e6)}
    others = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    result = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        cpus=os.cpu_count(),
        loadavg_start=os.getloadavg(),
        top_processes_start=others.splitlines()[:8],
        cases=[],
    )
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="parley-fanout-") as tmp:
        work = Path(tmp)
        server = NatsServer(work / "nats", port=0)
        url = server.start()
        try:
            asyncio.run(_put(url, objects, work))
            for name, nbytes in objects.items():
                for n in args.readers:
                    runs = []
                    for _ in range(args.repeat):
                        q, ready, go_event = ctx.Queue(), ctx.Queue(), ctx.Event()
                        procs = [ctx.Process(target=_reader, args=(url, name, ready, go_event, q)) for _ in range(n)]
                        for pr in procs:
                            pr.start()
                        for _ in range(n):
                            ready.get(timeout=300)
                        cpu0 = _cpu_s(server.proc.pid)
                        go_event.set()
                        got = [q.get(timeout=600) for _ in range(n)]
                        cpu1 = _cpu_s(server.proc.pid)
                        for pr in procs:
                            pr.join()
                        wall = max(e for _, e, _, _ in got) - min(s for s, _, _, _ in got)
                        assert all(size == nbytes for *_, size in got), got
                        per = sorted(nbytes / dt / 1e6 for _, _, dt, _ in got)
                        runs.append(
                            dict(
                                readers=n,
                                wall_s=wall,
                                aggregate_mb_s=n * nbytes / wall / 1e6,
                                per_reader_mb_s_min=per[0],
                                per_reader_mb_s_median=per[len(per) // 2],
                                per_reader_mb_s_max=per[-1],
                                server_cpu_s=cpu1 - cpu0,
                                server_cpu_s_per_gb=(cpu1 - cpu0) / (n * nbytes / 1e9),
                            )
                        )
                    runs.sort(key=lambda r: r["wall_s"])
                    case = dict(object=name, bytes=nbytes, **runs[len(runs) // 2])
                    result["cases"].append(case)
                    print(
                        f"{name} {nbytes / 1e6:.1f} MB x {n:2d} readers: wall {case['wall_s']:.2f}s, aggregate "
                        f"{case['aggregate_mb_s']:.0f} MB/s, per reader {case['per_reader_mb_s_median']:.0f} MB/s "
                        f"(min {case['per_reader_mb_s_min']:.0f}), server CPU {case['server_cpu_s']:.2f}s "
                        f"({case['server_cpu_s_per_gb']:.2f} s/GB)",
                        file=sys.stderr,
                    )
        finally:
            server.stop()
    result["loadavg_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
