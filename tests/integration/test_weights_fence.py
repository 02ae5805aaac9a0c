"""The weights keys' fence (weights.common.announce / announce_early) on a real nats-server: each learner
writes on the revision of its own last write, so a learner that lost the run (paused past the lease's
TTL while another learner resumed the run and announced) fails with VersionConflict and the key keeps
the other learner's version. A learner's first announcement still takes a fresh key, a resumed run's
older version and junk."""

from __future__ import annotations

import time

import pytest

from parley.protocol import codec, topology
from parley.protocol.connect import connect
from parley.protocol.messages import WeightVersion
from parley.weights.common import VersionConflict, announce, announce_early, current_version, forget_writes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BUS = topology.BusSettings(max_bytes=4 * 1024**2)


def wv(version: int, **kw) -> WeightVersion:
    return WeightVersion(
        version=version,
        step=version,
        transport="objstore",
        location=f"v{version}",
        sha256="0" * 64,
        bytes=1,
        created=time.time(),
        **kw,
    )


async def early_version(js, run: str) -> int:
    kv = await js.key_value(topology.kv_bucket(run))
    return codec.decode("weights", (await kv.get(topology.WEIGHTS_EARLY_KEY)).value).version


@pytest.mark.parametrize("early", [False, True], ids=["weights-key", "early-key"])
async def test_a_stale_learner_cannot_move_the_weights_key_back(js, nats_server, early):
    run = "fenced"
    await topology.ensure_topology(js, run, BUS)
    write = announce_early if early else announce
    read = early_version if early else (lambda js, run: _version(js, run))
    other = await connect(nats_server.url, name="learner-b")  # learner B: its own connection
    try:
        js_b = other.jetstream()
        forget_writes(js, run)
        for v in (1, 2, 3):  # learner A announces up to v3
            await write(js, run, wv(v, full_pending=early))
        forget_writes(js_b, run)  # B took the run (A paused past the TTL) and resumes from v1
        await write(js_b, run, wv(1, full_pending=early))
        with pytest.raises(VersionConflict, match="written by another learner") as refused:
            await write(js, run, wv(4, full_pending=early))  # A wakes: refused
        # one line that says what the key holds now and what the operator does about it
        said = str(refused.value)
        assert "it now announces version 1" in said and "--resume" in said and "revision" in said, said
        assert await read(js, run) == 1
        await write(js_b, run, wv(2, full_pending=early))  # B goes on
        assert await read(js, run) == 2
    finally:
        await other.close()


async def _version(js, run: str) -> int:
    return (await current_version(js, run)).version


async def test_a_first_announcement_takes_an_older_version_or_junk(js):
    run = "restarted"
    await topology.ensure_topology(js, run, BUS)
    kv = await js.key_value(topology.kv_bucket(run))
    await kv.put(topology.WEIGHTS_KEY, b"junk")
    forget_writes(js, run)
    await announce(js, run, wv(7))  # junk replaced
    forget_writes(js, run)  # a --resume of the same run: the key holds its last version
    await announce(js, run, wv(5))
    await announce(js, run, wv(6))
    assert await _version(js, run) == 6
