"""[learner.lora] serve = "merged" through the run's ordinary full-weight path, against a real
nats-server: the learner (a real Trainer on the toy model, one GRPO step of a LoRA adapter) publishes
each version as whole weights with the adapter merged in (weights.payloads.Delta or PackedDelta over
the object store), an actor's WeightFollower fetches them (v2 rebuilt from its file delta against v1,
or its full file where the delta is packed), and the
weights it loads compute the log-probs the learner computes with the adapter, and that the adapter
itself gives when served on the base (peft from the adapter's files, what the "adapter" path
serves). The engine is a double that loads the fetched checkpoint with transformers (vLLM serving a
merged version: tests/e2e/test_lora.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parley.protocol import topology

pytestmark = pytest.mark.integration
RUN = "mergedtest"
TOL = 1e-4  # fp32 on the CPU: the merged product against the adapter's two matmuls


class TransformersEngineDouble:
    """Stands in for the actor's vLLM engine: each reload loads the fetched checkpoint with transformers."""

    def __init__(self) -> None:
        self.version, self.model, self.loads = 0, None, []

    async def reload_weights(self, path, version):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()
        self.version = version
        self.loads.append(version)


def _logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    from parley.learner.logprobs import token_logprobs
    from parley.learner.packing import Sample, build_batch

    n = len(ids)
    sample = Sample("fixed", ids, [0] * start + [1] * (n - start), [0.0] * n, 0.0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, build_batch([sample]), grad=False)
    return lp.double()


@pytest.mark.parametrize("delta_format", ["file", "packed"])
async def test_merged_versions_are_served_as_whole_weights_with_the_adapters_log_probs(
    js, tiny_model, tmp_path, delta_format
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from parley.config.learner import LearnerConfig, LoraSettings
    from parley.learner.lora import base_only
    from parley.learner.service import weights_publication
    from parley.learner.trainer import Trainer
    from parley.weights import lora, payloads
    from parley.weights.common import current_version
    from parley.weights.config import ObjstoreWeights
    from parley.weights.follow import WeightFollower
    from parley.weights.publish import Publisher
    from tests.e2e.ranks_step import step_samples

    await topology.ensure_topology(js, RUN)
    lc = LearnerConfig(
        zero_stage=2,
        lr=2e-2,
        kl_coef=0.0,
        micro_batch_tokens=256,
        dtype="float32",
        lora=LoraSettings(enabled=True, rank=8, alpha=16.0, serve="merged"),
    )
    # v1 full, v2 also as a delta against v1: a file delta from the written files, or a packed one from
    # the learner's packed buffers (the adapters merged into them: learner.lora.merge_into)
    settings = ObjstoreWeights(full_every=4, delta_format=delta_format)
    trainer = Trainer(lc, tiny_model, weights=settings)
    try:
        publisher = Publisher()
        feeder = SimpleNamespace(set_version=lambda v: None)
        # learner.service builds it so: no adapter base with serve = "merged"
        w = weights_publication(lc, settings, js, None, RUN, tmp_path / "run", trainer, publisher, feeder)
        assert type(w.payload) is (payloads.Delta if delta_format == "file" else payloads.PackedDelta)
        engine = TransformersEngineDouble()
        follower = WeightFollower(js, RUN, engine, dest_root=tmp_path / "actor", settings=settings)
        ids = list(range(10, 60))
        for version in (1, 2):
            trainer.train_step(step_samples())
            assert await w.publish(version)
            await publisher.drain()
            assert await follower.check(), follower.refused
            assert engine.version == version and engine.loads[-1] == version
            wv = await current_version(js, RUN)
            assert (wv.version, wv.sha256) == follower.serving
            assert wv.adapter is None  # whole weights, loaded as full fine-tuning's are
            if delta_format == "file":
                assert (wv.delta is not None) == (version == 2)
                if wv.delta is not None:
                    print(f"v{version}: its file delta is {wv.delta.bytes / wv.bytes:.0%} of the version")
            else:  # a rank-r update changes every element of every adapted projection: its packed delta
                # (every changed element) is past delta_max_share and the version goes full only
                assert wv.delta is None

            ours = _logprobs(trainer.module, ids, 10)  # the learner's policy: base + adapter
            with base_only(trainer.peft):
                base = _logprobs(trainer.module, ids, 10)
            served = _logprobs(engine.model, ids, 10)
            adir = lora.write_adapter(*trainer.adapter_snapshot(), tmp_path / f"adapter{version}")
            plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
            PeftModel.from_pretrained(plain, str(lora.as_vllm_adapter(adir)))  # injected into `plain` in place
            as_adapter = _logprobs(plain.eval(), ids, 10)
            moved = (ours - base).abs().max().item()
            print(
                f"v{version}: merged vs learner {(served - ours).abs().max():.2e}, vs the adapter served "
                f"{(served - as_adapter).abs().max():.2e}; adapter vs base {moved:.2e}"
            )
            assert moved > 100 * TOL  # the adapter changed the policy, so agreeing means merging it
            assert (served - ours).abs().max() < TOL
            assert (served - as_adapter).abs().max() < TOL
            # what the actor loads is exactly the learner's merged weights (no adapter name in it)
            fetched = AutoModelForCausalLM.from_pretrained(follower.served_dir, dtype=torch.float32).state_dict()
            assert not any("lora" in n or "base_layer" in n for n in fetched)
    finally:
        trainer.close()
