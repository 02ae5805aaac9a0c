"""config.learner.compile_mode: what [learner] compile means for a given learner. "auto" compiles LoRA
layers where nothing flips their adapters (no KL term), and stays off where the KL reference would
flip them per forward (a recompile at every flip)."""

from __future__ import annotations

import pytest

from parley.config.learner import compile_mode
from parley.config.run import load_config


@pytest.mark.parametrize(
    "sets, mode",
    [
        ([], "auto"),  # full fine-tuning: compile_layers decides by device and ZeRO stage
        (["learner.lora.enabled=true", "learner.kl_coef=0"], "auto"),  # LoRA, nothing flips the adapters
        (["learner.lora.enabled=true", "learner.kl_coef=0.001"], "off"),  # the KL reference flips them
        (["learner.lora.enabled=true", 'learner.compile="off"'], "off"),
        (["learner.lora.enabled=true", "learner.kl_coef=0", 'learner.compile="layers"'], "layers"),
    ],
)
def test_auto_compiles_lora_layers_only_without_a_kl_term(sets, mode):
    assert compile_mode(load_config(None, sets).learner) == mode
