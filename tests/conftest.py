"""Fixtures chained as in nats.py's own tests: store dir -> real nats-server on a free port -> client -> JetStream."""

from __future__ import annotations

import pytest

from deploy.natsserver import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats", port=0)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def nc(nats_server):
    from protocol.connect import connect

    client = await connect(nats_server.url, name="pytest")
    yield client
    if not client.is_closed:
        await client.close()


@pytest.fixture
async def js(nc):
    return nc.jetstream()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The toy Qwen3 + BPE tokenizer + ChatML template (seconds to build), shared by the session."""
    from engines.models import build_tiny

    return build_tiny(tmp_path_factory.mktemp("models") / "tiny")


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests run only where torch sees a CUDA device (docs/gpu.md says how to run them)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in gpu:
        item.add_marker(skip)
