"""`make faults`: a learner killed during a weights upload, and power losses, at named kill points
(runtime.killpoints), each life resumed with `--resume`, the books checked at the end as in
tests/faults/test_kill_points.py (same run, same checks).

A power loss is simulated after every kill: each life records every fsync of a regular file (path,
size) and every rename (tests.faults.lives.journal_durability), and before the next life every file
of the run directory is cut to what its last fsync made durable (a rename carries it to the new
name; a file never fsynced is cut to nothing). Not simulated: directory entries (a rename or a new
file whose directory was not fsynced is kept), and nats-server's own store (it is not cut).

Under `parley up`'s users, as the kill points' chain: each life the learner's, the test the admin.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.faults.chaos import up_credentials
from tests.faults.lives import JOURNAL_ENV
from tests.faults.test_kill_points import RUN, run_chain

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(900)]

# checkpoint_write: the checkpoint's files written, never fsynced (cut to nothing); archive: the step's
# line and archive durable, the ledger not; upload: version N's chunks stored with no meta (the
# object store's orphans); ledger: all of step 1 durable.
POWER_KILLS = ["checkpoint_write", "archive", "upload", "ledger:2"]


def cut_to_durable(run_dir: Path, journal: Path) -> dict:
    """Cut every file under run_dir to what the journal says was fsynced; {"cut": n, "bytes": lost}."""
    durable: dict[str, int] = {}
    if journal.exists():
        for line in journal.read_text().splitlines():
            e = json.loads(line)
            if "fsync" in e:
                durable[e["fsync"]] = e["size"]
            elif e["rename"] in durable:
                durable[e["to"]] = durable.pop(e["rename"])
            else:
                durable.pop(e["to"], None)  # renamed over by a file nothing made durable
    cut = lost = 0
    for d, _, files in os.walk(run_dir):
        for name in files:
            p = os.path.abspath(os.path.join(d, name))
            size = os.path.getsize(p)
            keep = min(size, durable.get(p, 0))
            if keep < size:
                os.truncate(p, keep)
                cut += 1
                lost += size - keep
    return {"cut": cut, "bytes": lost}


async def orphan_chunks(url: str, run: str, admin: tuple[str, str]) -> int:
    """Chunk messages in the run's object store that no object's meta names (a killed upload's)."""
    from parley.protocol import topology
    from parley.protocol.connect import connect

    nc = await connect(url, name="orphans", user=admin[0], password=admin[1])
    try:
        js = nc.jetstream()
        bucket = topology.object_bucket(run)
        info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
        store = await js.object_store(bucket)
        try:
            named = {o.nuid for o in await store.list(ignore_deletes=True)}
        except Exception:  # noqa: BLE001 - an empty store
            named = set()
        return sum(n for subject, n in (info.state.subjects or {}).items() if subject.rsplit(".", 1)[-1] not in named)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def power_chain(tmp_path_factory, tiny_model):
    from parley.deploy.natsserver import NatsServer

    root = tmp_path_factory.mktemp("power")
    journal = root / "fsync.journal"
    creds, conf = up_credentials(root, RUN)
    server = NatsServer(root / "nats", port=0, extra_conf=conf)
    server.start()
    try:
        out = asyncio.run(
            run_chain(
                root,
                tiny_model,
                server.url,
                creds,
                POWER_KILLS,
                after_kill=lambda run_dir, point: cut_to_durable(run_dir, journal),
                env={JOURNAL_ENV: str(journal)},
            )
        )
        out["orphan_chunks"] = asyncio.run(orphan_chunks(server.url, RUN, creds["admin"]))
        print(f"\npower losses: {[(p, life.get('after_kill')) for p, life in out['lives'].items()]}")
        print(f"orphan chunks in the object store at the end: {out['orphan_chunks']}")
        return out
    finally:
        server.stop()


@pytest.mark.parametrize("kill", POWER_KILLS)
def test_a_power_loss_after_a_named_kill_point_loses_nothing_and_trains_nothing_twice(power_chain, kill):
    point = kill.split(":")[0]
    assert "stalled" not in power_chain, f"{power_chain['stalled']}\nbooks: {power_chain['books'].summary()}"
    at = power_chain["lives"][kill]
    assert at["code"] == -9 and f"PARLEY_KILL_AT: killed at {point} (" in at["log"], at["log"][-3000:]
    assert power_chain["lives"]["end"]["code"] == 0, power_chain["lives"]["end"]["log"][-3000:]
    books = power_chain["books"]
    assert books.lost == [], f"lost samples: {books.lost[:20]}"
    assert books.trained_twice == [], f"trained twice: {books.trained_twice[:20]}"
    assert books.inconsistent == [], f"inconsistent ledger: {books.inconsistent[:20]}"
    lines = power_chain["lines"]
    trained = [t for line in lines for t in line["traj_ids"]]
    assert sorted(power_chain["archived"].elements()) == sorted(trained), "the archive differs from trained.jsonl"


def test_the_server_refused_no_life_anything(power_chain):
    assert power_chain["refused"] == {}, (
        f"the learner's user lacks a grant (deploy/permissions.py): {power_chain['refused']}"
    )


def test_a_learner_killed_during_an_upload_leaves_no_orphan_chunks(power_chain):
    assert power_chain["orphan_chunks"] == 0
