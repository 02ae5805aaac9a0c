"""[up] gpu_share = "phased" before anything starts: the config's refusals (one line naming the value
and the fix), `parley up`'s refusal of phased with nothing on a GPU, and the memory plan's two phases
by hand (GENERATE: the actor awake beside the learner between steps; TRAIN: the learner's step beside
the actor asleep); also deploy.memory.uses_gpu seeing an engine given an explicit KV cache on a GPU.
No GPU, no network, no model is built."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from parley.config.run import load_config
from parley.deploy.cli import app
from parley.deploy.memory import make_plan, uses_gpu
from parley.errors import ConfigError
from parley.weights import registry

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "deploy" / "configs" / "tiny.toml"
GIB = 1024**3

# tiny (engines.models.MODEL_SHAPES) by hand: hidden 128, intermediate 256, 2 layers, 4 heads and 2 kv
# heads of 32, vocabulary 2048, tied; its q/k norms (tests/unit/test_memory_plan.py has the sum).
TINY_PARAMS = 557_824
TINY_ACT_LAYER = 3760  # bytes a token per layer kept for backward by compiled layers (compile "auto", ZeRO-2, a GPU)

# One actor and the learner on a 10 GiB GPU, cuda_ipc, no services (random_words plays the user).
PHASED = [
    'policy.model="tiny"',
    'actor.engine.model="tiny"',
    'actor.engine.dtype="bfloat16"',
    "actor.engine.kv_cache_bytes=2147483648",  # 2 GiB
    "actor.engine.max_model_len=2048",
    'env.name="random_words"',
    "learner.eval_every=0",
    "up.actors=1",
    'weights.kind="cuda_ipc"',
    "weights.max_buffers=1",
    'learner.dtype="bfloat16"',
    "learner.zero_stage=2",
    "learner.micro_batch_tokens=2048",
    "learner.logit_chunk_tokens=512",
    "learner.gradient_checkpointing=false",
    "learner.kl_coef=0.0",
    "learner.max_staleness=0",
    "up.gpu_memory_gib=10",
    'up.gpu_share="phased"',
]


def by_hand(sleep_level: int) -> tuple[float, float, float]:
    """(GENERATE, TRAIN, overlapped) GiB of PHASED, computed here from tiny's shape."""
    weights = 2 * TINY_PARAMS  # bf16
    packed = 2 * TINY_PARAMS + 4 * 192  # the cuda_ipc buffer: 4 q/k norms of 64 B padded to 256 B
    actor_awake = weights + 2 * GIB + 1 * GIB + 1 * GIB  # weights, KV, working memory, CUDA context
    actor_asleep = 1 * GIB + 1 * GIB  # working memory and context stay; weights (either level) and KV go
    learner_rest = 16 * weights // 2 + packed + 1 * GIB  # (2 + 2 + 4 + 8) B a param, the buffer, context
    step = 5e8 * 2 + 2048 * (2 * TINY_ACT_LAYER + 8 * 128) + 4 * 4 * 512 * 2048  # bucket, activations, logits
    del sleep_level  # level 1 keeps the weights in host memory: not on the GPU either
    return (
        (actor_awake + learner_rest) / GIB,
        (actor_asleep + learner_rest + step) / GIB,
        (actor_awake + learner_rest + step) / GIB,
    )


@pytest.mark.parametrize("level", [1, 2])
def test_the_plan_needs_the_larger_phase_not_the_sum(level):
    plan = make_plan(load_config(None, [*PHASED, f"actor.sleep_level={level}"]))
    generate, train, overlapped = by_hand(level)
    assert plan.phased and plan.need == pytest.approx(max(generate, train))
    assert plan.need < overlapped - 0.9  # the KV cache (2 GiB) and the step (1 GiB) are never held together
    text = plan.render()
    assert f"GENERATE {generate:.2f} GiB: the actor's engine awake" in text
    assert f"TRAIN {train:.2f} GiB: the learner's step; the actor's engine asleep" in text
    assert "(GENERATE only) its KV cache" in text and "(TRAIN only) activations" in text
    host = "(host, not on the GPU) its weights while it sleeps (sleep level 1)"
    assert (host in text) is (level == 1)


def test_overlapped_sharing_still_sums_every_term():
    plan = make_plan(load_config(None, [*PHASED, 'up.gpu_share="plain"']))
    assert not plan.phased and plan.need == pytest.approx(by_hand(2)[2])
    assert "GENERATE only" not in plan.render()


def test_the_kv_cache_may_grow_into_the_memory_of_the_learners_step():
    """9.5 GiB usable: overlapped, a 5.6 GiB KV cache is refused (9.58 GiB); phased it fits (8.61),
    because the learner's step (0.97 GiB) takes its memory only while the engine sleeps."""
    kv = ["actor.engine.kv_cache_bytes=6012954214"]  # 5.6 GiB
    assert make_plan(load_config(None, [*PHASED, *kv, 'up.gpu_share="plain"'])).fits is False
    assert make_plan(load_config(None, [*PHASED, *kv])).fits is True


def test_a_learner_that_keeps_its_cache_holds_its_step_in_both_phases():
    plan = make_plan(load_config(None, [*PHASED, 'learner.gpu_cache="keep_when_room"']))
    generate, train, overlapped = by_hand(2)
    step = train - generate + 2 * TINY_PARAMS / GIB + 2.0  # the step's GiB (by_hand's difference, undone)
    assert plan.need == pytest.approx(generate + step)
    assert "(TRAIN only) activations" not in plan.render()


@pytest.mark.parametrize(
    "sets, words",
    [
        (["learner.max_staleness=1"], ["learner.max_staleness=1", "set learner.max_staleness = 0"]),
        (["learner.oversample_groups=2"], ["learner.oversample_groups=2", "set learner.oversample_groups = 0"]),
        (["up.actors=2"], ["with 2 actors", "set up.actors = 1"]),
        (
            ["actor.sleep_level=2", "actor.engine.max_lora_rank=16"],
            ["actor.sleep_level = 2 with actor.engine.max_lora_rank=16", "set actor.sleep_level = 1"],
        ),
        # the served version's only copy is the learner's buffer, which the next version refills: with
        # two buffers too (test_level_2_cannot_refill_a_version_from_the_learners_buffer_after_the_next)
        *(
            (
                ["actor.sleep_level=2", f"weights.max_buffers={k}"],
                ['actor.sleep_level = 2 with weights.kind = "cuda_ipc"', "set actor.sleep_level = 1"],
            )
            for k in (1, 2)
        ),
    ],
)
def test_phased_is_refused_in_one_line_naming_the_value_and_the_fix(sets, words):
    from parley.config.run import check_phased

    cfg = load_config(None, [*PHASED, *sets])
    with pytest.raises(ConfigError) as e:
        check_phased(cfg)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    out = CliRunner().invoke(app, ["up", "--dry-run", *(a for s in [*PHASED, *sets] for a in ("--set", s))])
    assert out.exit_code == 2 and words[0] in out.output


def test_the_sleep_level_follows_what_is_served_and_how_it_travels():
    def level(*sets):
        files = any(s.startswith("weights.kind") for s in sets)  # no max_buffers: a key of GPU transports
        cfg = load_config(None, [s for s in PHASED if not (files and s.startswith("weights."))] + list(sets))
        return cfg.actor.sleep_level_served(cfg.weights)

    # whole weights as files: level 2, the served files are loaded again when needed
    assert level('weights.kind="objstore"') == 2
    assert level('weights.kind="shared_dir"', 'weights.dir="/tmp/w"') == 2
    # whole weights in the learner's GPU buffer: level 1, the served version is kept in host memory
    assert level() == 1 and level("weights.max_buffers=2") == 1
    assert level('weights.kind="objstore"', "actor.engine.max_lora_rank=16") == 1  # adapters on the base
    assert level('weights.kind="objstore"', "actor.sleep_level=1") == 1


def test_level_2_cannot_refill_a_version_from_the_learners_buffer_after_the_next():
    """Why check_phased refuses level 2 with a GPU transport, whatever max_buffers: a phased step is
    longer than the hold time, and the learner packs the next version into the oldest buffer out of
    its hold, the served version's. A level-2 engine woken on the served version (a group issued again
    while asleep; a wake whose new version fails to load) finds it gone, as load_again would."""
    from parley.weights.cuda_ipc import IpcPublisher
    from tests.unit.test_cuda_ipc_parts import named

    for max_buffers in (1, 2):
        pub = IpcPublisher(hold_s=0.0, max_buffers=max_buffers)  # hold_s 0: every step outlasts it
        pub.fill(named(), 1)  # the version the actor serves, then sleeps on
        pub.fill(named(), 2)  # the learner's step ends: the next version is packed
        assert pub.take(1) is None and len(pub.buffers) == 1, max_buffers


def test_parley_up_refuses_phased_for_a_config_with_nothing_on_a_gpu():
    out = CliRunner().invoke(
        app, ["up", "--config", str(TINY), "--set", 'up.gpu_share="phased"', "--set", "learner.max_staleness=0"]
    )
    assert out.exit_code == 2 and 'gpu_share = "phased", but this config puts nothing on a GPU' in out.output


def test_the_phased_dry_run_says_how_the_gpu_is_shared():
    out = CliRunner().invoke(app, ["up", "--dry-run", *(a for s in PHASED for a in ("--set", s))])
    assert out.exit_code == 0, out.output
    assert "# GPU sharing: phased" in out.output and "sleep level 1" in out.output  # cuda_ipc: level 1


def test_an_engine_with_an_explicit_kv_cache_on_a_gpu_is_planned():
    """An engine given kv_cache_bytes and no gpu_memory_utilization (every GPU config here, e.g.
    qwen3-4b.toml) with a transport that needs no CUDA (objstore, the default) put nothing on a GPU
    for the plan (no plan, no MPS) though it is a bf16 engine of a GPU. A half-precision engine or
    up.gpu_memory_gib says GPU; the CPU configs (float32 engines) stay unplanned."""
    cfg = load_config(None, ['actor.engine.dtype="bfloat16"'])
    assert cfg.actor.engine.gpu_memory_utilization == 0 and cfg.actor.engine.kv_cache_bytes > 0
    assert not registry.of(cfg.weights).needs_cuda  # objstore
    assert uses_gpu(cfg) and make_plan(load_config(None, ['actor.engine.dtype="bfloat16"', "up.gpu_memory_gib=80"]))
    assert uses_gpu(load_config(TINY, ["up.gpu_memory_gib=80"]))
    assert not uses_gpu(load_config(TINY)) and not uses_gpu(load_config(None))


def test_phased_starts_no_mps_daemon(tmp_path):
    from parley.deploy.mps import start_for

    daemon, line = start_for("phased", tmp_path, True, probe=["false"])  # a probe that would fail: never run
    assert daemon is None and line.startswith("GPU sharing: phased") and "no MPS daemon" in line
    assert start_for("phased", tmp_path, False) == (None, "")


def test_the_progress_line_says_how_often_and_how_long_the_engine_slept():
    from parley.deploy import up
    from parley.deploy.live import Snapshot
    from parley.protocol.messages import Heartbeat

    def snap(**counters):
        return Snapshot(roles={"actor/actor-0": Heartbeat(role="actor", id="actor-0", state="busy", counters=counters)})

    assert "slept" not in up.progress_line(snap(tasks=3.0))  # overlapped sharing: nothing said
    line = up.progress_line(snap(**{"phase.sleeps": 4.0, "phase.wakes": 3.0, "phase.asleep_s": 41.6}))
    assert "| engine slept 4x, 42 s" in line
