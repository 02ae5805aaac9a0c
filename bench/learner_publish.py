"""The learner's step-to-step gap with weight publication beside training and inline, and the
ledger's bytes per write with the sample log and as a full rewrite (issue 15, items 5 and 7).

Gap: the real `parley.learner.service.Learner` with the real `Trainer` (DeepSpeed, CPU, gloo) on a real
nats-server, publishing every step (`--transport objstore` or `shared_dir`); all scored samples are in SCORED
before it starts, so no step waits for data. The gap is the time from the end of one train_step to
the start of the next (the driver is timed), once with the Learner as shipped (the step takes a CPU
copy, the Publisher uploads beside the next step) and once with the publication drained before the
step returns (`Inline`, what the learner did before: write, upload, hash and announce on the step's
path). Checkpoints only after the last step, so they are not in the gaps.

Ledger: `parley.learner.checkpoint.Ledger.write` on a buffer of `--groups` groups of `--n` samples of
`--tokens` tokens each, one new group per write, against the size of the same state with every
sample inline (what each write cost before the sample log).

    .venv/bin/python bench/learner_publish.py --model smol --steps 5 --json /tmp/learner_publish.json
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


class TimedDriver:
    """Wraps learner.ranks.Driver: notes when each train_step starts and ends; every other call
    goes to the driver as it is."""

    def __init__(self, driver):
        self.driver, self.spans = driver, []

    def __getattr__(self, name):
        return getattr(self.driver, name)

    def train_step(self, samples):
        t0 = time.monotonic()
        out = self.driver.train_step(samples)
        self.spans.append((t0, time.monotonic()))
        return out


def scored_samples(tok, run: str, groups: int, n: int, tokens: int):
    from parley.protocol import arrays
    from parley.protocol.messages import AssistantTurn, ChatMessage, Scored, Trajectory

    words = tok.encode("Here is a first draft of the letter, with the tone you asked for. ", add_special_tokens=False)
    out = []
    for g in range(groups):
        for i in range(n):
            prompt = (words * 8)[:32]
            reply = (words * (tokens // len(words) + 1))[g + i : g + i + tokens - 32]
            traj = Trajectory(
                traj_id=f"bench-{g:03d}/{i}",
                task_id=f"bench-{g:03d}",
                sample=i,
                run=run,
                item_id=f"item-{g}",
                messages=[ChatMessage("user", "Write the letter."), ChatMessage("assistant", "...")],
                token_ids_i32=arrays.pack_ids(prompt + reply),
                loss_mask_u8=arrays.pack_mask([0] * len(prompt) + [1] * len(reply)),
                turns=[
                    AssistantTurn(
                        start=len(prompt),
                        logprobs_f32=arrays.pack_logprobs([-2.0] * len(reply)),
                        version=0,
                        finish_reason="stop",
                    )
                ],
            )
            reward = 0.1 + 0.8 * i / max(1, n - 1)
            out.append(
                Scored(
                    traj_id=traj.traj_id,
                    task_id=traj.task_id,
                    sample=i,
                    run=run,
                    metrics={"bleu": reward},
                    weights={"bleu": 1.0},
                    total=reward,
                    trajectory=traj,
                )
            )
    return out


async def gaps(args, work: Path) -> dict:
    from transformers import AutoTokenizer

    from parley.config.learner import LearnerConfig, RolloutConfig
    from parley.config.policy import PolicySection
    from parley.config.run import RunConfig
    from parley.deploy.natsserver import NatsServer
    from parley.engines.models import ensure_model
    from parley.learner.ranks import Driver
    from parley.learner.service import Learner
    from parley.learner.trainer import Trainer
    from parley.protocol import topology
    from parley.protocol.bus import publish
    from parley.protocol.connect import connect
    from parley.weights.config import ObjstoreWeights, SharedDirWeights

    class Inline(Learner):
        """The learner before issue 15: the step returns only once its version is announced."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            publish = self.weights.publish

            async def publish_and_wait(version, write_now=False):
                await publish(version, write_now)
                await self.publisher.drain()

            self.weights.publish = publish_and_wait

    server = NatsServer(work / "nats", port=0)
    server.start()
    nc = await connect(server.url, name="bench")
    js = nc.jetstream()
    model_dir = ensure_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    bus = topology.BusSettings(max_bytes=2 * 1024**3)
    lc = dict(
        steps=args.steps,
        groups_per_step=1,
        max_staleness=args.steps,
        stale_policy="correct",
        checkpoint_every=10_000,
        eval_every=0,
        micro_batch_tokens=4096,
        lr=1e-5,
        ledger_flush_s=0.5,
    )
    weights = {"objstore": ObjstoreWeights(), "shared_dir": SharedDirWeights(dir=str(work / "shared"))}[args.transport]
    trainer = await asyncio.to_thread(Trainer, LearnerConfig(**lc), model_dir, weights=weights)
    out = {}
    try:
        for mode, cls in (("background", Learner), ("inline", Inline)):
            if mode not in args.modes:
                continue
            run = f"bench-{mode}"
            await topology.ensure_topology(js, run, bus)
            for s in scored_samples(tok, run, args.steps, 2, args.sample_tokens):
                await publish(js, run, "scored", s)
            cfg = RunConfig(
                bus=bus,
                rollout=RolloutConfig(n=2),
                learner=LearnerConfig(**lc),
                weights=weights,
                policy=PolicySection(model=str(model_dir)),
            )
            cfg.run.name, cfg.run.dir = run, str(work / run)
            driver = TimedDriver(Driver(trainer))
            learner = cls(cfg, js, nc, driver, model_dir=model_dir, resume=False, steps=args.steps)
            t0 = time.monotonic()
            assert await learner.run(asyncio.Event()) == 0
            spans = driver.spans
            g = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
            size = (work / run / "learner" / "weights" / f"v{args.steps:06d}" / "model.safetensors").stat().st_size
            out[mode] = {
                "gaps_s": g,
                "median_gap_s": statistics.median(g),
                "train_s": [b - a for a, b in spans],
                "wall_s": time.monotonic() - t0,
                "weights_bytes": size,
                "published": dict(learner.publisher.counters),
                "superseded": learner.publisher.superseded,
            }
            print(
                f"{mode}: gaps {[round(x, 2) for x in g]} s (median {out[mode]['median_gap_s']:.2f}), "
                f"train {[round(b - a, 2) for a, b in spans]} s, {size / 1e6:.0f} MB weights, "
                f"published {dict(learner.publisher.counters)}",
                flush=True,
            )
    finally:
        trainer.close()
        await nc.close()
        server.stop()
    return out


def ledger_bytes(args, work: Path) -> dict:
    import msgspec

    from parley.learner import checkpoint as ckpt
    from parley.protocol import arrays
    from parley.protocol.messages import AssistantTurn, ChatMessage, Scored, Trajectory

    def sample(g: int, i: int) -> Scored:
        t = args.tokens
        ids = [(g * 7919 + i * 104729 + k * 31) % 150_000 for k in range(t)]
        # as actors send it: packed arrays (protocol.arrays), the conversation's text beside them
        traj = Trajectory(
            traj_id=f"r-g{g:06d}/{i}",
            task_id=f"r-g{g:06d}",
            sample=i,
            run="r",
            item_id=f"item-{g}",
            messages=[ChatMessage("user", "w" * (t // 2)), ChatMessage("assistant", "x" * (t * 3))],
            token_ids_i32=arrays.pack_ids(ids),
            loss_mask_u8=arrays.pack_mask([0] * (t // 4) + [1] * (t - t // 4)),
            turns=[
                AssistantTurn(
                    start=t // 4,
                    version=0,
                    finish_reason="stop",
                    logprobs_f32=arrays.pack_logprobs([-0.5 - 1e-4 * k for k in range(t - t // 4)]),
                )
            ],
        )
        return Scored(
            traj_id=traj.traj_id,
            task_id=traj.task_id,
            sample=i,
            run="r",
            metrics={"bleu": 0.5},
            weights={"bleu": 1.0},
            total=0.5,
            trajectory=traj,
            document="d" * (t * 2),
        )

    ledger = ckpt.Ledger(work / "ledger")
    groups, rows = [], []
    for g in range(args.groups):
        groups.append(
            ckpt.GroupState(task_id=f"r-g{g:06d}", first_seen=float(g), samples=[sample(g, i) for i in range(args.n)])
        )
        state = ckpt.LearnerState(step=0, groups=groups)
        before = ledger.bytes_written
        ledger.write(state)
        rows.append((ledger.bytes_written - before, len(msgspec.msgpack.encode(state))))
    ledger.close()
    new, full = zip(*rows)
    res = {
        "groups": args.groups,
        "n": args.n,
        "tokens": args.tokens,
        "sample_bytes": len(msgspec.msgpack.encode(sample(0, 0))),
        "last_write_bytes": new[-1],
        "last_full_rewrite_bytes": full[-1],
        "total_bytes": sum(new),
        "total_full_rewrite_bytes": sum(full),
    }
    print(
        f"ledger: {args.groups} groups x {args.n} samples x {args.tokens} tokens ({res['sample_bytes'] / 1e3:.0f} kB "
        f"a sample): last write {new[-1] / 1e6:.2f} MB (full rewrite {full[-1] / 1e6:.1f} MB); "
        f"{args.groups} writes {sum(new) / 1e6:.1f} MB (full rewrite {sum(full) / 1e6:.0f} MB)",
        flush=True,
    )
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smol")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--transport", default="objstore", choices=["objstore", "shared_dir"])
    p.add_argument("--sample-tokens", type=int, default=128, help="tokens per trained sample in the gap runs")
    p.add_argument("--groups", type=int, default=160, help="ledger: buffered groups at the last write")
    p.add_argument("--n", type=int, default=8, help="ledger: samples per group")
    p.add_argument("--tokens", type=int, default=4096, help="ledger: tokens per sample")
    p.add_argument("--skip-gaps", action="store_true")
    p.add_argument("--skip-ledger", action="store_true")
    p.add_argument("--modes", nargs="+", default=["background", "inline"], choices=["background", "inline"])
    p.add_argument("--json", default="")
    args = p.parse_args()
    os.environ.setdefault("PARLEY_LOG", "WARNING")
    with tempfile.TemporaryDirectory(prefix="parley-bench-pub-") as tmp:
        work = Path(tmp)
        result = {"args": vars(args), "load_before": os.getloadavg()}
        if not args.skip_ledger:
            result["ledger"] = ledger_bytes(args, work)
        if not args.skip_gaps:
            result["gaps"] = asyncio.run(gaps(args, work))
        result["load_after"] = os.getloadavg()
    print(f"load average before/after: {result['load_before']} / {result['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
