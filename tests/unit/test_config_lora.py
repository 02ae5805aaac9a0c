"""[learner.lora] is checked at start against what the actors and the transport can do."""

from __future__ import annotations

import pytest

from config.run import ConfigError, check_training, load_config


def test_lora_needs_actors_that_load_adapters_of_its_rank():
    with pytest.raises(ConfigError, match="max_lora_rank = 8"):
        check_training(load_config(None, ["learner.lora.enabled=true", "learner.lora.rank=8"]))
    check_training(load_config(None, ["learner.lora.enabled=true", "learner.lora.rank=8", "actor.engine.max_lora_rank=8"]))


def test_lora_refuses_compiled_layers_with_the_reason():
    with pytest.raises(Exception, match="compile"):
        load_config(None, ["learner.lora.enabled=true", "learner.compile=layers"])


def test_lora_is_off_by_default():
    assert not load_config().learner.lora.enabled
