"""Every file of a published weight version is checked whole on load (issue 57): config.json (and an
adapter's adapter_config.json) changed after publication is refused with a clear error, on both file
transports, as model.safetensors always was; and the LoRA base identity covers every byte of every
shard, not its first MiB. Real nats-server (tests/conftest.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from parley.protocol import topology
from parley.protocol.messages import LoraAdapter, WeightVersion
from parley.weights import lora
from parley.weights.common import CONFIG_FILE, WeightVerifyError
from parley.weights.config import ObjstoreWeights, SharedDirWeights
from parley.weights.objstore import _put_object
from parley.weights.registry import fetch_version, publish_version
from tests.integration.test_weights import write_state

pytestmark = pytest.mark.integration
RUN = "sums"


async def test_objstore_refuses_a_config_json_changed_in_the_store(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    wv = await publish_version(
        js, RUN, 1, step=1, state_dir=write_state(tmp_path / "s", 1, mib=1), settings=ObjstoreWeights()
    )
    assert len(wv.file_sha256) == len(wv.files) == 1
    await fetch_version(js, RUN, wv, tmp_path / "ok")  # as published: loads

    # someone with write access to the store replaces config.json (a consistent object: its own digest)
    (obj,) = wv.files
    await _put_object(js, RUN, obj, json.dumps({"model_type": "qwen3", "num_hidden_layers": 1}).encode())
    with pytest.raises(WeightVerifyError, match=r"config.json .*announced .*refused"):
        await fetch_version(js, RUN, wv, tmp_path / "tampered")
    assert not (tmp_path / "tampered" / CONFIG_FILE).exists()

    # an announcement whose files carry no checksum is refused before anything is fetched
    bare = msgspec.structs.replace(wv, file_sha256=[])
    with pytest.raises(WeightVerifyError, match="0 checksums announced"):
        await fetch_version(js, RUN, bare, tmp_path / "bare")


async def test_shared_dir_refuses_a_config_json_changed_on_disk(js, tmp_path):
    await topology.ensure_topology(js, RUN)
    settings = SharedDirWeights(dir=str(tmp_path / "shared"))
    wv = await publish_version(js, RUN, 1, step=1, state_dir=write_state(tmp_path / "s", 1, mib=1), settings=settings)
    where = await fetch_version(js, RUN, wv, tmp_path / "ok", settings=settings)
    (where / CONFIG_FILE).write_text(json.dumps({"model_type": "qwen3", "seed": 99}))
    with pytest.raises(WeightVerifyError, match=r"config.json .*refused"):
        await fetch_version(js, RUN, wv, tmp_path / "again", settings=settings)


def test_base_identity_covers_every_byte_of_every_shard(tmp_path, monkeypatch):
    import numpy as np
    from safetensors.numpy import save_file

    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    shard = base / "model.safetensors"
    save_file({"w": np.zeros(768 * 1024, dtype=np.float32)}, str(shard))  # 3 MiB
    before = lora.base_identity(base)
    assert lora.base_identity(base) == before  # cached: the same answer without a second read

    data = bytearray(shard.read_bytes())
    data[2 * 1024 * 1024] ^= 0xFF  # one byte changed past the first MiB, size the same
    shard.write_bytes(bytes(data))
    after = lora.base_identity(base)
    assert after != before
    # an adapter trained on the original base is refused by an actor holding this one, with the reason
    wv = WeightVersion(
        version=1,
        step=1,
        transport="objstore",
        location="v000001/model.safetensors",
        sha256="0" * 64,
        bytes=1,
        created=0.0,
        adapter=LoraAdapter(base=before, rank=8),
    )
    assert "is for base" in lora.adapter_problem(wv, after, max_rank=64)
