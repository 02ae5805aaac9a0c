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
