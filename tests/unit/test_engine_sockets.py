"""engines.engine.engine_socket_dir: vLLM's engine sockets (a uuid-named file each, in the temp
directory by default) go to a scratch directory of the process, so that those a killed engine leaves
are removed by the next process on the host (the CI machine's /tmp held 1,536 of them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from parley.engines import engine
from parley.runtime import scratch


@pytest.fixture
def short_tmp():
    """A temp directory as short as a real one (pytest's own would leave no room for a socket's name)."""
    path = tempfile.mkdtemp(prefix="pv-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_the_sockets_go_to_a_scratch_dir_of_this_process_that_a_later_process_sweeps(monkeypatch, short_tmp):
    fresh(monkeypatch, short_tmp)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    left = short_tmp / f"parley-vllm-{scratch._host()}-{proc.pid}-abc"  # a killed process's sockets
    left.mkdir()
    (left / "0e6c3a0e-2f57-4a8e-9d55-1f7b0c1e8a11").write_bytes(b"")
    environ: dict[str, str] = {}
    path = engine.engine_socket_dir(environ)
    assert path is not None and environ[engine.RPC_DIR_ENV] == path
    assert os.path.dirname(path) == str(short_tmp) and os.path.isdir(path)
    assert os.path.basename(path).startswith(f"parley-vllm-{scratch._host()}-{os.getpid()}-")
    assert not left.exists()
    assert engine.engine_socket_dir(environ) == path  # one per process: a second engine shares it


def test_an_operators_socket_dir_is_kept(monkeypatch, short_tmp):
    fresh(monkeypatch, short_tmp)
    environ = {engine.RPC_DIR_ENV: "/run/vllm"}
    assert engine.engine_socket_dir(environ) is None
    assert environ == {engine.RPC_DIR_ENV: "/run/vllm"} and list(short_tmp.iterdir()) == []


def test_a_dir_whose_socket_paths_would_be_too_long_is_not_used(monkeypatch, short_tmp, caplog):
    fresh(monkeypatch, short_tmp)
    monkeypatch.setattr(engine, "SOCKET_PATH_MAX", len(str(short_tmp)) + 20)
    environ: dict[str, str] = {}
    assert engine.engine_socket_dir(environ) is None
    assert environ == {} and list(short_tmp.iterdir()) == []
    assert "would pass the" in caplog.text and engine.RPC_DIR_ENV in caplog.text


def test_a_parents_socket_dir_inherited_through_the_environment_is_replaced(monkeypatch, short_tmp):
    """A process started by one that runs engines (a test session, a role) inherits its
    VLLM_RPC_BASE_PATH; that directory goes when the parent exits, so the child makes its own."""
    fresh(monkeypatch, short_tmp)
    parents = short_tmp / f"parley-vllm-{scratch._host()}-{os.getppid()}-abc"
    parents.mkdir()
    environ = {engine.RPC_DIR_ENV: str(parents)}
    path = engine.engine_socket_dir(environ)
    assert path is not None and path != str(parents) and environ[engine.RPC_DIR_ENV] == path
    assert os.path.basename(path).startswith(f"parley-vllm-{scratch._host()}-{os.getpid()}-")
    assert parents.exists()  # the parent's, alive: not ours to remove
