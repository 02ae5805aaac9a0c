"""vLLM's sleep mode under parley's engine wrapper, on a real GPU (`[up] gpu_share = "phased"`): the
checks to run before a phased throughput run, in a couple of minutes (bench/gpu_run.sh part S).

- level 1: the GPU memory the KV cache held is given back, and after wake_up the same prompt gives
  the same greedy tokens and log-probs. The prompt is long enough to leave full blocks in the prefix
  cache: vLLM must drop them at sleep (their KV is gone), or the second answer reads garbage.
- level 2: weights woken, a version loaded through the actor's whole-weight paths (cuda_ipc from the
  learner's buffer, as on one GPU, and files), then the KV cache woken: the engine serves what it
  serves with the same weights loaded awake.
- actors.phases.PhaseSchedule with the real WeightFollower hooks, one ACTIVE -> SLEEPING -> WAKING ->
  ACTIVE cycle, as tests/unit/test_phases.py drives its test double.

CUDA graphs on (enforce_eager = false, as deploy/configs/gpu-*.toml): a woken engine replays graphs
captured before the sleep, so this also checks that the woken memory is mapped where it was.
SLEEP_TEST_EAGER=1 runs it eager instead, to tell a sleep-mode failure from a graph or compile one.
Runs only where torch sees a CUDA device (gpu marker); docs/gpu.md, "Tests on a GPU", has the command."""

from __future__ import annotations

import asyncio
import os

import pytest

from parley.engines.engine import EngineSettings, PolicyEngine
from parley.engines.models import build_tiny

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(300)]

KV_BYTES = 512 << 20
TOL = 1e-4  # as tests/e2e/test_logprob_agreement.py: fp32 on both sides
PROMPT = list(range(5, 75))  # 70 tokens: four full 16-token blocks in the prefix cache


def close(a, b) -> bool:
    """Same greedy tokens, log-probs within TOL."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(abs(x - y) <= TOL for x, y in zip(a[1], b[1]))


class Sleepy:
    """One sleep-mode engine on the tiny model, its loop, and a stepped copy of its weights."""

    def __init__(self, tmp):
        import torch
        from transformers import AutoModelForCausalLM

        from parley.weights.snapshot import hf_weights, write_weights

        self.base = build_tiny(tmp / "tiny")
        # fp32 as test_cuda_ipc.py (the toy's head_dim 32 has no FlashAttention-3 kernel)
        self.learner = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32).to("cuda").eval()
        with torch.no_grad():  # "a training step": other weights than the engine starts with
            g = torch.Generator(device="cuda").manual_seed(1)
            for p in self.learner.parameters():
                p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.05)
        self.stepped = write_weights(hf_weights(self.learner), self.learner.config, tmp / "stepped")
        self.loop = asyncio.new_event_loop()
        self.engine = PolicyEngine(
            EngineSettings(
                model=str(self.base),
                dtype="float32",
                max_model_len=1024,
                kv_cache_bytes=KV_BYTES,
                json_compact=False,
                enforce_eager=os.environ.get("SLEEP_TEST_EAGER", "0") == "1",
                sleep_mode=True,
            )
        )

    def run(self, coro, timeout: float = 120.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def greedy(self, prompt=PROMPT):
        out = self.run(self.engine.generate(prompt, max_tokens=24, temperature=0.0))
        return out.token_ids, out.logprobs

    def close(self):
        self.engine.shutdown()
        self.loop.close()


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory):
    s = Sleepy(tmp_path_factory.mktemp("sleep"))
    yield s
    s.close()


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_the_engine_can_sleep_here(sleepy):
    assert sleepy.engine.can_sleep, "sleep mode is off on this platform: the phased schedule would free nothing"


def test_level_1_gives_back_the_kv_cache_and_wakes_to_the_same_answers(sleepy):
    before = sleepy.greedy()
    assert close(sleepy.greedy(), before)  # twice awake: the second reads the prefix cache
    free_awake = free_bytes()
    sleepy.run(sleepy.engine.sleep(1))
    freed = free_bytes() - free_awake
    print(f"level 1 freed {freed / 2**20:.0f} MiB (KV cache {KV_BYTES / 2**20:.0f} MiB)")
    assert freed >= 0.75 * KV_BYTES
    sleepy.run(sleepy.engine.wake_up())
    assert free_bytes() <= free_awake + 0.25 * KV_BYTES  # all of it taken back
    after = sleepy.greedy()
    assert close(after, before), (before, after)
    assert close(sleepy.greedy(), before)  # and from the prefix cache computed after the wake


def test_level_2_then_a_version_loaded_while_the_kv_cache_sleeps_serves_what_it_serves_awake(sleepy):
    from parley.protocol import codec
    from parley.weights.cuda_ipc import IpcPublisher
    from parley.weights.registry import gpu_announcement
    from parley.weights.snapshot import hf_tensors

    e = sleepy.engine
    base = sleepy.greedy()
    sleepy.run(e.reload_weights(sleepy.stepped, version=1))  # the same weights, loaded awake
    awake = sleepy.greedy()
    assert awake != base
    sleepy.run(e.reload_weights(sleepy.base, version=0))
    assert close(sleepy.greedy(), base)

    pub = IpcPublisher(hold_s=60.0)
    wv = gpu_announcement("gpu-test", 1, 1, pub.pack(hf_tensors(sleepy.learner), 1))
    for how in ("cuda_ipc", "files"):
        free_awake = free_bytes()
        sleepy.run(e.sleep(2))
        freed = free_bytes() - free_awake
        print(f"level 2 freed {freed / 2**20:.0f} MiB ({how})")
        assert freed >= 0.75 * KV_BYTES
        sleepy.run(e.wake_up(["weights"]))  # as PhaseSchedule.before_load
        if how == "cuda_ipc":  # the follower's path for whole weights on one GPU
            sleepy.run(e.load_gpu(codec.encode(wv), hold_s=60.0, version=1))
        else:  # shared_dir / objstore: the files
            sleepy.run(e.reload_weights(sleepy.stepped, version=1))
        sleepy.run(e.wake_up(["kv_cache"]))  # as PhaseSchedule.after_load
        got = sleepy.greedy()
        assert close(got, awake), (how, awake, got)
        sleepy.run(e.reload_weights(sleepy.base, version=0))
        assert close(sleepy.greedy(), base)


def test_a_phase_schedule_sleeps_and_wakes_the_real_engine_around_a_load(sleepy):
    """ACTIVE -> SLEEPING (the step's last conversation ended) -> WAKING (the follower's before_load:
    weights) -> the version loaded -> ACTIVE (after_load: KV cache), at level 2, and a conversation
    that starts while asleep wakes the engine whole with the served weights put back."""
    from parley.actors.phases import ACTIVE, SLEEPING, PhaseSchedule

    e = sleepy.engine
    base = sleepy.greedy()
    sleepy.run(e.reload_weights(sleepy.stepped, version=1))
    stepped = sleepy.greedy()
    sleepy.run(e.reload_weights(sleepy.base, version=0))
    served = {"dir": sleepy.base}

    async def put_back():
        await e.reload_weights(served["dir"], version=e.version)

    p = PhaseSchedule(e, level=2, quota=1, put_back=put_back, timeout_s=60.0)

    async def conversation(version: int):
        await p.enter()
        try:
            out = await e.generate(PROMPT, max_tokens=24, temperature=0.0)
        finally:
            await p.leave(version)
        return out.token_ids, out.logprobs

    assert close(sleepy.run(conversation(0)), base)
    assert p.phase == SLEEPING
    sleepy.run(p.before_load())
    sleepy.run(e.reload_weights(sleepy.stepped, version=1))
    served["dir"] = sleepy.stepped
    sleepy.run(p.after_load(True))
    assert p.phase == ACTIVE and p.counters["wakes"] == 1
    assert close(sleepy.greedy(), stepped)
    # the step's conversation on version 1 puts it to sleep; a group issued again wakes it whole
    assert close(sleepy.run(conversation(1)), stepped) and p.phase == SLEEPING
    p.quota = 10**6  # no sleep after this one
    assert close(sleepy.run(conversation(1)), stepped)
    assert p.phase == ACTIVE and p.counters["wakes_for_task"] == 1 and p.failure is None
    sleepy.run(e.reload_weights(sleepy.base, version=0))
