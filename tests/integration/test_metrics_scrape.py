"""A role's Prometheus endpoint, scraped while it works: the real `parley learner` command (real
DeepSpeed on the toy model) over a real nats-server, started with `--metrics-port 0` (it prints the
port it got). Scored groups make it step; a message that does not decode is dead-lettered; the
scrapes show the step, the reward terms and the dead letters move, and every heartbeat key the
learner sends has a series of its own (none falls through to parley_heartbeat_value)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from parley.protocol import topology
from parley.protocol.bus import publish
from tests.integration.test_learner_resume import BUS, N, make_scored, toy  # noqa: F401 (toy: the fixture)

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
RUN = "metrics"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """(name, labels) -> value of every sample at `url`, parsed with prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples, name: str, **labels) -> float | None:
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    return hits[0] if hits else None


async def until(pred, what: str, proc, log: Path, timeout: float = 120.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (got := pred()) is not None:
            return got
        if proc.poll() is not None:
            pytest.fail(f"learner exited with {proc.returncode} while waiting for {what}:\n{log.read_text()[-4000:]}")
        await asyncio.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")


async def test_learner_metrics_endpoint_shows_steps_rewards_and_dead_letters(js, nats_server, toy, tmp_path):
    model_path, tok, model = toy
    await topology.ensure_topology(js, RUN, BUS)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    sets = [
        f'run.dir="{run_dir}"',
        f'policy.model="{model_path}"',
        f"rollout.n={N}",
        "learner.groups_per_step=1",
        "learner.micro_batch_tokens=256",
        f"bus.max_bytes={BUS.max_bytes}",
        "learner.eval_every=0",
        "learner.ledger_flush_s=0.5",
        "learner.accept_foreign_scored=true",  # its samples are synthetic: no feeder issued their tasks
        "learner.max_staleness=4",
    ]
    cmd = [
        sys.executable,
        "-m",
        "parley.deploy.cli",
        "learner",
        "--nats",
        nats_server.url,
        "--run",
        RUN,
        "--steps",
        "5",
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
    ]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**os.environ, "PARLEY_LOG": "INFO"}, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    try:

        def endpoint():
            m = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", log.read_text())
            return m.group(1) if m else None

        url = await until(endpoint, "the metrics address on the learner's output", proc, log)
        labels = {"run": RUN, "role": "learner"}

        def scraped(pred):
            def check():
                try:
                    samples = scrape(url)
                except OSError:
                    return None
                return samples if pred(samples) else None

            return check

        before = await until(scraped(lambda s: value(s, "parley_learner_step", **labels) == 0.0), "step 0", proc, log)
        assert value(before, "parley_learner_reward", term="total") is None  # no step, no reward yet
        assert value(before, "parley_dead_letters_total", channel="scored", reason="undecodable") is None

        def probe(path: str) -> int | None:
            try:
                with urllib.request.urlopen(url.removesuffix("/metrics") + path, timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code
            except OSError:
                return None

        # the probes of deploy/k8s: ready once connected and in its work loop, live throughout
        await until(lambda: probe("/readyz") == 200 or None, "/readyz 200", proc, log)
        assert probe("/healthz") == 200

        # Rewards differ within the group (make_scored's bleu), so it trains.
        for i in range(N):
            await publish(js, RUN, "scored", make_scored(tok, model, RUN, 0, i))
        first = await until(scraped(lambda s: value(s, "parley_learner_step", **labels) == 1.0), "step 1", proc, log)
        reward1 = value(first, "parley_learner_reward", term="bleu")
        assert reward1 is not None and value(first, "parley_learner_reward", term="total") is not None
        assert value(first, "parley_learner_trained_tokens_total") > 0
        assert value(first, "parley_learner_step_seconds") > 0

        await js.publish(topology.subject(RUN, "scored"), b"\x93 not a Scored")
        for i in range(N):
            await publish(js, RUN, "scored", make_scored(tok, model, RUN, 7, i))
        second = await until(
            scraped(
                lambda s: (
                    value(s, "parley_learner_step", **labels) == 2.0
                    and value(s, "parley_dead_letters_total", channel="scored", reason="undecodable") == 1.0
                )
            ),
            "step 2 and a dead letter",
            proc,
            log,
        )
        assert value(second, "parley_learner_reward", term="bleu") != reward1  # another group, other rewards
        assert value(second, "parley_learner_trained_tokens_total") > value(
            first, "parley_learner_trained_tokens_total"
        )
        assert value(second, "parley_policy_version", **labels) == 2.0
        assert value(second, "parley_role_state", **labels) == 1.0
        unnamed = sorted(dict(ls)["key"] for (n, ls) in second if n == "parley_heartbeat_value")
        assert not unnamed, f"heartbeat keys with no family in runtime.metrics.FAMILIES: {unnamed}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
