"""Weights by version against a real nats-server: object store and shared-dir transports, the KV
announcement, verification failures and pruning."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from protocol import topology
from protocol.weights import (
    CONFIG_FILE,
    MODEL_FILE,
    WeightVerifyError,
    chunk_size,
    current_version,
    fetch_version,
    publish_version,
)

pytestmark = pytest.mark.integration
RUN = "wtest"


def write_state(d, seed: int, mib: float = 9.0):
    """A safetensors file of ~`mib` MiB (several object-store chunks) plus config.json."""
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = int(mib * 1024 * 1024 / 4)
    save_file({"model.embed_tokens.weight": rng.standard_normal(n, dtype=np.float32)}, str(d / MODEL_FILE))
    (d / CONFIG_FILE).write_text(json.dumps({"model_type": "qwen3", "seed": seed}))
    return d


async def test_objstore_round_trip_announce_and_prune(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    assert await current_version(js, RUN) is None
    assert chunk_size(js) == 4 * 1024 * 1024  # the test server raises max_payload to 8 MiB

    published = []
    for v in range(5):
        state = write_state(tmp_path / f"state{v}", seed=v)
        wv = await publish_version(js, RUN, v, step=v, state_dir=state, transport="objstore", keep=3)
        published.append(wv)
        assert (await current_version(js, RUN)) == wv

    got = await fetch_version(js, RUN, published[-1], tmp_path / "actor" / "v4", rehash=True)
    assert (got / MODEL_FILE).read_bytes() == (tmp_path / "state4" / MODEL_FILE).read_bytes()
    assert json.loads((got / CONFIG_FILE).read_text()) == {"model_type": "qwen3", "seed": 4}
    assert not list(got.glob("*.part"))

    # versions 0 and 1 are beyond keep=3 and were deleted
    with pytest.raises(WeightVerifyError, match="not in the store"):
        await fetch_version(js, RUN, published[0], tmp_path / "actor" / "v0")
    await fetch_version(js, RUN, published[2], tmp_path / "actor" / "v2")

    # an announcement that does not match the blob is refused, and nothing is left behind
    forged = msgspec.structs.replace(published[3], sha256="0" * 64)
    with pytest.raises(WeightVerifyError, match="announced 0000"):
        await fetch_version(js, RUN, forged, tmp_path / "actor" / "forged")
    assert not (tmp_path / "actor" / "forged" / MODEL_FILE).exists()
    short = msgspec.structs.replace(published[3], bytes=published[3].bytes - 1)
    with pytest.raises(WeightVerifyError):
        await fetch_version(js, RUN, short, tmp_path / "actor" / "short")


async def test_republishing_a_lower_version_moves_the_key_back(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    await publish_version(js, RUN, 3, step=3, state_dir=write_state(tmp_path / "a", 1, 0.1), transport="objstore")
    again = await publish_version(js, RUN, 2, step=2, state_dir=write_state(tmp_path / "b", 2, 0.1), transport="objstore")
    assert (await current_version(js, RUN)) == again


async def test_shared_dir_transport_verifies_in_place(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    shared = tmp_path / "shared"
    for v in range(3):
        wv = await publish_version(
            js, RUN, v, step=v, state_dir=write_state(tmp_path / f"s{v}", v, 0.5), transport="shared_dir",
            shared_dir=shared, keep=2,
        )
    assert sorted(p.name for p in (shared / RUN).iterdir()) == ["v000001", "v000002"]
    got = await fetch_version(js, RUN, wv, tmp_path / "unused")
    assert got == shared / RUN / "v000002"
    (got / MODEL_FILE).write_bytes(b"corrupt")
    with pytest.raises(WeightVerifyError, match="has sha256"):
        await fetch_version(js, RUN, wv, tmp_path / "unused")


async def test_learner_publication_waits_out_a_nats_outage(nats_server, tmp_path):
    """The learner's publish retries while nats-server is down and completes once it is back."""
    import asyncio

    from protocol.bus import retry_unreachable
    from protocol.connect import connect

    nc = await connect(nats_server.url, name="outage")
    js = nc.jetstream()
    try:
        await topology.ensure_topology(js, RUN)
        state = write_state(tmp_path / "v1", seed=1, mib=1.0)
        nats_server.stop()

        async def restart_later():
            await asyncio.sleep(3.0)
            await asyncio.to_thread(nats_server.start)  # same store dir, same port

        restart = asyncio.create_task(restart_later())
        wv = await retry_unreachable(lambda: publish_version(js, RUN, 1, 1, state, "objstore"), what="publish v1",
                             give_up_s=120.0, first_delay_s=0.5)
        await restart
        assert wv.version == 1
        assert (await current_version(js, RUN)).sha256 == wv.sha256
    finally:
        await nc.close()
