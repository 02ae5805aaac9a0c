"""[learner.lora] is checked at start against what the actors and the transport can do."""

from __future__ import annotations

import pytest

from parley.config.run import ConfigError, check_training, load_config


def test_lora_needs_actors_that_load_adapters_of_its_rank():
    with pytest.raises(ConfigError, match="max_lora_rank = 8"):
        check_training(load_config(None, ["learner.lora.enabled=true", "learner.lora.rank=8"]))
    check_training(
        load_config(None, ["learner.lora.enabled=true", "learner.lora.rank=8", "actor.engine.max_lora_rank=8"])
    )


def test_lora_refuses_compiled_layers_beside_a_kl_reference_with_the_reason():
    with pytest.raises(Exception, match="kl_coef = 0.01: the KL reference flips the adapters"):
        load_config(None, ["learner.lora.enabled=true", "learner.compile=layers", "learner.kl_coef=0.01"])
    # no KL term: nothing flips the adapters, compiled layers are allowed
    cfg = load_config(None, ["learner.lora.enabled=true", "learner.compile=layers", "learner.kl_coef=0"])
    assert cfg.learner.compile == "layers"


def test_lora_is_off_by_default():
    assert not load_config().learner.lora.enabled


def test_lora_travels_by_the_file_transports_or_cuda_ipc_and_refuses_nccl():
    lora = ["learner.lora.enabled=true", "learner.lora.rank=8", "actor.engine.max_lora_rank=8"]
    for kind in (
        ['weights.kind="objstore"'],
        ['weights.kind="cuda_ipc"'],
        ['weights.kind="shared_dir"', 'weights.dir="/tmp/w"'],
    ):
        check_training(load_config(None, [*lora, *kind]))
    with pytest.raises(ConfigError, match="kind='nccl'.*cuda_ipc"):
        check_training(load_config(None, [*lora, 'weights.kind="nccl"', 'weights.address="10.0.0.1:29600"']))


def test_lora_refuses_packed_deltas_with_the_fix():
    lora = ["learner.lora.enabled=true", "learner.lora.rank=8", "actor.engine.max_lora_rank=8"]
    with pytest.raises(ConfigError, match='delta_format = "file"'):
        check_training(load_config(None, [*lora, 'weights.kind="objstore"', 'weights.delta_format="packed"']))
    # whole weights: fine
    check_training(load_config(None, ['weights.kind="objstore"', 'weights.delta_format="packed"']))


def test_an_unknown_delta_format_names_the_two_there_are():
    with pytest.raises(Exception, match="'file'.*'packed'"):
        load_config(None, ['weights.kind="objstore"', 'weights.delta_format="zstd"'])


def test_merged_versions_need_a_plain_actor_engine_and_travel_by_any_full_weight_path():
    merged = ["learner.lora.enabled=true", "learner.lora.rank=8", 'learner.lora.serve="merged"']
    assert load_config(None, merged).learner.lora.merged
    assert load_config().learner.lora.serve == "adapter"
    with pytest.raises(ConfigError, match='serve = "merged" with actor.engine.max_lora_rank=8.*max_lora_rank = 0'):
        check_training(load_config(None, [*merged, "actor.engine.max_lora_rank=8"]))
    # whole weights: nccl and packed deltas, refused for adapters, carry them
    for kind in (
        ['weights.kind="objstore"', "weights.full_every=4"],
        ['weights.kind="objstore"', "weights.full_every=4", 'weights.delta_format="packed"'],
        ['weights.kind="cuda_ipc"'],
        ['weights.kind="nccl"', 'weights.address="10.0.0.1:29600"'],
        ['weights.kind="shared_dir"', 'weights.dir="/tmp/w"'],
    ):
        check_training(load_config(None, [*merged, *kind]))
    with pytest.raises(Exception, match="serve"):
        load_config(None, [*merged[:2], 'learner.lora.serve="both"'])
