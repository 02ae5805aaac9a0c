"""`parley up`'s GPU memory plan (deploy/memory.py): the one-GPU config is planned on a CPU machine,
a run that does not fit is refused before any work with the overflow and the knobs, each term's
arithmetic matches a hand computation from the model's shape, and the CPU configs plan nothing.
No GPU, no network, no model is built."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from parley.config.run import load_config
from parley.deploy.cli import app
from parley.deploy.memory import PlanError, Shape, learner_terms, make_plan, model_shape, processes

ROOT = Path(__file__).resolve().parents[2]
GPU1 = ROOT / "deploy" / "configs" / "gpu-1.toml"
GIB = 1024**3

# SmolLM2-135M-Instruct by hand: hidden 576, intermediate 1536, 30 layers, 9 heads and 3 kv heads of
# 64, vocabulary 49152, lm_head tied to the embedding.
SMOL_LAYER = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576  # q o, k v, gate up down, 2 norms
SMOL_PARAMS = 49152 * 576 + 30 * SMOL_LAYER + 576
SMOL_PACKED = 2 * SMOL_PARAMS + 61 * 128  # bf16; each of the 61 norms (1152 B) padded to 1280 B
# bytes a token per layer (Shape.layer_activation_bytes), full fine-tuning: eager, each norm its fp32 input,
# normalised input and output (8h), attention q k v out (4 x 12 heads x 64) and lse, SwiGLU 4 x 2i, 1/rms;
# compiled (gpu-1.toml's compile = "layers"), each norm its bf16 input and output (4h), SwiGLU 3 x 2i
SMOL_ACT_LAYER = 2 * 8 * 576 + 4 * (9 + 3) * 64 + 4 * 9 + 8 * 1536 + 2 * 4
SMOL_ACT_COMPILED = 2 * 4 * 576 + 4 * (9 + 3) * 64 + 4 * 9 + 6 * 1536 + 2 * 4


def gpu1_total(total: float, *, services: bool, actor_kv_gib: float = 4.0) -> float:
    """gpu-1.toml's plan by hand, in GiB: 2 actors and the eval engine with actor_kv_gib of KV cache, the
    services' engine with 6 GiB, each engine its bf16 weights and 1 GiB of working memory (the estimate),
    a 1 GiB CUDA context each, and the learner (cuda_ipc actors load from its buffers: no copy). The total does not enter: the
    engines' KV caches are explicit (it is a parameter only to say so)."""
    del total
    learner = (
        16 * SMOL_PARAMS
        + 2 * SMOL_PARAMS
        + 3 * SMOL_PACKED
        + 5e8 * 2  # states, reference, 3 buffers, bucket
        + 16384 * (30 * SMOL_ACT_COMPILED + 8 * 576)
        + 4 * 4 * 1024 * 49152
    ) / GIB + 1.0
    engine = 2 * SMOL_PARAMS / GIB + 1.0 + 1.0  # weights, working memory, context
    engines = 3 * (engine + actor_kv_gib)
    return engines + learner + ((engine + 6.0) if services else 0.0)


# an untied llama-shaped model small enough to work by hand (its config.json)
LLAMA_SHAPE = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=100,
    tie_word_embeddings=False,
)


def up(*args: str):
    return CliRunner().invoke(app, ["up", "--config", str(GPU1), *args])


def test_the_smol_shape_is_known_without_building_it():
    smol = model_shape("smol")
    assert smol.params == SMOL_PARAMS == 134_515_008  # SmolLM2-135M's published count
    assert smol.packed_bytes(2) == SMOL_PACKED and smol.layer_activation_bytes() == SMOL_ACT_LAYER == 24_620
    assert smol.layer_activation_bytes(compiled=True) == SMOL_ACT_COMPILED == 16_940


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU: its total is detected")
def test_gpu1_dry_run_exits_0_on_a_cpu_machine_and_prints_the_plan():
    code = "import sys; sys.argv[0] = 'parley'; from parley.deploy.cli import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "up", "--config", str(GPU1), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    dumped = tomllib.loads(proc.stdout)  # the plan comes as comments: the output is still a config file
    assert dumped["weights"]["kind"] == "cuda_ipc" and dumped["actor"]["engine"]["enforce_eager"] is False
    assert "# GPU memory plan" in proc.stdout and "GPU total unknown: set up.gpu_memory_gib" in proc.stdout
    for row in ("services (sim + judge)", "actor-0", "actor-1", "eval (periodic, [actor.engine])", "learner"):
        assert f"#   {row} " in proc.stdout, row


@pytest.mark.parametrize("env, services", [(None, True), ("hidden_goal", False)])
def test_gpu1_fits_the_h200_with_and_without_the_service_engine(env, services):
    out = up("--dry-run", "--set", "up.gpu_memory_gib=140.4", *(["--env", env] if env else []))
    assert out.exit_code == 0, out.output
    need, usable = gpu1_total(140.4, services=services), 140.4 * 0.95
    assert f"{need:.2f} GiB, of {usable:.2f} usable (95% of 140.4): {usable - need:.2f} GiB to spare" in out.stdout
    assert ("services (sim + judge)" in out.stdout) is services  # a programmatic user: no sim/judge engine
    assert "eval (periodic, [actor.engine])" in out.stdout


def test_a_small_gpu_is_refused_with_the_overflow_and_the_knobs():
    out = up("--dry-run", "--set", "up.gpu_memory_gib=24")
    assert out.exit_code == 2
    need, usable = gpu1_total(24, services=True), 24 * 0.95
    msg = out.stderr
    assert f"need {need:.2f} GiB, more than the {usable:.2f} GiB usable" in msg
    assert f"{need - usable:.2f} GiB over; nothing was started" in msg
    for knob in (
        "actor.engine.kv_cache_bytes = 4294967296",
        "up.actors = 2",
        "sim.engine.kv_cache_bytes = 6442450944",
        "learner.micro_batch_tokens = 16384",
        "learner.gradient_checkpointing = true",
        "weights.max_buffers = 3",
        "learner.eval_every = 5",
        "up.gpu_memory_gib = 24",
    ):
        assert knob in msg, knob


def test_a_larger_actor_kv_cache_is_refused_naming_what_the_actors_take():
    out = up("--dry-run", "--set", "up.gpu_memory_gib=80", "--set", f"actor.engine.kv_cache_bytes={20 * GIB}")
    assert out.exit_code == 2
    need, usable = gpu1_total(80, services=True, actor_kv_gib=20.0), 80 * 0.95
    assert f"{need - usable:.2f} GiB over" in out.stderr
    assert (
        f"actor.engine.kv_cache_bytes = {20 * GIB} (each of the 2 actors' engines and the periodic eval's: "
        f"3 x 20.00 GiB of KV cache)" in out.stderr
    )


def test_a_gpu_memory_utilization_share_is_planned_as_that_share_of_the_gpu():
    out = up("--dry-run", "--set", "up.gpu_memory_gib=140.4", "--set", "actor.engine.gpu_memory_utilization=0.3")
    assert out.exit_code == 2
    base = gpu1_total(140.4, services=True)
    engine_kv = 2 * SMOL_PARAMS / GIB + 1.0 + 4.0  # what each explicit-KV actor engine counted (not the context)
    need = base - 3 * engine_kv + 3 * 0.3 * 140.4
    assert f"{need - 140.4 * 0.95:.2f} GiB over" in out.stderr
    assert (
        f"actor.engine.gpu_memory_utilization = 0.3 (each of the 2 actors' engines and the periodic eval's: "
        f"3 x {0.3 * 140.4:.2f} GiB)" in out.stderr
    )


def test_up_refuses_before_it_starts_anything(monkeypatch):
    import parley.deploy.up  # noqa: F401
    from parley import deploy  # noqa: F401

    def started(*a, **k):
        raise AssertionError("up_main ran: the plan should have refused first")

    monkeypatch.setattr(deploy.up, "up_main", started)
    out = up("--set", "up.gpu_memory_gib=24")
    assert out.exit_code == 2 and "GiB over; nothing was started" in out.stderr


def test_each_term_of_a_small_shape_by_hand(tmp_path):
    """An untied llama-shaped model read from its config.json, and tiny (Qwen3: q/k norms) under the learner."""
    config = LLAMA_SHAPE
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(str(tmp_path))
    assert shape == Shape.of(config)
    layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q k v o, gate up down, 2 norms
    assert shape.params == 100 * 64 + 2 * layer + 64 + 100 * 64 == 86_848  # embedding, layers, norm, lm_head
    assert shape.packed_bytes(2) == 2 * 86_848 + 5 * 128  # the 5 norms of 128 B padded to 256 B
    assert shape.layer_activation_bytes() == 16 * 64 + 4 * (4 + 2) * 16 + 4 * 4 + 8 * 128 + 8 == 2456

    tiny = model_shape("tiny")
    tiny_layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256 + 2 * 128 + 2 * 32  # + q_norm, k_norm
    assert tiny.params == 2048 * 128 + 2 * tiny_layer + 128 == 557_824
    # eager: the q/k norms' fp32 inputs and normalised inputs, 6 (nq + nkv) d, and their 1/rms a head
    tiny_eager = 16 * 128 + 4 * (4 + 2) * 32 + 4 * 4 + 8 * 256 + 6 * (4 + 2) * 32 + 8 + 4 * (4 + 2)
    assert tiny.layer_activation_bytes() == tiny_eager == 6064
    # compiled (gpu-1.toml): q and k before their norms, 2 (nq + nkv) d
    tiny_act = 8 * 128 + 4 * (4 + 2) * 32 + 4 * 4 + 6 * 256 + 2 * (4 + 2) * 32 + 8 + 4 * (4 + 2)
    assert tiny.layer_activation_bytes(compiled=True) == tiny_act == 3760

    cfg = load_config(
        GPU1,
        [
            "policy.model=tiny",
            "actor.engine.model=tiny",
            "learner.micro_batch_tokens=2048",
            "actor.engine.max_model_len=4096",
            "learner.logit_chunk_tokens=512",
        ],
    )
    terms = {t.what.split(":")[0]: t.gib * GIB for t in learner_terms(cfg, tiny)}
    n, t = 557_824, 4096  # the longest micro-batch: one whole 4096-token trajectory
    packed = 2 * n + 4 * 192  # in bf16 the 4 q/k norms (64 B) are padded to 256 B
    assert terms["weights + gradients + fp32 master + Adam m, v"] == pytest.approx(16 * n)
    assert terms["frozen reference (policy.reference = local)"] == pytest.approx(2 * n)
    assert terms["cuda_ipc buffers"] == pytest.approx(3 * packed)  # gpu-1.toml: weights.max_buffers = 3
    assert terms["DeepSpeed gradient bucket"] == pytest.approx(5e8 * 2)
    assert terms["activations"] == pytest.approx(t * (2 * tiny_act + 8 * 128))
    assert terms["logits"] == pytest.approx(4 * 4 * 512 * 2048)
    assert terms["CUDA context"] == pytest.approx(GIB)

    ckpt = {
        t.what.split(":")[0]: t.gib * GIB
        for t in learner_terms(load_config(GPU1, ["learner.gradient_checkpointing=true"]), model_shape("smol"))
    }
    assert ckpt["activations"] == pytest.approx(16384 * (30 * 2 * 576 + SMOL_ACT_COMPILED + 8 * 576))


def test_an_unreadable_model_is_a_plan_error_naming_it():
    with pytest.raises(PlanError, match=r"model '/no/such/model': cannot read /no/such/model/config.json .*tiny, smol"):
        model_shape("/no/such/model")


@pytest.mark.parametrize("path", [ROOT / "deploy" / "configs" / "tiny.toml", None])
def test_cpu_configs_plan_nothing(path):
    cfg = load_config(path)
    assert make_plan(cfg) is None
    out = CliRunner().invoke(app, ["up", *(["--config", str(path)] if path else []), "--dry-run"])
    assert out.exit_code == 0 and "GPU memory plan" not in out.output
    tomllib.loads(out.stdout)


def test_packed_deltas_are_planned_on_the_learner_and_on_every_actor():
    """[weights] delta_format = "packed": rank 0 keeps two packed versions, every actor's engine a
    packed copy of what it serves (outside vLLM's share); "file" deltas and full-only versions none."""
    base = ["policy.model=tiny", "actor.engine.model=tiny", 'weights.kind="objstore"']
    packed = 2 * 557_824 + 4 * 192  # tiny in bf16, the 4 q/k norms padded (test_each_term_of_a_small_shape_by_hand)

    def terms(sets):
        procs = processes(load_config(None, [*base, *sets]))  # gpu-1.toml's [weights] is cuda_ipc's
        learner = {t.what.split(":")[0]: t.gib * GIB for p in procs if p.name == "learner" for t in p.terms}
        actors = [{t.what: t.gib * GIB for t in p.terms} for p in procs if p.name.startswith("actor-")]
        return learner, actors

    learner, actors = terms(['weights.delta_format="packed"', "weights.full_every=10"])
    assert learner['packed versions (weights.delta_format = "packed")'] == pytest.approx(2 * packed)
    assert actors and all(
        a['its packed copy of the served weights (weights.delta_format = "packed")'] == pytest.approx(packed)
        for a in actors
    )
    for sets in (['weights.delta_format="file"', "weights.full_every=10"], ['weights.delta_format="packed"']):
        learner, actors = terms(sets)
        assert not any(k.startswith("packed versions") for k in learner)
        assert not any("packed copy" in k for a in actors for k in a)


def test_what_the_plan_chooses_reaches_the_config_of_a_model_given_by_hub_id(tmp_path, monkeypatch):
    """A model given by Hub id is planned from its local directory (a copy of the config that names it
    there); what the plan chooses for an "auto" setting must still reach the config the children are
    given (the dry run prints it): it went into the copy, and the learner was given "auto"."""
    import parley.deploy.up_cli as up_cli

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SHAPE))
    hub = "SomeOrg/some-model"
    # the Hub check's answer (test double: no download): the id is known, here is its directory
    monkeypatch.setattr(up_cli, "check_inputs", lambda cfg: ([], {hub: tmp_path}))
    out = up(
        "--dry-run",
        "--set",
        f'policy.model="{hub}"',
        "--set",
        f'actor.engine.model="{hub}"',
        "--set",
        'learner.gradient_checkpointing="auto"',
        "--set",
        "up.gpu_memory_gib=80",
    )
    assert out.exit_code == 0, out.output
    printed = tomllib.loads(out.stdout[out.stdout.index("[run]") :]) if "[run]" in out.stdout else None
    assert printed is not None, out.stdout
    assert printed["learner"]["gradient_checkpointing"] is False  # everything fits without recompute on 80 GiB
    assert printed["policy"]["model"] == hub  # the run keeps the id; only the plan read the directory
