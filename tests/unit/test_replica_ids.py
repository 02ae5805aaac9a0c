"""deploy.common.default_id: a replica started without --id gets an id of its own even where two
replicas share a host name and a pid (containers under host networking, each command run as pid 1)."""

from __future__ import annotations

import re

from parley.deploy import common


def test_two_replicas_with_one_host_name_and_pid_get_two_ids(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "node-7")
    monkeypatch.setattr("os.getpid", lambda: 1)
    ids = [common.default_id("actor") for _ in range(20)]
    assert all(re.fullmatch(r"actor-node-7-1-[0-9a-f]{4}", i) for i in ids), ids
    assert len(set(ids)) > 1  # before: "actor-node-7-1" for every replica on the node
