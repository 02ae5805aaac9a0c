"""LoRA adapter versions (issue 29): adapter step end -> serving, i.e. from the end of an optimizer
step with [learner.lora] to an actor's vLLM engine serving the new adapter (snapshot, write, upload
through the object store of a real nats-server, announce, fetch + verify, vLLM add_lora, one generated
token on it). Prints JSON. Goal: <= 1 s on CPU (SmolLM2), <= 0.05 s on an H200 (4B shape).
With --transport cuda_ipc (a GPU) the adapter stays in GPU memory instead: packed into the learner's
shared buffer, announced with its peft config, checked and copied out by the engine's worker and added
to vLLM from memory; the last version is then also loaded from its files and once more from memory,
and the log-probs of the same sampled tokens are compared (`check`: files vs memory, read against
memory vs memory again).

  python bench/lora.py --model tiny --out bench/results/raw/lora_cpu_tiny.json   # the toy model, CPU
  python bench/lora.py --model /path/to/SmolLM2 --device cpu
  python bench/lora.py --model qwen3-4b --device cuda    # bench.common.random_qwen3("4b")
  python bench/lora.py --model /tmp/m4b --device cuda --transport cuda_ipc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _model(name: str, work: Path) -> Path:
    if name == "tiny":
        from parley.engines.models import build_tiny

        return build_tiny(work / "tiny")
    if name.startswith("qwen3-"):
        from bench.common import random_qwen3

        return random_qwen3(name.split("-", 1)[1], work / name)
    return Path(name)


async def main(args) -> dict:
    import torch

    from parley.config.learner import LearnerConfig, LoraSettings
    from parley.deploy.natsserver import NatsServer
    from parley.engines.engine import EngineSettings, PolicyEngine
    from parley.learner.packing import Sample
    from parley.learner.trainer import Trainer
    from parley.protocol import topology
    from parley.protocol.connect import connect
    from parley.weights import lora
    from parley.weights.config import CudaIpcWeights, ObjstoreWeights
    from parley.weights.follow import WeightFollower

    os.environ.setdefault("LOCAL_RANK", "0")
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model = _model(args.model, work)
    server = NatsServer(work / "nats", port=0)
    server.start()
    nc = await connect(server.url, name="bench-lora")
    js = nc.jetstream()
    run = "benchlora"
    await topology.ensure_topology(js, run)
    gpu = args.transport == "cuda_ipc"
    if gpu and args.device != "cuda":
        raise SystemExit("--transport cuda_ipc needs --device cuda (the adapter stays in GPU memory)")
    trainer = Trainer(
        LearnerConfig(
            zero_stage=2,
            lr=1e-3,
            kl_coef=0.0,
            micro_batch_tokens=4096,
            lora=LoraSettings(enabled=True, rank=args.rank, alpha=2.0 * args.rank),
        ),
        model,
        weights=CudaIpcWeights() if gpu else None,
    )
    settings = EngineSettings(
        model=str(model),
        max_model_len=1024,
        sampled_logprobs=True,
        max_lora_rank=args.rank,
        max_loras=2,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        kv_cache_bytes=256 << 20,
    )
    engine = PolicyEngine(settings)
    follower = WeightFollower(js, run, engine, dest_root=work / "actor", base_dir=model)
    base = lora.base_identity(model)
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for version in range(1, args.versions + 1):
            ids = torch.randint(10, 1000, (256,), generator=gen).tolist()
            trainer.train_step(
                [Sample(f"s{i}", ids, [0] * 128 + [1] * 128, [-5.0] * 256, (-1.0) ** i) for i in range(4)]
            )
            if gpu:
                await asyncio.sleep(trainer.weights_writable_in())  # a buffer past its hold (none skipped)
                torch.cuda.synchronize()
            t0 = time.perf_counter()  # the step's end
            if gpu:  # weights.publish.Weights._submit_gpu's path: pack, then announce
                source, conf = trainer.pack_adapter(version)
                t_packed = time.perf_counter()
                wv = await lora.publish_adapter_gpu(
                    js, run, version, version, source, base=base, rank=args.rank, adapter_config=conf
                )
            else:
                state, conf = trainer.adapter_snapshot()
                wdir = lora.write_adapter(state, conf, work / "learner" / f"v{version}")
                wv = await lora.publish_adapter(
                    js, run, version, version, wdir, ObjstoreWeights(), base=base, rank=args.rank
                )
            t_pub = time.perf_counter()
            assert await follower.check(), follower.refused
            t_loaded = time.perf_counter()
            await engine.generate(ids[:16], max_tokens=1)  # the first token served on the new adapter
            t_served = time.perf_counter()
            # added: vLLM holds the adapter in a LoRA slot, what "serving" means for whole weights
            # (bench/weight_path.py); serving: its first generated token
            rows.append(
                {
                    "version": version,
                    "adapter_bytes": wv.bytes,
                    "publish_s": round(t_pub - t0, 4),
                    # of publish_s under cuda_ipc: packing (fill and export), then announcing
                    **({"pack_s": round(t_packed - t0, 4), "announce_s": round(t_pub - t_packed, 4)} if gpu else {}),
                    "load_s": round(t_loaded - t_pub, 4),
                    "step_end_to_added_s": round(t_loaded - t0, 4),
                    "step_end_to_serving_s": round(t_served - t0, 4),
                    # of publish_s under cuda_ipc: the multi-tensor copy, the checksum (IpcPublisher.fill_s)
                    **({f"fill_{k}_s": round(v, 4) for k, v in trainer.sender.fill_s.items()} if gpu else {}),
                    # fills so far that copied the adapter's span at once (weights.cuda_ipc.one_run)
                    **({"fills_one_copy": trainer.sender.fills_one_copy} if gpu else {}),
                }
            )
            print(f"[lora] {rows[-1]}", file=sys.stderr, flush=True)  # a run cut short keeps its lines
        check = None
        if gpu:
            # the last version once more from its files, then from memory again (a fresh adapter id,
            # another slot): the same tokens must get the same log-probs; memory vs memory again is
            # the engine's own spread between two loads of one adapter, what files vs memory is read against
            prompt = ids[:16]
            memory = await engine.generate(prompt, max_tokens=32, seed=1)
            state, conf = trainer.adapter_snapshot()
            wdir = lora.write_adapter(state, conf, work / "learner" / "files")
            await engine.load_adapter(lora.as_vllm_adapter(wdir), args.versions + 1)
            files = await engine.generate(prompt, max_tokens=32, seed=1)
            await engine.load_adapter_tensors(state, conf, args.versions + 2)
            again = await engine.generate(prompt, max_tokens=32, seed=1)

            def diff(a, b):
                return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) if a.token_ids == b.token_ids else None

            check = {
                "tokens": len(files.token_ids),
                "files_vs_memory_max_abs_logprob_diff": diff(files, memory),
                "memory_again_vs_memory_max_abs_logprob_diff": diff(again, memory),
                "memory_again_vs_files_max_abs_logprob_diff": diff(again, files),
            }
    finally:
        engine.shutdown()
        trainer.close()
        await nc.close()
        server.stop()
    steady = [r["step_end_to_serving_s"] for r in rows[1:]] or [rows[0]["step_end_to_serving_s"]]
    return {
        "bench": "lora_step_end_to_serving",
        "model": args.model,
        "device": args.device,
        "rank": args.rank,
        "transport": args.transport,
        "date": time.strftime("%Y-%m-%d"),
        "versions": rows,
        "check": check,
        "median_step_end_to_serving_s": sorted(steady)[len(steady) // 2],
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | qwen3-4b (random weights, bench.common) | a model directory")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--transport",
        choices=("objstore", "cuda_ipc"),
        default="objstore",
        help="how each adapter version travels (cuda_ipc: in GPU memory, needs --device cuda)",
    )
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--out", type=Path, help="also write the JSON here (vLLM logs to stdout as well)")
    args = p.parse_args()
    result = json.dumps(asyncio.run(main(args)), indent=1)
    print(result)
    if args.out:
        args.out.write_text(result + "\n")
