"""Which of our modules a weight version number passes through, from the learner's publish call to
the actor's load (issue 58: the figures before and after the weight path got one home). Publishes
versions 6 and 7 through the learner's side (objstore, full_every 2: version 7 also goes as a delta)
on a real nats-server, then follows them with a real follower over an engine double, and records
every call of a function of ours that takes the version (the int 7, or a WeightVersion of it) as an
argument. Prints the modules in order, how many, in how many packages, and how often the path
returns to a module it had left. Reads both layouts (learner.publication / actors.follow before).

    PYTHONPATH=$PWD .venv/bin/python bench/weight_version_trace.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

V = 7


def traced(calls: list) -> callable:
    seen = set()  # frames entered already: a coroutine's resumption is no new call

    def prof(frame, event, arg):
        if event != "call" or frame in seen:
            return
        seen.add(frame)
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith("parley."):
            return
        code = frame.f_code
        for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            val = frame.f_locals.get(name)
            if (type(val) is int and val == V) or (type(val).__name__ == "WeightVersion" and val.version == V):
                calls.append((mod, code.co_name))
                return

    return prof


async def run(work: Path) -> list[tuple[str, str]]:
    import torch

    from parley.deploy.natsserver import NatsServer
    from parley.protocol import topology
    from parley.protocol.connect import connect
    from parley.weights.config import ObjstoreWeights

    server = NatsServer(work / "nats", port=0)
    server.start()
    nc = await connect(server.url, name="trace")
    js = nc.jetstream()
    await topology.ensure_topology(js, "trace")
    settings = ObjstoreWeights(full_every=2)
    state = {"w": torch.zeros(64, 64)}

    def snapshot():
        state["w"] = state["w"] + 1.0
        try:
            from parley.weights.snapshot import WeightSnapshot
        except ImportError:
            from parley.learner.weights_io import WeightSnapshot
        return WeightSnapshot({"w": state["w"].clone()}, '{"model_type": "llama"}')

    feeder = SimpleNamespace(set_version=lambda v: None)
    lc = SimpleNamespace(keep_versions=3)
    try:
        from parley.learner.service import weights_publication
        from parley.weights.follow import WeightFollower
        from parley.weights.publish import Publisher

        source = SimpleNamespace(weights_snapshot=snapshot)
        weights = weights_publication(lc, settings, js, nc, "trace", work / "run", source, Publisher(), feeder)
    except ImportError:  # before issue 58
        from parley.actors.follow import WeightFollower
        from parley.learner.publication import Publisher, Weights

        weights = Weights(lc, settings, js, nc, "trace", work / "run", lambda op: snapshot(), Publisher(), feeder)

    class Engine:  # test double: records the loads
        version, settings = 0, None

        async def reload_weights(self, path, version):
            self.version = version

    follower = WeightFollower(js, "trace", Engine(), dest_root=work / "actor", settings=settings, poll_s=0.1)
    calls: list = []
    await weights.publish(6)
    await weights.publisher.drain()
    await follower.check()
    prof = traced(calls)
    sys.setprofile(prof)
    threading.setprofile(prof)
    try:
        await weights.publish(V)
        await weights.publisher.drain()
        await follower.check()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert follower.version == V, follower.version
    await nc.close()
    server.stop()
    return calls


def figures(calls: list[tuple[str, str]]) -> dict:
    path = [m for i, (m, _) in enumerate(calls) if i == 0 or calls[i - 1][0] != m]  # one entry per stay
    returns = sum(1 for i, m in enumerate(path) if m in path[:i])
    modules = sorted(set(path))
    packages = [m.split(".")[1] for m in path]
    packages = [p for i, p in enumerate(packages) if i == 0 or packages[i - 1] != p]
    return {
        "package_stays": packages,
        "stays": len(path),
        "modules": len(modules),
        "packages": sorted({m.split(".")[1] for m in modules}),
        "returns_to_a_module_left": returns,
        "path": path,
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        calls = asyncio.run(run(Path(d)))
    out = figures(calls)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
