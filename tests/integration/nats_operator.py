"""An operator-mode (decentralized JWT) NATS setup made in Python, for tests: an operator, its
system account, one account with JetStream and one user of it, their JWTs signed by hand with the
`nkeys` package, the server config that trusts the operator (`resolver: MEMORY`, both accounts
preloaded), and the user's `.creds` file in the format `nsc` writes.

JWT v2 claims as nats-server reads them (nats-io/jwt v2): header {"typ":"JWT","alg":"ed25519-nkey"},
claims {jti, iat, iss, sub, name, nats: {type, version: 2, ...}}, signed with the issuer's ed25519
key over "<header>.<claims>" (base64url, unpadded). An account's JetStream is on when its limits
give it memory or disk storage (mem_storage / disk_storage, -1 = unlimited). A JetStream server in
operator mode also needs a system account (without one it exits: "system account not setup").
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import nkeys


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_keypair(prefix: int) -> nkeys.KeyPair:
    """A fresh nkey of the given role (nkeys.PREFIX_BYTE_OPERATOR / _ACCOUNT / _USER)."""
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def public(kp: nkeys.KeyPair) -> str:
    return kp.public_key.decode()


def encode_jwt(claims: dict, issuer: nkeys.KeyPair) -> str:
    header = _b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {"jti": "", "iat": int(time.time()), **claims}
    # jti: the claims' hash with jti empty (sha512/256, as nats-io/jwt makes it), base32, unpadded
    body = json.dumps(claims, separators=(",", ":")).encode()
    claims["jti"] = base64.b32encode(hashlib.new("sha512_256", body).digest()).rstrip(b"=").decode()
    payload = _b64url(json.dumps(claims, separators=(",", ":")).encode())
    signature = _b64url(issuer.sign(f"{header}.{payload}".encode()))
    return f"{header}.{payload}.{signature}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


@dataclass
class OperatorSetup:
    operator_jwt: str
    system_public: str
    system_jwt: str
    account_public: str
    account_jwt: str
    user_jwt: str
    user_seed: str

    def server_conf(self) -> str:
        """nats-server config lines: trust the operator, resolve its two accounts from memory."""
        return (
            f"operator: {self.operator_jwt}\n"
            f"system_account: {self.system_public}\n"
            "resolver: MEMORY\n"
            f"resolver_preload: {{\n  {self.system_public}: {self.system_jwt}\n"
            f"  {self.account_public}: {self.account_jwt}\n}}\n"
        )

    def creds(self) -> str:
        """The user's .creds file text, as `nsc generate creds` writes it."""
        return (
            f"-----BEGIN NATS USER JWT-----\n{self.user_jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{self.user_seed}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n"
        )

    def write_creds(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.creds())
        path.chmod(0o600)
        return path


def operator_setup(name: str = "parley-test") -> OperatorSetup:
    """Operator (+ system account) -> account (JetStream, no other limits) -> user (may publish and
    subscribe anything)."""
    op = new_keypair(nkeys.PREFIX_BYTE_OPERATOR)
    sys_acc = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    acc = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user = new_keypair(nkeys.PREFIX_BYTE_USER)
    operator_jwt = encode_jwt(
        {"iss": public(op), "sub": public(op), "name": name,
         "nats": {"system_account": public(sys_acc), "type": "operator", "version": 2}},
        op,
    )  # fmt: skip
    system_jwt = encode_jwt(
        {"iss": public(op), "sub": public(sys_acc), "name": "SYS",
         "nats": {"limits": UNLIMITED | {"conn": -1}, "type": "account", "version": 2}},
        op,
    )  # fmt: skip
    account_limits = UNLIMITED | {
        "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1,
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
    }  # fmt: skip
    account_jwt = encode_jwt(
        {
            "iss": public(op), "sub": public(acc), "name": f"{name}-account",
            "nats": {"limits": account_limits, "default_permissions": {"pub": {}, "sub": {}},
                     "type": "account", "version": 2},
        },
        op,
    )  # fmt: skip
    user_jwt = encode_jwt(
        {
            "iss": public(acc), "sub": public(user), "name": f"{name}-user",
            "nats": {"pub": {}, "sub": {}, **UNLIMITED, "type": "user", "version": 2},
        },
        acc,
    )  # fmt: skip
    return OperatorSetup(
        operator_jwt, public(sys_acc), system_jwt, public(acc), account_jwt, user_jwt, user.seed.decode()
    )
