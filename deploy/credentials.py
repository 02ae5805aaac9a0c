"""Per-run NATS credentials: a fresh user and password per role, the server's auth.conf (the users
with their permissions from deploy/permissions.py), one <role>.env per role, and the Kubernetes
Secret made of them. `parley up`, `parley auth` and the deploy files (docs/operations.md) use them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import shlex
import threading
from pathlib import Path

from parley.deploy.natsserver import write_private
from parley.deploy.permissions import ROLES, response_window_s, role_permissions, user_name
from parley.protocol import topology

# nats-server stores a password as a bcrypt hash and checks the client's plaintext against it (each
# connect costs the server one hash: 2^cost rounds, about 0.1 s at 10).
BCRYPT_COST = 10


@functools.lru_cache(maxsize=256)
def hash_password(password: str, cost: int = BCRYPT_COST) -> str:
    """A bcrypt hash of `password` ($2b$<cost>$...) for auth.conf: the `bcrypt` package if installed,
    else the system's libcrypt (libxcrypt, present on glibc systems), through ctypes. Remembered per
    password, so writing auth.conf and the server's config from the same credentials hashes once."""
    try:
        import bcrypt  # not a dependency: used when an operator has it
    except ImportError:
        bcrypt = None
    if bcrypt is not None:
        return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost)).decode()
    import ctypes

    lib = _libcrypt()
    with _GENSALT:  # crypt_gensalt answers in a static buffer; crypt_r below in one of this call's own
        salt = lib.crypt_gensalt(b"$2b$", cost, None, 0)
    # struct crypt_data: 32 KiB in libxcrypt, 128 KiB in glibc's old libcrypt; zeroed, as its first use wants
    data = ctypes.create_string_buffer(256 * 1024)
    hashed = lib.crypt_r(password.encode(), salt, data) if salt else None
    if not hashed or not hashed.startswith(b"$2b$"):
        raise RuntimeError(
            "the system's libcrypt cannot make bcrypt hashes; install the bcrypt package (pip install bcrypt) "
            "to write auth.conf"
        )
    return hashed.decode()


@functools.cache  # loaded once (find_library asks ldconfig), whichever thread comes first
def _libcrypt():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("crypt")
    if name is None:
        raise RuntimeError(
            "no bcrypt for auth.conf: neither the bcrypt package nor libcrypt is installed; "
            "pip install bcrypt (or install libcrypt1)"
        )
    lib = ctypes.CDLL(name)
    lib.crypt_gensalt.restype = ctypes.c_char_p
    lib.crypt_gensalt.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int]
    lib.crypt_r.restype = ctypes.c_char_p
    lib.crypt_r.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
    return lib


_GENSALT = threading.Lock()


def hash_passwords(passwords: list[str]) -> list[str]:
    """hash_password of each, side by side: one bcrypt hash is about 0.07 s of one core (ctypes and the
    bcrypt package release the GIL while they hash), and `parley up` hashes one a role before its
    nats-server can start."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(passwords), os.cpu_count() or 1))) as pool:
        return list(pool.map(hash_password, passwords))


def server_auth_conf(
    creds: dict[str, tuple[str, str]], run: str | None = None, *, response_window: float | None = None
) -> str:
    """The `authorization { users = [...] }` block for nats-server, one user per role of `creds`, each
    password stored as its bcrypt hash.

    `run` defaults to the run named in the user names that generate_credentials made;
    `response_window` (seconds a service may take to answer) to response_window_s() of the defaults.
    """
    if run is None:
        run = _run_of(creds)
    window = response_window_s() if response_window is None else response_window
    if not window > 0:
        raise ValueError(f"response_window={window} must be > 0 (seconds a service may take to answer)")
    perms = role_permissions(run, {role: user for role, (user, _) in creds.items()})
    users = []
    hashes = dict(zip(creds, hash_passwords([password for _, password in creds.values()]), strict=True))
    for role, (user, _password) in creds.items():
        rules = perms[role]
        body = {
            "publish": {"allow": rules["publish"]["allow"]},
            "subscribe": {"allow": rules["subscribe"]["allow"]},
        }
        if rules.get("allow_responses"):
            # One reply per request, allowed for the whole window (not the server's default 2 minutes).
            body["allow_responses"] = {"max": 1, "expires": f"{math.ceil(window)}s"}
        # JSON strings are valid nats-server config strings; quoting keeps `$JS...` from reading as a variable.
        # Only the hash: the plaintext lives in <role>.env, which the server never reads.
        hashed = hashes[role]
        fields = f"user: {json.dumps(user)}, password: {json.dumps(hashed)}, permissions: {json.dumps(body)}"
        users.append(f"    {{{fields}}}")
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def _run_of(creds: dict[str, tuple[str, str]]) -> str:
    user, _ = next(iter(creds.values()))
    role = next(iter(creds))
    prefix, suffix = "parley-", f"-{role}"
    if not (user.startswith(prefix) and user.endswith(suffix)):
        raise ValueError(f"cannot tell the run from user {user!r}; pass run= explicitly")
    return user[len(prefix) : -len(suffix)]


def generate_credentials(
    run: str, out_dir: str | Path, roles: tuple[str, ...] = ROLES, *, response_window: float | None = None
) -> dict[str, tuple[str, str]]:
    """Make a fresh user and password per role for `run` (or "*": every run); write auth.conf and
    <role>.env (mode 0600). `response_window`: see server_auth_conf (pass response_window_s(cfg)).

    auth.conf is the server side (include it in a nats-server config or pass it as NatsServer's
    extra_conf); <role>.env holds PARLEY_NATS_USER / PARLEY_NATS_PASSWORD for that role's processes
    (learner.env also the eval role's, as PARLEY_EVAL_NATS_USER / PASSWORD, for its periodic eval child).
    Returns {role: (user, password)}.
    """
    if run != "*":
        topology.check_run(run)
    for role in roles:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known: {ROLES}")
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)  # private from its creation
    os.chmod(out, 0o700)  # an existing directory keeps its mode through mkdir
    creds = {role: (user_name(run, role), secrets.token_urlsafe(24)) for role in roles}
    write_private(out / "auth.conf", server_auth_conf(creds, run, response_window=response_window))
    for role, (user, password) in creds.items():
        env = {"PARLEY_NATS_USER": user, "PARLEY_NATS_PASSWORD": password}
        if role == "learner" and "eval" in creds:
            env |= {"PARLEY_EVAL_NATS_USER": creds["eval"][0], "PARLEY_EVAL_NATS_PASSWORD": creds["eval"][1]}
        write_private(out / f"{role}.env", env_file_text(env))
    return creds


def env_file_text(env: dict[str, str]) -> str:
    """`export KEY=VALUE` lines: `source FILE` in a shell hands them to the commands it starts (without
    `export` they stay shell variables), and Docker Compose's env_file reads the same lines. Values
    are quoted for the shell where they need it (user names and token_urlsafe passwords do not)."""
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines of a <role>.env file (`export ` before them or not), for starting a role with
    its credentials."""
    env = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key.strip()] = next(iter(shlex.split(value)), "")  # as the shell reads it: quotes removed
    return env


K8S_SECRET = "parley-nats-credentials"


def k8s_secret(auth_dir: str | Path, name: str = K8S_SECRET) -> str:
    """A Secret manifest with auth.conf (for the NATS pods) and <role>-user / <role>-password keys
    (for the role pods' PARLEY_NATS_USER / PARLEY_NATS_PASSWORD), from generate_credentials' files."""
    auth_dir = Path(auth_dir)
    data = {"auth.conf": (auth_dir / "auth.conf").read_text()}
    for role in ROLES:
        env_file = auth_dir / f"{role}.env"
        if env_file.exists():
            env = read_env_file(env_file)
            data[f"{role}-user"] = env["PARLEY_NATS_USER"]
            data[f"{role}-password"] = env["PARLEY_NATS_PASSWORD"]
    manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque", "stringData": data}
    return json.dumps(manifest, indent=2) + "\n"  # JSON is YAML; no YAML writer needed
