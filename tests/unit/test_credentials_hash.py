"""deploy.credentials.hash_passwords: `parley up` hashes one password a role before its nats-server starts,
side by side in threads; each hash is its own password's (bcrypt checks it), in the order given."""

from __future__ import annotations

import ctypes

from parley.deploy.credentials import _libcrypt, hash_passwords


def test_each_hash_is_its_own_passwords_in_order():
    passwords = [f"password-{i}-{'x' * i}" for i in range(9)]
    hashes = hash_passwords(passwords)
    assert len(hashes) == 9 and len(set(hashes)) == 9 and all(h.startswith("$2b$10$") for h in hashes)
    lib = _libcrypt()
    for password, hashed in zip(passwords, hashes, strict=True):
        data = ctypes.create_string_buffer(256 * 1024)
        assert lib.crypt_r(password.encode(), hashed.encode(), data) == hashed.encode()  # bcrypt's check
        other = ctypes.create_string_buffer(256 * 1024)
        assert lib.crypt_r(b"not-" + password.encode(), hashed.encode(), other) != hashed.encode()
