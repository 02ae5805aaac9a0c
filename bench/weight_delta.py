"""Delta versions of the file transports (weights.delta): bytes per version, full against delta, and
the time to build and apply one, then step end -> fetched and verified over the object store.

The learner is played by an fp32 master of the model's weights taking Adam-like steps (Adam moves
each weight by about lr: master += lr * sign(noise)), saved as bf16 after each step as the learner
saves them, so most bf16 values do not change from one version to the next.

1. Format: for each lr and step, the delta parley sends (per tensor: changed positions as uint32
   gaps + values, zlib 1) against the alternatives: raw positions + values, the XOR of the raw
   bytes with zlib 1, and blocks of 2^16 words built with torch on --device (what a GPU learner
   could build without leaving the GPU: `blocks`); sizes, build and apply times (parley's apply
   includes copying the base and hashing).
2. Path: a real nats-server in a temporary directory; per version, step end -> write the file ->
   publish_version (full only; full then delta, one announcement; or the delta announced early and
   the full copy after) -> from the first announcement, the actor's fetch_version (full, or the delta
   applied to the version it holds, checked against the full sha256). `total` is step end -> the
   actor holds the verified version, `full_stored` step end -> the full copy stored and announced on
   WEIGHTS_KEY. Medians over the steps.

    .venv/bin/python bench/weight_delta.py --model smol --lrs 1e-6 1e-5 --steps 4 --json bench/results/raw/weight_delta_cpu.json
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
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Master:
    """fp32 master weights under their checkpoint names, saved as bf16 safetensors."""

    def __init__(self, model_dir: Path, seed: int = 0):
        import torch
        from safetensors.torch import load_file

        self.torch = torch
        self.master = {n: t.float() for n, t in load_file(str(model_dir / "model.safetensors")).items()}
        self.g = torch.Generator().manual_seed(seed)
        self.config = (model_dir / "config.json").read_text()

    def step(self, lr: float) -> None:
        for t in self.master.values():
            t += lr * self.torch.sign(self.torch.randn(t.shape, generator=self.g))

    def write(self, d: Path) -> Path:
        from safetensors.torch import save_file

        d.mkdir(parents=True, exist_ok=True)
        save_file(
            {n: t.to(self.torch.bfloat16) for n, t in self.master.items()},
            str(d / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (d / "config.json").write_text(self.config)
        return d


class GradMaster:
    """Real gradients: the checkpoint as an fp32 model (a GPU when there is one) trained by AdamW on
    random-token next-token loss, saved as bf16 under its checkpoint names after each step, as the
    learner saves them. The fp32 master with Adam is 16 bytes a parameter (64 GB at the 4B shape)."""

    def __init__(self, model_dir: Path, seed: int = 0, batch: int = 4, seq: int = 256):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(self.device)
        self.model.train()
        self.g = torch.Generator(device=self.device).manual_seed(seed)
        self.batch, self.seq, self.opt, self.lr = batch, seq, None, None

    def step(self, lr: float) -> None:
        torch = self.torch
        if self.opt is None:
            # fused on CUDA: the multi-tensor (foreach) AdamW allocates temporaries the size of the
            # master (16 GB at the 4B shape), out of memory beside an engine (bench/weight_path.py --grads)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0, fused=self.device == "cuda")
        elif self.lr != lr:  # the optimizer's moments carry on, as a learner's would when its rate changes
            for group in self.opt.param_groups:  # (a fresh AdamW's first step moves nearly every weight by lr)
                group["lr"] = lr
        self.lr = lr
        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab, (self.batch, self.seq), generator=self.g, device=self.device)  # (B, T)
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def write(self, d: Path) -> Path:
        from parley.weights.snapshot import hf_tensors, write_weights

        state = {n: t.detach().to("cpu", self.torch.bfloat16).contiguous() for n, t in hf_tensors(self.model)}
        return write_weights(state, self.model.config, d)


_GRAD_MASTERS: dict[Path, GradMaster] = {}


def learner(model_dir: Path, grads: bool):
    """A fresh Master, or the one GradMaster of this checkpoint (loading a 4B one takes tens of
    seconds; each case starts from a full version anyway, so training on is as good)."""
    if not grads:
        return Master(model_dir)
    if model_dir not in _GRAD_MASTERS:
        _GRAD_MASTERS[model_dir] = GradMaster(model_dir)
    return _GRAD_MASTERS[model_dir]


def alternatives(a_path: Path, b_path: Path) -> dict:
    """Sizes and build times of the other candidate formats, over the same two files."""
    import numpy as np

    from parley.weights.delta import _UINT, _layout

    _, _, tensors = _layout(b_path)
    a = np.memmap(a_path, dtype=np.uint8, mode="r")
    b = np.memmap(b_path, dtype=np.uint8, mode="r")
    t0 = time.perf_counter()
    raw = changed = 0
    for start, size, count in tensors:
        x, y = (m[start : start + size * count].view(_UINT[size]) for m in (a, b))
        idx = np.flatnonzero(x != y)
        raw += idx.size * 4 + idx.size * size
        changed += idx.size
    t_raw = time.perf_counter() - t0
    t0 = time.perf_counter()
    xor = sum(
        len(zlib.compress(np.bitwise_xor(a[s : s + z * c], b[s : s + z * c]).tobytes(), 1)) for s, z, c in tensors
    )
    t_xor = time.perf_counter() - t0
    elements = sum(c for _, _, c in tensors)
    return dict(
        changed=changed,
        elements=elements,
        raw_idx_val_bytes=raw,
        raw_idx_val_s=t_raw,
        xor_zlib1_bytes=xor,
        xor_zlib1_s=t_xor,
    )


def blocks(a_path: Path, b_path: Path, device: str = "cpu") -> dict:
    """A candidate built with torch on `device` (the learner's GPU, where a GPU learner's bf16 tensors
    already are): the changed 16-bit words of the two files' tensor bytes, as a count per block of
    2^16 words (int32) + each changed word's offset in its block (16 bits) + its new bits (16 bits):
    4 bytes a changed word, no compressor, so the learner could build it on the GPU and the actor
    apply it to a GPU copy of the weights it serves with one scatter. Builds it, applies it to a copy
    of the base and checks the result bit for bit (the check is not timed)."""
    import numpy as np
    import torch

    from parley.weights.delta import _layout

    _, _, tensors = _layout(b_path)
    lo = min(st for st, _, _ in tensors)
    hi = max(st + sz * c for st, sz, c in tensors)
    hi -= (hi - lo) % 2  # whole 16-bit words (bf16: all of it)

    def words(path):
        raw = np.fromfile(path, dtype=np.uint8, count=hi - lo, offset=lo)
        return torch.from_numpy(raw.view(np.int16).copy()).to(device)

    x, y = words(a_path), words(b_path)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    pos = torch.nonzero(x != y).flatten()
    n_blocks = -(-x.numel() // (1 << 16))
    counts = torch.bincount(pos >> 16, minlength=n_blocks).to(torch.int32)
    offsets = (pos & 0xFFFF).to(torch.int32).to(torch.int16)  # the low 16 bits (the cast wraps)
    values = y[pos]
    sync()
    t_build = time.perf_counter() - t0
    base = x.clone()
    sync()
    t0 = time.perf_counter()
    starts = torch.repeat_interleave(torch.arange(n_blocks, device=device, dtype=torch.int64) << 16, counts.long())
    base[starts + (offsets.to(torch.int64) & 0xFFFF)] = values
    sync()
    t_apply = time.perf_counter() - t0
    assert torch.equal(base, y), "the block delta did not rebuild the target"
    size = 4 * n_blocks + 4 * pos.numel()
    return dict(blocks_bytes=size, blocks_build_s=t_build, blocks_apply_s=t_apply, blocks_device=device)


def formats(
    model_dir: Path, lrs: list[float], steps: int, work: Path, grads: bool = False, device: str = "cpu"
) -> list[dict]:
    from parley.weights import delta as deltas
    from parley.weights.common import file_digest

    rows = []
    for lr in lrs:
        m = learner(model_dir, grads)
        prev = m.write(work / "fmt" / "v0")
        for k in range(1, steps + 1):
            m.step(lr)
            cur = m.write(work / "fmt" / f"v{k}")
            a, b = prev / "model.safetensors", cur / "model.safetensors"
            sa, sb = file_digest(a)[0], file_digest(b)[0]
            t0 = time.perf_counter()
            size = deltas.build(a, b, work / "fmt" / "d", sa, sb)
            t_build = time.perf_counter() - t0
            t0 = time.perf_counter()
            deltas.apply(a, work / "fmt" / "d", work / "fmt" / "out", sa, sb, b.stat().st_size)
            t_apply = time.perf_counter() - t0
            assert file_digest(work / "fmt" / "out")[0] == sb
            row = dict(
                lr=lr,
                step=k,
                full_bytes=b.stat().st_size,
                delta_bytes=size,
                build_s=t_build,
                apply_s=t_apply,
                **alternatives(a, b),
                **blocks(a, b, device),
            )
            rows.append(row)
            print(
                f"lr {lr:g} step {k}: changed {row['changed'] / row['elements']:.2%}; full {row['full_bytes'] / 1e6:.1f} MB; "
                f"delta {size / 1e6:.2f} MB (build {t_build:.2f}s, apply+verify {t_apply:.2f}s); "
                f"raw idx+val {row['raw_idx_val_bytes'] / 1e6:.2f} MB; xor+zlib1 {row['xor_zlib1_bytes'] / 1e6:.2f} MB "
                f"({row['xor_zlib1_s']:.2f}s); blocks {row['blocks_bytes'] / 1e6:.2f} MB (on {device}: build "
                f"{row['blocks_build_s']:.3f}s, apply {row['blocks_apply_s']:.3f}s)",
                file=sys.stderr,
            )
            shutil.rmtree(prev)
            prev = cur
        shutil.rmtree(work / "fmt")
    return rows


async def path(
    model_dir: Path,
    lrs: list[float],
    steps: int,
    work: Path,
    grads: bool = False,
    kinds: tuple[str, ...] = ("objstore",),
    modes: tuple[str, ...] = ("full", "delta_after_full", "delta"),
    save=lambda out: None,
) -> list[dict]:
    from parley.deploy.natsserver import NatsServer
    from parley.protocol import topology
    from parley.protocol.connect import connect
    from parley.weights import registry
    from parley.weights.config import ObjstoreWeights, SharedDirWeights
    from parley.weights.registry import fetch_version, publish_version

    server = NatsServer(work / "nats", port=0)
    url = server.start()
    out = []
    try:
        nc = await connect(url, name="weight-delta-bench")
        js = nc.jetstream()
        objstore = registry.get("objstore")
        cases = [
            (kind, lr, mode)
            for kind in kinds
            for lr in lrs
            for mode in modes
            if kind == "objstore" or mode != "delta_after_full"
        ]
        # full: every version full only; delta_after_full: the delta uploaded after the full copy, one
        # announcement (objstore's order before delta_first); delta: the transport's own order (objstore:
        # the delta announced early, the full copy after; shared_dir: the full copy, then the delta)
        for kind, lr, mode in cases:
            objstore.delta_first = mode != "delta_after_full"  # this process only
            run = f"delta-{kind}-{mode}-{lr:g}".replace(".", "-").replace("_", "-")
            await topology.ensure_topology(js, run, topology.BusSettings(max_bytes=2 * 1024**3))
            full_every = 1 if mode == "full" else steps + 1
            settings = (
                ObjstoreWeights(full_every=full_every)
                if kind == "objstore"
                else SharedDirWeights(dir=str(work / "shared"), full_every=full_every)
            )
            m = learner(model_dir, grads)
            learner_prev = actor_prev = None
            rows = []
            for v in range(steps + 1):  # version 0: the full version both start from (not timed)
                m.step(lr)
                t0 = time.perf_counter()  # step end
                wdir = await asyncio.to_thread(m.write, work / run / "learner" / f"v{v}")
                t_write = time.perf_counter()
                base = learner_prev if mode != "full" and learner_prev else None
                first = asyncio.get_running_loop().create_future()
                publishing = asyncio.create_task(
                    publish_version(
                        js,
                        run,
                        v,
                        v,
                        wdir,
                        settings,
                        keep=2,
                        base=base,
                        on_announced=lambda w: first.done() or first.set_result((w, time.perf_counter())),
                    )
                )
                announced, t_pub = await first  # the actor starts at the first announcement
                got = await fetch_version(
                    js, run, announced, work / run / "actor" / f"v{v}", settings=settings, base=actor_prev
                )
                t_got = time.perf_counter()
                wv = await publishing
                t_stored = time.perf_counter()
                if learner_prev:
                    shutil.rmtree(learner_prev[1])
                if actor_prev:
                    shutil.rmtree(actor_prev[1])
                learner_prev, actor_prev = (wv, wdir), (wv.sha256, got)
                if v:
                    rows.append(
                        dict(
                            write=t_write - t0,
                            publish=t_pub - t_write,
                            fetch_verify=t_got - t_pub,
                            total=t_got - t0,
                            full_stored=t_stored - t0,
                            fetched_bytes=wv.delta.bytes if wv.delta else wv.bytes,
                            delta=wv.delta is not None,
                            early=announced.full_pending,
                        )
                    )
            early = mode == "delta" and kind == "objstore"
            assert all(r["delta"] == (mode != "full") and r["early"] == early for r in rows), rows
            med = {
                k: statistics.median(r[k] for r in rows)
                for k in ("write", "publish", "fetch_verify", "total", "full_stored", "fetched_bytes")
            }
            med.update(kind=kind, lr=lr, mode=mode, versions=len(rows), full_bytes=wv.bytes)
            out.append(med)
            save(out)  # after each case: a run cut short by its time limit keeps what it measured
            print(
                f"{kind} lr {lr:g} {mode:16s}: fetched {med['fetched_bytes'] / 1e6:.2f} MB; write {med['write']:.2f}s "
                f"publish {med['publish']:.2f}s fetch+verify {med['fetch_verify']:.2f}s; step end -> verified "
                f"{med['total']:.2f}s (full copy stored {med['full_stored']:.2f}s)",
                file=sys.stderr,
            )
            shutil.rmtree(work / run, ignore_errors=True)
            # the shared directory keeps `keep` versions of every case: 16 GB at the 4B shape, which
            # filled the H200 machine's 64 GB disk at the next case (2026-12-03)
            shutil.rmtree(work / "shared", ignore_errors=True)
            for name in await js.streams_info():  # each run's streams reserve max_bytes of the server's storage
                await js.delete_stream(name.config.name)
        objstore.delta_first = True
        await nc.close()
    finally:
        server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="smol", help="'tiny', 'smol' (engines.models.ensure_model) or a checkpoint directory"
    )
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 1e-5], help="Adam-like step sizes, one run each")
    p.add_argument("--steps", type=int, default=4, help="versions per learning rate (after the first full one)")
    p.add_argument("--skip-path", action="store_true", help="only the format part, no nats-server")
    p.add_argument("--skip-formats", action="store_true", help="only the path part")
    p.add_argument(
        "--grads",
        action="store_true",
        help="real gradients (AdamW on random tokens, GradMaster) instead of lr * sign(noise) steps",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        default=["objstore"],
        choices=["objstore", "shared_dir"],
        help="file transports of the path part",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["full", "delta_after_full", "delta"],
        choices=["full", "delta_after_full", "delta"],
        help="publication orders of the path part",
    )
    p.add_argument(
        "--build",
        default=None,
        choices=["0.6b", "4b"],
        help="build a random Qwen3 of this shape (bench.common.random_qwen3) at --model first",
    )
    p.add_argument("--work", default=None, help="directory for the temporary files (default: the system temp dir)")
    p.add_argument("--device", default="cpu", help="where the format part builds the block candidate (cpu, cuda)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    args = p.parse_args()

    from parley.engines.models import ensure_model

    if args.build:
        from bench.common import random_qwen3

        random_qwen3(args.build, args.model)
    model_dir = Path(args.model) if args.build else Path(ensure_model(args.model))
    with tempfile.TemporaryDirectory(prefix="parley-deltabench-", dir=args.work) as tmp:
        work = Path(tmp)
        result = dict(
            model=args.model,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            cpus=os.cpu_count(),
            loadavg_start=os.getloadavg(),
            grads=args.grads,
            formats=[]
            if args.skip_formats
            else formats(model_dir, args.lrs, args.steps, work, args.grads, args.device),
        )
        if not args.skip_path:

            def save(rows):
                if args.json:
                    Path(args.json).write_text(json.dumps({**result, "objstore": rows}, indent=1) + "\n")

            result["objstore"] = asyncio.run(
                path(model_dir, args.lrs, args.steps, work, args.grads, tuple(args.kinds), tuple(args.modes), save)
            )
        result["loadavg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
