"""`parley nats` and `parley selfcheck` as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
PARLEY = [sys.executable, "-m", "parley.deploy.cli"]


async def test_parley_nats_prints_a_url_with_jetstream_and_8mb_payload(tmp_path):
    import nats

    proc = subprocess.Popen(
        [*PARLEY, "nats", "--port", "0", "--store-dir", str(tmp_path / "d")], stdout=subprocess.PIPE, text=True
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("nats://127.0.0.1:")
        nc = await nats.connect(url)
        assert nc.max_payload >= 8 * 1024 * 1024
        info = await nc.jetstream().account_info()
        assert info is not None
        await nc.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_selfcheck_round_trips_every_type():
    out = subprocess.run([*PARLEY, "selfcheck"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "5/5 message types round-tripped" in out.stdout


def test_help_does_not_import_heavy_libraries():
    # `parley --help` must answer at once: torch, vLLM and DeepSpeed load inside commands only.
    code = "import sys, parley.deploy.cli; print(sorted(m for m in ('torch','vllm','deepspeed','transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    out = subprocess.run([*PARLEY, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "nats" in out.stdout


def test_unreachable_nats_fails_fast_with_the_url(tmp_path):
    env = {**os.environ, "PARLEY_LOG": "ERROR"}
    out = subprocess.run(
        [*PARLEY, "selfcheck", "--external", "--nats", "nats://127.0.0.1:1", "--set", "nats.connect_timeout_s=2"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 3
    assert "nats://127.0.0.1:1" in out.stderr


def test_a_server_store_without_room_for_the_runs_streams_fails_with_the_setting_to_lower(tmp_path):
    """nats-server with a 100 MB store and the default [bus] max_bytes (1 GiB a stream, reserved up
    front): creating the topology fails with one line that names the setting, what it reserves and
    the fix, and exit code 4, not a traceback. With max_bytes lowered the same check passes."""
    from parley.deploy.natsserver import NatsServer

    server = NatsServer(tmp_path / "nats", port=0, extra_conf="jetstream {\n  max_file_store: 104857600\n}")
    server.start()
    try:
        env = {**os.environ, "PARLEY_LOG": "ERROR"}
        out = subprocess.run(
            [*PARLEY, "selfcheck", "--external", "--nats", server.url],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode == 4, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
        line = next(x for x in out.stderr.splitlines() if x.startswith("parley: "))
        assert "insufficient storage" in line and "[bus] max_bytes = 1073741824" in line
        assert "5.0 GiB" in line and "--set bus.max_bytes=" in line
        out = subprocess.run(
            [*PARLEY, "selfcheck", "--external", "--nats", server.url, "--set", "bus.max_bytes=8388608"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
    finally:
        server.stop()
