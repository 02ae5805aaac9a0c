"""Rollout actors end to end: a real nats-server, real vLLM engines on the toy model, the user
simulator run as `parley sim`, and the actor that gets SIGKILLed run as `parley actor` (both as
`python -m parley.deploy.cli ...` processes with their own engines, started at module set-up so they load
while this process loads the policy engine its in-process actors share: the toy model's shared one,
tests/e2e/conftest.py). Everything async here runs on the shared engines' event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parley.actors.actor import Actor
from parley.config.learner import RolloutConfig
from parley.config.run import load_config
from parley.deploy.natsserver import NatsServer
from parley.protocol import arrays, codec, topology
from parley.protocol.bus import publish
from parley.protocol.connect import connect
from parley.services.sim.client import FALLBACK_MESSAGE
from parley.tasks.data import load_items, task_from_item

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.shared_engine("raw")]

ACK_WAIT_S = 4.0
# small streams: the server reserves max_bytes per stream from its disk budget, for three runs here
BUS = [f"bus.ack_wait_s={ACK_WAIT_S}", f"bus.max_bytes={64 << 20}"]
KILL_RUN = "kill"


class Ctx:
    def __init__(self, root: Path, engines):
        self.root, self.model, self.engines = root, engines.model_dir, engines
        self.server = NatsServer(root / "nats", port=0)
        self.url = self.server.start()
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            self._start_processes()  # they load their engines while ours loads
            self.items = load_items()
            # the toy model's shared engine (tests/e2e/conftest.py); its start is not the scenario's time
            self.engine = engines.get("raw")
            self.run(self._start())
        except BaseException:
            self.kill_processes()  # a failed set-up must not leave engines running for the next tests
            self.server.stop()
            raise

    def kill_processes(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its engine processes too

    def run(self, coro, timeout: float = 240.0):
        return self.engines.run(coro, timeout)

    def cfg(self, run: str, *extra: str):
        return load_config(
            None,
            [
                f'run.name="{run}"',
                f'nats.url="{self.url}"',
                f'actor.engine.model="{self.model}"',
                "actor.engine.max_model_len=2048",
                f"actor.engine.kv_cache_bytes={128 << 20}",
                "actor.weights_poll_s=1.0",
                "rollout.n=4",
                *BUS,
                *extra,
            ],
        )

    def _spawn(self, name: str, args: list[str], sets: list[str]) -> subprocess.Popen:
        argv = [sys.executable, "-m", "parley.deploy.cli", *args, *[a for kv in sets for a in ("--set", kv)]]
        log = (self.root / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2], start_new_session=True
        )
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def _start_processes(self) -> None:
        engine = [f"model={self.model}", "max_model_len=2048", f"kv_cache_bytes={128 << 20}"]
        # 96 tokens: the random toy model closes its JSON string in time often enough, and the
        # simulator's retries and fallbacks get exercised too
        self._spawn(
            "sim",
            ["sim", "--nats", self.url, "--run", "main", "--id", "sim", "--concurrency", "8"],
            [*(f"sim.engine.{kv}" for kv in engine), "sim.max_tokens=96", "sim.max_retries=3"],
        )
        # one conversation at a time, so it is surely caught mid-task
        self.doomed = self._spawn(
            "doomed",
            ["actor", "--nats", self.url, "--run", KILL_RUN, "--id", "doomed", "--concurrency", "1"],
            [*(f"actor.engine.{kv}" for kv in engine), "rollout.n=4", *BUS],
        )

    async def wait_state(self, run: str, role: str, ident: str, state: str = "ready", timeout: float = 300.0):
        """The first heartbeat of process `ident` (role on run) in `state`."""
        seen = asyncio.get_running_loop().create_future()

        async def on_beat(m):
            hb = codec.decode("status", m.data)
            if hb.state == state and not seen.done():
                seen.set_result(hb)

        sub = await self.nc.subscribe(topology.status_subject(run, role, ident), cb=on_beat)
        try:
            deadline = time.monotonic() + timeout
            while not seen.done():
                if self.procs[ident].poll() is not None:
                    raise RuntimeError(f"{ident} exited:\n{self.log_tail(ident)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{ident} not {state} after {timeout}s:\n{self.log_tail(ident)}")
                await asyncio.sleep(0.1)
            return seen.result()
        finally:
            await sub.unsubscribe()

    async def _start(self):
        self.nc = await connect(self.url, name="test-actor")
        self.js = self.nc.jetstream()
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(self.model)
        await self.wait_state("main", "sim", "sim")

    async def start_actor(self, run: str, ident: str, *extra: str):
        cfg = self.cfg(run, *extra)
        await topology.ensure_topology(self.js, run, cfg.bus)
        actor = Actor(
            self.nc, self.js, cfg, self.engine, self.tok, ident=ident, weights_dir=self.root / f"weights-{ident}"
        )
        stop = asyncio.Event()
        job = asyncio.create_task(actor.run_until(stop))
        return actor, stop, job

    def task(self, run: str, task_id: str, item: int = 0, **rollout):
        ro = RolloutConfig(**{"n": 4, "max_new_turns": 4, "max_tokens": 24, "system_prompt": "proactive", **rollout})
        return task_from_item(self.items[item], run=run, task_id=task_id, n=ro.n, rollout=ro, seed=item, version=0)

    def close(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # drain and exit
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.kill_processes()  # whatever engine process outlived its parent

        if getattr(self, "nc", None) is not None:
            self.run(self.nc.close())
        self.engines.restore("raw")  # the weights test left version 1 loaded
        self.server.stop()


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, engines):
    c = Ctx(tmp_path_factory.mktemp("actor"), engines)
    yield c
    c.close()


async def stored(js, run: str, key: str, expect: int, timeout: float = 120.0) -> list:
    """The first `expect` messages of a channel, decoded, once that many are stored."""
    stream = topology.stream_name(run, key)
    deadline = time.monotonic() + timeout
    while (info := await js.stream_info(stream)).state.messages < expect:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stream}: {info.state.messages} of {expect} messages after {timeout}s")
        await asyncio.sleep(0.05)
    first = info.state.first_seq
    return [
        codec.decode(key, (await js.get_msg(stream, seq)).data) for seq in range(first, first + info.state.messages)
    ]


async def settled(js, run: str, timeout: float = 30.0):
    """Wait until the actor consumer has nothing pending or unacked; returns its info."""
    deadline = time.monotonic() + timeout
    while True:
        info = await js.consumer_info(topology.stream_name(run, "tasks"), "actor")
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"tasks of {run} not all acked: {info}")
        await asyncio.sleep(0.05)


def check_trajectory(tok, traj, task):
    """What every trajectory promises the scorer and the learner."""
    assert (traj.run, traj.task_id, traj.item_id, traj.mode) == (task.run, task.task_id, task.item_id, task.mode)
    msgs = [{"role": m.role, "content": m.content} for m in traj.messages]
    assert msgs[0] == {"role": "system", "content": task.system_prompt}
    ends_with_user = msgs[-1]["role"] == "user"
    # token-in/token-out: the ids read back as the template's own rendering of the messages
    ids, mask = arrays.token_ids(traj).tolist(), arrays.loss_mask(traj).tolist()
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=ends_with_user)
    assert len(mask) == len(ids)
    assistant = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert len(traj.turns) == len(assistant) >= 1
    expected_mask = [0] * len(ids)
    for turn, content in zip(traj.turns, assistant):
        lps = arrays.turn_logprobs(turn)
        n = lps.size  # one log-prob per generated token
        gen = ids[turn.start : turn.start + n]
        assert len(gen) == n and n >= 1
        # the span is this turn's generated text, plus its end-of-turn token when it stopped
        assert turn.finish_reason in ("stop", "length")
        stopped = turn.finish_reason == "stop"
        assert (gen[-1] == tok.convert_tokens_to_ids("<|im_end|>")) == stopped
        assert tok.decode(gen[:-1] if stopped else gen) == content
        assert tok.decode(ids[: turn.start]).endswith("<|im_start|>assistant\n")
        assert (lps <= 0.0).all()
        expected_mask[turn.start : turn.start + n] = [1] * n
    assert mask == expected_mask  # exactly the assistant-generated tokens
    assert traj.assistant_tokens == sum(mask)
    assert traj.prompt_tokens == traj.turns[0].start
    for i in traj.sim_fallbacks:
        assert msgs[i] == {"role": "user", "content": FALLBACK_MESSAGE}
    assert traj.terminated in ("sim_done", "max_new_turns")
    added = len(msgs) - 1 - len(task.prefix)
    assert added <= task.max_new_turns


def test_actor_and_simulator_play_a_task_of_four_samples(ctx):
    run = "main"

    async def scenario():
        beats = []

        async def on_beat(m):
            beats.append(m)

        sub = await ctx.nc.subscribe(topology.status_subject(run, "actor", "a1"), cb=on_beat)
        actor, stop, job = await ctx.start_actor(run, "a1")
        conv = ctx.task(run, "conv-1", item=0)
        nt = ctx.task(run, "next-1", item=1, mode="next_turn", n=2, futures=2, future_turns=2)
        await publish(ctx.js, run, "tasks", conv)
        await publish(ctx.js, run, "tasks", nt)
        trajs = await stored(ctx.js, run, "traj", 6)
        await settled(ctx.js, run)
        await asyncio.sleep(2.5)  # one more heartbeat
        stop.set()
        await job
        await sub.unsubscribe()
        sim = await ctx.wait_state("main", "sim", "sim")
        return actor, conv, nt, trajs, [codec.decode("status", m.data) for m in beats], sim

    actor, conv, nt, trajs, beats, sim = ctx.run(scenario())
    by_task = {}
    for t in trajs:
        by_task.setdefault(t.task_id, []).append(t)
    assert sorted(t.sample for t in by_task["conv-1"]) == [0, 1, 2, 3]
    assert sorted(t.sample for t in by_task["next-1"]) == [0, 1]
    for t in by_task["conv-1"]:
        check_trajectory(ctx.tok, t, conv)
        assert all(turn.version == 0 and turn.trained for turn in t.turns)
        assert t.sim_prompt == "lazy_full" and t.actor == "a1" and t.model == str(ctx.model)
        assert t.timings["total"] > 0 and t.created > 0
    # samples of a group differ (distinct seeds)
    assert len({arrays.token_ids(t).tobytes() for t in by_task["conv-1"]}) == 4
    assert len({t.seed for t in by_task["conv-1"]}) == 4
    for t in by_task["next-1"]:
        check_trajectory(ctx.tok, t, nt)
        assert len(t.turns) == 1 and t.turns[0].trained and t.turns[0].version == 0
        assert len(t.futures) == 2
        for f in t.futures:
            assert f.messages[: len(t.messages)] == t.messages
            assert len(f.messages) - len(t.messages) in (0, 2)
    assert actor.counters["tasks"] == 2 and actor.counters["trajectories"] == 6
    assert beats and {b.role for b in beats} == {"actor"} and {b.version for b in beats} == {0}
    assert beats[-1].counters["trajectories"] == 6
    assert {b.state for b in beats} <= {"ready", "busy", "stopping"}
    user_turns = sum(len(t.messages) - 2 for t in trajs) // 2  # at least this many were asked for
    assert sim.counters["served"] >= user_turns and sim.counters.get("errors", 0) == 0
    print(
        f"\nsimulator: {sim.counters}; turns per conversation: "
        f"{[len(t.turns) for t in by_task['conv-1']]}, terminated: {[t.terminated for t in by_task['conv-1']]}"
    )


def test_a_killed_actor_task_is_redelivered_and_stored_once(ctx):
    async def scenario():
        await ctx.wait_state(KILL_RUN, "actor", "doomed")
        task = ctx.task(KILL_RUN, "doomed-1", item=2, max_new_turns=4, max_tokens=32)
        await publish(ctx.js, KILL_RUN, "tasks", task)
        stream = topology.stream_name(KILL_RUN, "traj")
        # the doomed actor plays one sample at a time: kill it as soon as its first one is stored
        while (await ctx.js.stream_info(stream)).state.messages < 1:
            assert ctx.doomed.poll() is None, ctx.log_tail("doomed")
            await asyncio.sleep(0.01)
        ctx.doomed.send_signal(signal.SIGKILL)
        ctx.doomed.wait()
        before = (await ctx.js.stream_info(stream)).state.messages
        rescuer, stop, job = await ctx.start_actor(KILL_RUN, "rescuer")
        trajs = await stored(ctx.js, KILL_RUN, "traj", 4, timeout=60)
        info = await settled(ctx.js, KILL_RUN, timeout=60)
        stop.set()
        await job
        after = (await ctx.js.stream_info(stream)).state.messages
        return task, before, rescuer, trajs, info, after

    task, before, rescuer, trajs, info, after = ctx.run(scenario(), timeout=400)
    print(
        f"\nkilled after {before} of 4 samples; rescuer stored {rescuer.counters['trajectories']} "
        f"({rescuer.counters['duplicates']} duplicates)"
    )
    assert 1 <= before < 4, f"the actor was not killed mid-task ({before} of 4 stored)"
    assert after == 4  # every (task, sample) stored once
    assert sorted(t.traj_id for t in trajs) == [f"doomed-1/{i}" for i in range(4)]
    assert {t.actor for t in trajs} == {"doomed", "rescuer"}
    # the rescuer replayed the whole task; what the doomed actor had stored came back as duplicates
    assert rescuer.counters["trajectories"] == 4 and rescuer.counters["duplicates"] == before
    assert rescuer.counters["tasks"] == 1 and info.num_ack_pending == 0
    for t in trajs:
        check_trajectory(ctx.tok, t, task)
    assert ctx.doomed.returncode == -signal.SIGKILL


def test_weight_versions_are_followed_and_a_corrupt_blob_is_refused(ctx, tmp_path):
    from parley.protocol.messages import WeightVersion
    from parley.weights import common, registry
    from parley.weights.config import ObjstoreWeights
    from tests import factories

    run = "weights"
    # what the learner publishes: a perturbed copy of the policy, saved the HF way
    model = factories.perturbed_model(ctx.model, seed=7)
    v1_dir = tmp_path / "v1"
    model.save_pretrained(v1_dir)
    probe = ctx.tok.encode(
        ctx.tok.apply_chat_template(
            [{"role": "user", "content": "Describe the old mill."}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )

    async def greedy():
        return await ctx.engine.generate(probe, max_tokens=16, temperature=0.0)

    async def until(cond, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    async def scenario():
        actor, stop, job = await ctx.start_actor(run, "w1", "rollout.n=2")
        base_out = await greedy()
        await publish(ctx.js, run, "tasks", ctx.task(run, "before", item=3, n=2))
        before = await stored(ctx.js, run, "traj", 2)

        wv1 = await registry.publish_version(
            ctx.js, run, version=1, step=1, state_dir=v1_dir, settings=ObjstoreWeights()
        )
        await until(lambda: ctx.engine.version == 1)
        v1_out = await greedy()
        await publish(ctx.js, run, "tasks", ctx.task(run, "after", item=3, n=2))
        after = (await stored(ctx.js, run, "traj", 4))[2:]

        # version 2: the stored blob is corrupted (bytes flipped), its announcement carries the
        # sha256 of the good file
        good = (v1_dir / common.MODEL_FILE).read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        store = await ctx.js.object_store(topology.object_bucket(run))
        await store.put("v000002/model.safetensors", bytes(bad))
        extras = []  # the good extra files, beside the bad blob (the follower refuses extras elsewhere)
        for name in wv1.files:
            extra = "v000002/" + name.rsplit("/", 1)[-1]
            await store.put(extra, (await store.get(name)).data)
            extras.append(extra)
        wv2 = WeightVersion(
            version=2,
            step=2,
            transport="objstore",
            location="v000002/model.safetensors",
            sha256=wv1.sha256,
            bytes=wv1.bytes,
            created=time.time(),
            run=run,
            files=extras,
            file_sha256=wv1.file_sha256,  # the good extras' checksums: only the blob is bad
        )
        kv = await ctx.js.key_value(topology.kv_bucket(run))
        await kv.put(topology.WEIGHTS_KEY, codec.encode(wv2))
        await until(lambda: 2 in actor.follower.refused)
        await publish(ctx.js, run, "tasks", ctx.task(run, "refused", item=3, n=2))
        last = (await stored(ctx.js, run, "traj", 6))[4:]
        still = await greedy()
        await settled(ctx.js, run)
        stop.set()
        await job
        return actor, base_out, v1_out, still, before, after, last

    actor, base_out, v1_out, still, before, after, last = ctx.run(scenario())
    assert {turn.version for t in before for turn in t.turns} == {0}
    assert {turn.version for t in after for turn in t.turns} == {1}
    assert {turn.version for t in last for turn in t.turns} == {1}
    assert actor.follower.loaded == [1]
    assert "sha256" in actor.follower.refused[2]
    # the reload really swapped the weights, and the refused version did not
    assert v1_out.logprobs != base_out.logprobs
    assert still.token_ids == v1_out.token_ids
    assert still.logprobs == pytest.approx(v1_out.logprobs, abs=1e-6)
    for t in before + after + last:
        check_trajectory(ctx.tok, t, ctx.task(run, t.task_id, item=3, n=2))
