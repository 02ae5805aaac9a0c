"""[learner.lora] serve = "merged": the learner's merged weights (learner.lora.merged_tensors) are
what peft's merge_and_unload leaves (learner.lora.export_merged, the offline export, is the
reference: not our formula), the trained module is left as it was, and a target peft does not adapt
as a Linear layer is refused at start. The toy model, on the CPU."""

from __future__ import annotations

import pytest
import torch


def _adapted(model_dir, settings, seed: int = 3):
    """The toy model with an adapter whose B is random (a fresh adapter's B is zero: merged = base)."""
    from transformers import AutoModelForCausalLM

    from parley.learner.lora import add_adapters

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = add_adapters(model, settings)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model, peft


def test_merged_tensors_are_what_peft_merge_and_unload_leaves(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from parley.config.learner import LoraSettings
    from parley.learner.lora import adapter_state, export_merged, merged_tensors
    from parley.weights import lora

    settings = LoraSettings(enabled=True, rank=8, alpha=16.0, serve="merged")
    model, peft = _adapted(tiny_model, settings)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    ours = dict(merged_tensors(model))
    adir = lora.write_adapter(*adapter_state(peft), tmp_path / "v1")
    export_merged(tiny_model, adir, tmp_path / "merged")
    theirs = load_file(tmp_path / "merged" / "model.safetensors")

    assert sorted(ours) == sorted(theirs)  # the base checkpoint's names, no adapter tensor
    base = load_file(tiny_model / "model.safetensors")
    changed = [n for n in theirs if not torch.equal(theirs[n], base[n])]
    assert len(changed) == 7 * model.config.num_hidden_layers  # every projection of every layer moved
    for n, t in theirs.items():
        assert torch.equal(ours[n], t), n  # the same fp32 sums, in the same order
    # the trained module is untouched: still the base beside its adapter, nothing merged into it
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_merged_refuses_a_target_that_is_no_linear_layer(tiny_model):
    from parley.config.learner import LoraSettings

    settings = LoraSettings(enabled=True, rank=4, target_modules=["q_proj", "embed_tokens"], serve="merged")
    with pytest.raises(ValueError, match='serve = "merged".*Embedding.*target Linear layers only'):
        _adapted(tiny_model, settings)
    _adapted(tiny_model, LoraSettings(enabled=True, rank=4, target_modules=["q_proj", "embed_tokens"]))


def test_merged_into_a_packed_buffer_is_merged_tensors_bit_for_bit(tiny_model):
    """The GPU paths (cuda_ipc, nccl, packed deltas) copy the base's tensors into their buffer and merge
    each adapter into its projection's copy there (learner.lora.merge_into, the buffers' `finish`):
    the buffer holds what merged_tensors gives, its checksums are of the merged bytes, and the trained
    module is untouched. On the CPU (the buffers are allocated where the tensors are)."""
    from parley.config.learner import LoraSettings
    from parley.learner.lora import merge_into, merged_tensors
    from parley.weights.cuda_ipc import IpcPublisher, checksums, views
    from parley.weights.gpu_delta import PackedVersions

    model, _ = _adapted(tiny_model, LoraSettings(enabled=True, rank=8, alpha=16.0, serve="merged"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = dict(merged_tensors(model))

    pub = IpcPublisher(hold_s=0.0, max_buffers=1)
    named, finish = merge_into(model)
    buf, table = pub.fill(named, 1, finish)
    packed = PackedVersions()
    named, finish = merge_into(model)
    table2, pending = packed.pack(named, 1, None, finish=finish)
    for layout, data in ((pub.layout, buf), (packed.layout, packed.buffers[packed.last])):
        got = dict(zip([e.name for e in layout], views(data, layout)))
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[n], t) for n, t in expected.items())
    assert [e.checksum for e in table] == checksums(buf, pub.layout)  # summed after the merge
    pending.discard()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
