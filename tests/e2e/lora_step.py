"""Run by tests/e2e/test_lora.py, one process per combination: two GRPO steps of a rank-4 LoRA
adapter on the toy model under one ZeRO stage, with or without gradient checkpointing, and what
they changed. Each combination gets its own process, so that no DeepSpeed or transformers state of
one (the ZeRO-3 loading hook until Trainer.close, the gloo group) reaches the next. Prints one JSON
line. Not a test module itself."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(model_dir: str, zero: int, checkpointing: bool) -> None:
    import deepspeed
    import torch

    from parley.config.learner import LearnerConfig, LoraSettings
    from parley.learner.packing import Sample
    from parley.learner.trainer import Trainer
    from tests.e2e.ranks_step import step_samples

    cfg = LearnerConfig(
        zero_stage=zero,
        lr=1e-2,
        kl_coef=0.01,
        micro_batch_tokens=64,
        logit_chunk_tokens=8,
        dtype="float32",
        gradient_checkpointing=checkpointing,
        lora=LoraSettings(enabled=True, rank=4),
    )
    trainer = Trainer(cfg, model_dir)

    from parley.learner.lora import adapter_params, adapter_state

    def gathered():  # every parameter whole (ZeRO-3 partitions them)
        params = list(trainer.module.parameters())
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero == 3 else contextlib.nullcontext()

    def weights() -> dict:
        with gathered():
            return {n: p.detach().clone() for n, p in trainer.module.named_parameters()}

    samples: list[Sample] = step_samples()
    before = weights()
    with gathered():  # found once before training, as Trainer.pack_adapter does at its first version
        cached = adapter_params(trainer.peft)
    first = trainer.train_step(samples)
    second = trainer.train_step(samples)
    after = weights()
    with gathered():  # after two steps the cached parameters still hold what peft would save
        state, _ = adapter_state(trainer.peft, device=None)
        cached_matches = (
            cached is not None
            and [n for n, _ in cached] == sorted(state)
            and all(torch.equal(p.detach(), state[n]) for n, p in cached)
        )
        # under ZeRO-1/2 the adapter lies end to end in DeepSpeed's flat buffer: a cuda_ipc fill is one copy
        from parley.weights.cuda_ipc import one_run

        end_to_end = cached is not None and one_run([(n, p.detach()) for n, p in cached]) is not None
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    adapter = sorted(n for n in before if "lora_" in n)
    # serve = "merged": the learner's whole weights (every rank in the gather; rank 0 merges) are
    # what peft's merge_and_unload of the same adapter leaves (learner.lora.export_merged)
    import tempfile

    from safetensors.torch import load_file

    from parley.learner.lora import export_merged
    from parley.weights import lora

    merged = trainer.hf_state_dict()
    snapshot = trainer.adapter_snapshot()
    trainer.close()  # no ZeRO-3 loading hook left: export_merged's from_pretrained loads a plain model
    with tempfile.TemporaryDirectory() as tmp:
        adir = lora.write_adapter(*snapshot, Path(tmp) / "adapter")
        export_merged(model_dir, adir, Path(tmp) / "merged")
        peft_merged = load_file(Path(tmp) / "merged" / "model.safetensors")
    merged_matches = sorted(merged) == sorted(peft_merged) and all(
        torch.equal(merged[n], t) for n, t in peft_merged.items()
    )
    print(
        json.dumps(
            {
                "loss": first["loss"],
                "grad_norm": first["grad_norm"],
                "kl_first": first["kl_mean"],
                "kl_second": second["kl_mean"],
                "loss_second": second["loss"],
                "changed": changed,
                "adapter": adapter,
                "cached_matches": cached_matches,
                "merged_matches": merged_matches,
                "end_to_end": end_to_end,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
