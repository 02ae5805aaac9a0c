"""Files that hold secrets (credentials, the server's auth config) are 0600 from the moment they hold
a secret: every write into them happens through a descriptor whose file is 0600, also when a file of
another mode was there before (a rerun of `parley up` over an old run dir, a file copied in)."""

from __future__ import annotations

import os
import stat

import parley.deploy.natsserver as natsserver
from parley.deploy.credentials import generate_credentials


def _watch_writes(monkeypatch) -> list[int]:
    """Record the mode of the file behind every text written through os.fdopen in natsserver."""
    modes: list[int] = []
    real_fdopen = os.fdopen

    class Watched:
        def __init__(self, f):
            self._f = f

        def write(self, text):
            modes.append(stat.S_IMODE(os.fstat(self._f.fileno()).st_mode))
            return self._f.write(text)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    monkeypatch.setattr(natsserver.os, "fdopen", lambda fd, *a, **k: Watched(real_fdopen(fd, *a, **k)))
    return modes


def test_a_secret_is_never_written_into_a_file_others_may_read(tmp_path, monkeypatch):
    target = tmp_path / "actor.env"
    target.write_text("old, harmless\n")
    os.chmod(target, 0o644)
    modes = _watch_writes(monkeypatch)
    natsserver.write_private(target, "PARLEY_NATS_PASSWORD=s3cret\n")
    assert modes and all(m == 0o600 for m in modes), [oct(m) for m in modes]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_text() == "PARLEY_NATS_PASSWORD=s3cret\n"
    assert [p.name for p in tmp_path.iterdir()] == ["actor.env"]  # no temporary file left beside it


def test_generated_credentials_are_private_over_an_old_run_dir(tmp_path, monkeypatch):
    out = tmp_path / "auth"
    out.mkdir(mode=0o755)
    for name in ("auth.conf", "actor.env"):
        (out / name).write_text("stale\n")
        os.chmod(out / name, 0o644)
    modes = _watch_writes(monkeypatch)
    generate_credentials("private", out)
    assert modes and all(m == 0o600 for m in modes), [oct(m) for m in modes]
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in out.iterdir())
