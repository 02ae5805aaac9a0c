"""`parley eval --services fleet` on the toy model over a real nats-server: the simulator and judge run
as `parley services`, and each of two conditions (base, the proactive system prompt) is played by a
`parley actor` and judged by a `parley scorer` that the eval starts on the condition's own bus run.
Both conditions meet the same items and simulator seeds, every record reaches the run's EVAL stream,
and the conditions' runs are removed afterwards.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.extended, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
RUN = "fleete2e"


def wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, path.read_text(errors="replace")[-3000:]
        time.sleep(1.0)
    raise AssertionError(f"no {text!r} in {path} after {timeout}s")


def test_eval_fleet_plays_each_condition_through_an_actor_and_a_scorer(tmp_path, nats_server):
    from parley.evaluation.evallog import read_records, read_stream
    from parley.evaluation.fleet import condition_run
    from parley.protocol import topology
    from parley.protocol.connect import connect

    config = str(ROOT / "deploy/configs/tiny.toml")
    common = ["--config", config, "--nats", nats_server.url, "--run", RUN]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    services_log = tmp_path / "services.log"
    with services_log.open("wb") as out:
        services = subprocess.Popen(
            [sys.executable, "-m", "parley.deploy.cli", "services", *common, "--id", "svc"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        # The eval starts while the services load their engine (the start-ups overlap): its actors wait for
        # the simulator (sim_wait_s) as they would for one that restarts, and nothing is judged before the
        # simulator, which serves with the judge in one process, has answered.
        bench = tmp_path / "bench"
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "parley.deploy.cli",
                "eval",
                *common,
                "--services",
                "fleet",
                "-C",
                "base=tiny",
                "-C",
                "proactive=tiny,system_prompt=proactive",
                "--n-items",
                "2",
                "--assistant-max-tokens",
                "24",
                "--max-new-turns",
                "4",
                "--out",
                str(bench),
            ],
            capture_output=True,
            text=True,
            timeout=800,
            env=env,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
        wait_for_line(services_log, "serves sim and judge", services, timeout=10)
    finally:
        services.terminate()
        services.wait(60)

    records = read_records(bench / "records.parquet")
    assert sorted(r.condition for r in records) == ["base", "base", "proactive", "proactive"]
    by = {(r.condition, r.item_id): r for r in records}
    items = sorted({r.item_id for r in records})
    assert len(items) == 2
    for item in items:
        base, pro = by["base", item], by["proactive", item]
        assert base.messages[0].role == "user" and pro.messages[0].role == "system"
        assert pro.messages[0].content == pro.system_prompt != ""
        # the same simulator seed in both conditions' runs: the same opening message
        assert base.messages[0].content == pro.messages[1].content
        assert base.metrics and pro.metrics and base.judge_model == "tiny" and base.sim_model == "tiny"
        assert 0 < base.assistant_tokens <= 2 * 24
    # each condition had its own actor and scorer, whose logs name the condition's run
    for cond in ("base", "proactive"):
        actor_log = (bench / "fleet" / "logs" / f"actor-{cond}.log").read_text()
        assert "task eval/" in actor_log and "samples stored" in actor_log
        assert (bench / "fleet" / "logs" / f"scorer-{cond}.log").exists()
    assert "| proactive |" in res.stdout

    async def bus():
        nc = await connect(nats_server.url, name="check")
        try:
            js = nc.jetstream()
            stored = await read_stream(js, RUN, "eval")
            names = [s.config.name for s in await js.streams_info()]
            return stored, names
        finally:
            await nc.close()

    stored, names = asyncio.run(bus())
    assert sorted(r.eval_id for r in stored) == sorted(r.eval_id for r in records)
    for cond in ("base", "proactive"):
        assert topology.stream_name(condition_run(RUN, cond), "tasks") not in names
