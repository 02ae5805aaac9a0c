"""The memory plan at the 4B shape on an 80 GB card: it knows a LoRA adapter's states beside the frozen base
and the optimizer state offloaded to the host (deploy/memory.py), gpu-1-4b.toml is refused with changes
that the plan itself accepts, and the two 80 GB configs (gpu-1-4b-offload.toml, gpu-1-4b-lora.toml) fit
it and the H200. The model directory is a stand-in holding only the 4B config.json. No GPU, no model."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.common import QWEN3_SHAPES
from parley.config.run import ConfigError, load_config
from parley.deploy.cli import app
from parley.deploy.memory import learner_terms, model_shape
from tests.unit.test_config_gpu1_4b import stand_in

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "deploy" / "configs"
GIB = 1024**3
H100 = 79.2  # GiB torch.cuda reports for an 80 GB H100 (75.2 usable)
H200 = 140.4

S = QWEN3_SHAPES["4b"]
H, INTER, Q, KV = (
    S["hidden_size"],
    S["intermediate_size"],
    S["num_attention_heads"] * 128,
    S["num_key_value_heads"] * 128,
)
# rank 16 on q k v o gate up down: A is 16 x in, B is out x 16
ADAPTER = 36 * 16 * ((H + Q) + 2 * (H + KV) + (Q + H) + 2 * (H + INTER) + (INTER + H))
LORA7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def up(config: Path, model: Path, total: float, *sets: str):
    args = ["up", "--config", str(config), "--dry-run", "--set", f"up.gpu_memory_gib={total}"]
    for s in (f"policy.model={model}", f"actor.engine.model={model}", *sets):
        args += ["--set", s]
    return CliRunner().invoke(app, args)


def plan_line(out: str) -> tuple[float, float]:
    m = re.search(r"all processes\s+([\d.]+) GiB, of ([\d.]+) usable", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_the_adapter_is_counted_from_the_shape():
    shape = model_shape("smol")  # any shape: the 4B one below is by hand
    assert shape.lora_params(4, ["q_proj"]) == 30 * 4 * (576 + 576)
    assert ADAPTER == 33_030_144  # "33.0 M parameters" (docs/benchmarks.md, the H200's LoRA run)


def test_lora_and_offload_hold_what_each_configuration_holds(tmp_path):
    model = stand_in(tmp_path)
    shape = model_shape(str(model))
    n = shape.params
    base = [f"policy.model={model}", f"actor.engine.model={model}", "learner.kl_coef=0.01"]

    def terms(*sets):
        return {
            t.what.split(":")[0]: t
            for t in learner_terms(load_config(CONFIGS / "gpu-1-4b.toml", [*base, *sets]), shape)
        }

    full = terms()
    assert full["weights + gradients + fp32 master + Adam m, v"].gib * GIB == pytest.approx(16 * n)
    assert full["frozen reference (policy.reference = local)"].gib * GIB == pytest.approx(2 * n)
    assert full["optimizer step temporaries"].gib * GIB == pytest.approx(6 * n)

    lora = terms("learner.lora.enabled=true", 'learner.compile="auto"', "actor.engine.max_lora_rank=16")
    assert lora["frozen base weights ([learner.lora]"].gib * GIB == pytest.approx(2 * n)
    assert lora["weights + gradients + fp32 master + Adam m, v"].gib * GIB == pytest.approx(16 * ADAPTER)
    assert not any(k.startswith("frozen reference") for k in lora)  # the base (adapters off) is the reference
    assert lora["cuda_ipc buffers"].gib * GIB == pytest.approx(2 * ADAPTER, rel=1e-3)  # the adapter alone travels
    assert "activations" in lora and "optimizer step temporaries" not in lora

    off = terms('learner.offload_optimizer="cpu"')
    assert off["trained weights"].gib * GIB == pytest.approx(2 * n) and not off["trained weights"].host
    host = [t for t in off.values() if t.host]
    assert len(host) == 1 and host[0].gib * GIB == pytest.approx(20 * n)  # 4 + 8 + 4 fp32, 2 x 2 B pinned
    assert off["offload transfer buffers"].gib * GIB == pytest.approx(2 * 2 * shape.largest)
    assert shape.largest == S["hidden_size"] * 151_936  # the embedding
    assert "optimizer step temporaries" not in off and "weights + gradients + fp32 master + Adam m, v" not in off


def test_gpu1_4b_on_an_h100_is_refused_with_changes_the_plan_accepts(tmp_path):
    model = stand_in(tmp_path)
    out = up(CONFIGS / "gpu-1-4b.toml", model, H100)
    assert out.exit_code == 2
    assert "113.36 GiB, more than the 75.24 GiB usable" in out.stderr
    fixes = re.findall(r"^  ((?:--set \S+ ?)+) +-> ([\d.]+) GiB of 75.24 usable", out.stderr, re.MULTILINE)
    named = [f[0].strip() for f in fixes]
    assert named[:2] == [
        '--set learner.offload_optimizer="cpu"',
        '--set learner.lora.enabled=true --set learner.compile="auto" --set actor.engine.max_lora_rank=16',
    ], out.stderr
    assert "GiB of host memory" in out.stderr.split(named[0])[1].splitlines()[0]  # what the offload costs the host
    for sets, need in fixes:  # each, given as printed, is accepted by the plan with the figure it named
        again = up(CONFIGS / "gpu-1-4b.toml", model, H100, *shlex.split(sets)[1::2])
        assert again.exit_code == 0, again.output
        assert plan_line(again.stdout) == (float(need), 75.24)
    # full fine-tuning's states on the GPU alone are 59.94 GiB: no knob of the actor's closes that gap
    assert float(dict((f[0].strip(), f[1]) for f in fixes)[named[0]]) < 50


def test_no_fitting_change_is_said_so_with_the_figures(tmp_path):
    out = up(CONFIGS / "gpu-1-4b.toml", stand_in(tmp_path), 24)
    assert out.exit_code == 2
    assert "no change of the learner's alone fits; planned:" in out.stderr
    assert '--set learner.offload_optimizer="cpu"  -> ' in out.stderr


@pytest.mark.parametrize("name", ["gpu-1-4b-offload.toml", "gpu-1-4b-lora.toml"])
@pytest.mark.parametrize("total", [H100, H200])
def test_the_80gb_configs_fit_an_h100_and_the_h200(tmp_path, name, total):
    out = up(CONFIGS / name, stand_in(tmp_path), total)
    assert out.exit_code == 0, out.output
    need, usable = plan_line(out.stdout)
    assert need <= usable and usable == pytest.approx(total * 0.95, abs=0.01)
    dumped = tomllib.loads(out.stdout)
    assert dumped["env"]["name"] == "random_words" and dumped["weights"]["kind"] == "cuda_ipc"
    cfg = load_config(CONFIGS / name)
    assert cfg.policy.model == cfg.actor.engine.model == "/tmp/m4b" and cfg.up.gpu_memory_gib == 0
    # every conversation in flight whole: 64 x 1,824 tokens x 144 KiB, so vLLM never preempts
    assert cfg.actor.engine.kv_cache_bytes == 64 * 1824 * 144 * 1024
    if name == "gpu-1-4b-offload.toml":
        assert cfg.learner.offload_optimizer == "cpu" and not cfg.learner.lora.enabled
        assert "host memory (not on the GPU)" in out.stdout
    else:
        assert cfg.learner.lora.enabled and cfg.learner.offload_optimizer == "none"
        assert cfg.actor.engine.max_lora_rank >= cfg.learner.lora.rank
        # no recompute: the activations of 4096 tokens fit beside the rest on either card
        assert 'chosen by this plan: learner.gradient_checkpointing = false (it was "auto")' in out.stdout


def test_offload_needs_a_zero_stage():
    with pytest.raises(ConfigError, match=r'offload_optimizer = "cpu" with zero_stage = 0.*set zero_stage = 2'):
        load_config(None, ['learner.offload_optimizer="cpu"', "learner.zero_stage=0"])
    with pytest.raises(ConfigError, match=r"offload_optimizer"):
        load_config(None, ['learner.offload_optimizer="gpu"'])


def test_auto_checkpointing_is_off_where_the_activations_fit_and_the_children_get_the_choice(tmp_path):
    model = stand_in(tmp_path)
    lora = CONFIGS / "gpu-1-4b-lora.toml"
    # compiled layers ("auto" here: LoRA without a KL term) keep 15.2 and 30.4 GiB at 4096 and 8192 tokens,
    # which fit beside the rest; 60.8 at 16384 do not
    for tokens, recompute in ((4096, False), (8192, False), (16384, True)):
        sets = ('learner.gradient_checkpointing="auto"', f"learner.micro_batch_tokens={tokens}")
        out = up(lora, model, H100, *sets)
        assert out.exit_code == 0, out.output
        flag = "true" if recompute else "false"
        assert f'chosen by this plan: learner.gradient_checkpointing = {flag} (it was "auto")' in out.stdout
        assert tomllib.loads(out.stdout)["learner"]["gradient_checkpointing"] is recompute  # what up's children read
        explicit = up(lora, model, H100, f"learner.gradient_checkpointing={flag}", sets[1])
        assert plan_line(explicit.stdout) == plan_line(out.stdout)
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        load_config(None, ['learner.gradient_checkpointing="sometimes"'])


def with_weights(name: str, out: Path, weights: str) -> Path:
    """deploy/configs/`name` with its [weights] section (the last) replaced by `weights`, written to `out`."""
    text = (CONFIGS / name).read_text()
    out.write_text(text[: text.index("\n[weights]\n")] + "\n[weights]\n" + weights)
    return out


def test_merged_lora_versions_plan_whole_weight_buffers_a_merge_and_a_plain_actor(tmp_path):
    """[learner.lora] serve = "merged": the learner's cuda_ipc buffer holds whole bf16 weights (not the
    adapter), the merge after the step is planned (one projection at a time, in the buffer or on its
    way to the host), and the actor's engine keeps no LoRA slots."""
    from parley.deploy.memory import merge_term, processes

    model = stand_in(tmp_path)
    shape = model_shape(str(model))
    n, proj = shape.params, sum(shape.adapted_tensors(LORA7))
    assert proj == 36 * (H * Q + 2 * H * KV + Q * H + 3 * H * INTER)  # every projection of every layer
    base = [f"policy.model={model}", f"actor.engine.model={model}", "learner.gradient_checkpointing=false"]
    merged = [*base, 'learner.lora.serve="merged"', "actor.engine.max_lora_rank=0"]

    objstore = with_weights("gpu-1-4b-lora.toml", tmp_path / "objstore.toml", 'kind = "objstore"\n')

    def terms(sets, config=CONFIGS / "gpu-1-4b-lora.toml"):
        cfg = load_config(config, sets)
        return cfg, {t.what.split(":")[0]: t for t in learner_terms(cfg, shape)}

    _, adapter = terms(base)
    cfg, whole = terms(merged)
    assert cfg.weights.max_buffers == 1
    assert adapter["cuda_ipc buffers"].gib * GIB == pytest.approx(2 * ADAPTER, rel=1e-3)
    assert whole["cuda_ipc buffers"].gib * GIB == pytest.approx(2 * n, rel=1e-3)  # whole weights travel
    assert "merged in" in whole["cuda_ipc buffers"].what
    # the merge after the step, one projection at a time, is far below the step's activations
    assert "activations" in whole and not any(k.startswith("merging") for k in whole)
    assert merge_term(cfg, shape).gib * GIB == pytest.approx(4 * H * INTER)  # in the buffer: one fp32 sum
    actor = next(p for p in processes(cfg) if p.name == "actor-0")
    assert not any("LoRA" in t.what for t in actor.terms)
    with_slots = next(p for p in processes(load_config(CONFIGS / "gpu-1-4b-lora.toml", base)) if p.name == "actor-0")
    assert any("LoRA slots" in t.what for t in with_slots.terms)
    cfg, files = terms(merged, objstore)
    assert merge_term(cfg, shape).gib * GIB == pytest.approx((4 + 2) * H * INTER)  # to the host: + its bf16 copy
    assert "cuda_ipc buffers" not in files and "activations" in files

    out = up(CONFIGS / "gpu-1-4b-lora.toml", model, H100, *merged[3:])
    assert out.exit_code == 0, out.output
    assert "its LoRA slots" not in out.stdout and 'the adapter merged in: learner.lora.serve = "merged"' in out.stdout


def test_where_only_whole_weights_travel_the_lora_change_merges_the_adapter(tmp_path):
    """Packed deltas and nccl carry no adapter: the plan's LoRA change for a run that does not fit is
    the adapter merged into whole weights (no LoRA slots asked of the actor), planned like the others."""
    from parley.deploy.memory import _learner_changes, fixes, processes

    model = stand_in(tmp_path)
    for weights in (
        'kind = "objstore"\nfull_every = 4\ndelta_format = "packed"\n',
        'kind = "nccl"\naddress = "127.0.0.1:29600"\n',
    ):
        config = with_weights("gpu-1-4b.toml", tmp_path / "w.toml", weights)
        cfg = load_config(config, [f"policy.model={model}", f"actor.engine.model={model}"])
        merged = (("learner.lora.enabled", True), ("learner.compile", "auto"), ("learner.lora.serve", "merged"))
        assert merged in _learner_changes(cfg)
        assert not any(k == "actor.engine.max_lora_rank" for c in _learner_changes(cfg) for k, _ in c)
        planned = {f.changes: f.need for f in fixes(cfg, H100)}
        full = sum(p.gib for p in processes(cfg))  # what full fine-tuning needs (no engine takes a share here)
        assert 0 < planned[merged] < full - 40  # full fine-tuning's states gone, whole-weight buffers kept
    cfg = load_config(CONFIGS / "gpu-1-4b.toml", [f"policy.model={model}", f"actor.engine.model={model}"])
    assert not any(("learner.lora.serve", "merged") in c for c in _learner_changes(cfg))  # cuda_ipc carries adapters


def test_bf16_master_weights_halve_full_fine_tuning_and_fit_the_4b_shape_on_an_h100(tmp_path):
    """learner.master_dtype = "bfloat16": weights, gradients, the master copy and Adam's m and v at 2 + 2 + 2 + 4
    B a parameter (fp32's 16), and the step's temporaries the flat gradient alone (.to(bf16) copies nothing):
    gpu-1-4b.toml then fits an 80 GB H100 with 11 GiB of KV instead of 12. Its refusal's offload change
    takes the master back to fp32 (the host's step keeps fp32 state), as printed and accepted."""
    model = stand_in(tmp_path)
    shape = model_shape(str(model))
    n = shape.params
    sets = [f"policy.model={model}", f"actor.engine.model={model}", 'learner.master_dtype="bfloat16"']
    terms = {t.what.split(":")[0]: t for t in learner_terms(load_config(CONFIGS / "gpu-1-4b.toml", sets), shape)}
    states = 'weights + gradients + bf16 master + Adam m, v in bf16 (learner.master_dtype = "bfloat16")'
    assert terms[states].gib * GIB == pytest.approx(10 * n)
    assert terms["optimizer step temporaries"].gib * GIB == pytest.approx(2 * n)
    assert "weights + gradients + fp32 master + Adam m, v" not in terms

    out = up(CONFIGS / "gpu-1-4b.toml", model, H100, 'learner.master_dtype="bfloat16"')
    assert out.exit_code == 2 and "75.89 GiB, more than the 75.24 GiB usable" in out.stderr
    offload = '--set learner.offload_optimizer="cpu" --set learner.master_dtype="float32"'
    assert offload in out.stderr
    again = up(CONFIGS / "gpu-1-4b.toml", model, H100, *shlex.split(offload)[1::2])
    assert again.exit_code == 0, again.output

    fits = up(
        CONFIGS / "gpu-1-4b.toml",
        model,
        H100,
        'learner.master_dtype="bfloat16"',
        "actor.engine.kv_cache_bytes=11811160064",
    )
    assert fits.exit_code == 0, fits.output
    need, usable = plan_line(fits.stdout)
    assert need == pytest.approx(74.87, abs=0.01) and usable == 75.24


def test_a_full_fine_tuning_run_that_does_not_fit_is_offered_bf16_master_weights_where_they_fit(tmp_path):
    out = up(CONFIGS / "gpu-1-4b.toml", stand_in(tmp_path), 82.0)
    assert out.exit_code == 2
    fixes = re.findall(r"^  ((?:--set \S+ ?)+) +-> ([\d.]+) GiB of ([\d.]+) usable", out.stderr, re.MULTILINE)
    master = [f for f in fixes if 'learner.master_dtype="bfloat16"' in f[0]]
    assert master and float(master[0][1]) <= float(master[0][2]), out.stderr
