"""The weights object store's derived limit (deploy.common.topology_bus) holds what a run keeps."""

from __future__ import annotations

from parley.config.run import load_config
from parley.deploy.common import topology_bus
from parley.deploy.memory import model_shape


def test_default_run_object_store_holds_the_kept_fp32_versions():
    cfg = load_config(None, [])
    bus = topology_bus(cfg)
    one = 4 * model_shape(cfg.policy.model).params  # the CPU learner publishes fp32 ("auto")
    assert bus.blobs_max_bytes >= (cfg.learner.keep_versions + 1) * one
    assert bus.blobs_max_bytes < 4 * 1024**3  # sized from the model, not a blanket figure


def test_explicit_blobs_max_bytes_is_kept():
    cfg = load_config(None, ["bus.blobs_max_bytes=123456789"])
    assert topology_bus(cfg).blobs_max_bytes == 123456789


def test_a_run_whose_versions_travel_another_way_reserves_no_model_sized_store():
    # JetStream reserves max_bytes at creation: the 4B shape's kept versions (~41 GB) would be refused
    # on the lent GPU machine's 64 GB disk although cuda_ipc stores nothing in the object store
    cfg = load_config(None, ['policy.model="Qwen/Qwen3-4B"', 'weights.kind="cuda_ipc"'])
    assert topology_bus(cfg).blobs_max_bytes == 8 * 1024**2  # topology.UNUSED_BLOBS_MAX_BYTES
    stored = load_config(None, ['policy.model="Qwen/Qwen3-4B"', 'weights.kind="objstore"'])
    assert topology_bus(stored).blobs_max_bytes > 16 * 1024**3
