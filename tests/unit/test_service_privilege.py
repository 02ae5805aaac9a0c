"""Least privilege for the service users (sim, judge, services, reference): read from the server
configuration that `parley auth credentials` and `parley up` generate, for one run and for the
shared fleet (run "*"). A service may answer requests (allow_responses) and otherwise only say it is
alive and look at the topology: it may publish on no run's data subject (tasks, traj, scored, eval,
dead) and write no weights. A forged dead letter from a service user was acted on by the learner
(the letter's task abandoned), on every run when the user was shared."""

from __future__ import annotations

import json
import re

import pytest

from parley.deploy.credentials import generate_credentials, server_auth_conf
from parley.protocol import topology

SERVICES = ("sim", "judge", "services", "reference")


def published_by(conf: str) -> dict[str, tuple[list[str], bool]]:
    """user -> (its publish allow-list, whether it may answer requests), parsed from the conf text."""
    out = {}
    for m in re.finditer(r'user: ("[^"]*"), password: "[^"]*", permissions: (\{.*\})\}$', conf, re.M):
        body = json.loads(m.group(2))
        out[json.loads(m.group(1))] = (body["publish"]["allow"], "allow_responses" in body)
    return out


def allowed_for_a_service(subject: str, run: str) -> bool:
    """Its own heartbeats, and the read-only JetStream INFO requests that verify the topology."""
    status = topology.status_subject("r", "x", "y").rsplit(".", 2)[0].replace(".r.", f".{run}.")  # parley.<run>.status
    return subject.startswith(status + ".") or subject == "$JS.API.INFO" or ".INFO." in subject


@pytest.mark.parametrize("run", ["prod", "*"])
def test_no_service_user_may_publish_outside_its_replies(tmp_path, run):
    creds = generate_credentials(run, tmp_path / "auth")
    users = published_by(server_auth_conf(creds, run))
    assert len(users) == len(creds)
    for role in SERVICES:
        publish, answers = users[creds[role][0]]
        assert answers, f"{role} cannot answer requests"
        beyond = [s for s in publish if not allowed_for_a_service(s, run)]
        assert beyond == [], f"{role} may publish {beyond}"


@pytest.mark.parametrize("run", ["prod", "*"])
def test_only_the_consuming_roles_may_write_dead_letters(tmp_path, run):
    creds = generate_credentials(run, tmp_path / "auth")
    users = published_by(server_auth_conf(creds, run))
    dead = topology.subject("r", "dead").replace(".r.", f".{run}.")  # parley.<run>.dead
    writers = sorted(role for role, (user, _) in creds.items() if dead in users[user][0] or ">" in users[user][0])
    assert writers == ["actor", "admin", "learner", "scorer"]


@pytest.mark.parametrize("run", ["prod", "*"])
def test_no_workload_role_may_make_or_change_topology(run, tmp_path):
    """From the generated server config: no user but admin may send a stream or consumer create or
    update in any form (a push consumer's deliver_subject, a stream's subjects, mirror, sources and
    republish are in the request body, which the server does not check against the user's rights)."""
    from parley.deploy.permissions import FORBIDDEN_API, forbidden_requests, subject_matches

    creds = generate_credentials(run, tmp_path / "auth")
    users = published_by(server_auth_conf(creds, run))
    probes = forbidden_requests("PARLEY_prod_SCORED") + forbidden_requests("KV_parley_prod_held")
    assert {p.split(".")[2] + "." + p.split(".")[3] for p in probes} >= {f for f in FORBIDDEN_API if "DURABLE" not in f}
    for role, (user, _) in creds.items():
        allowed = [p for p in probes for s in users[user][0] if subject_matches(s, p)]
        assert bool(allowed) == (role == "admin"), (role, allowed[:3])


def test_a_table_that_would_allow_topology_is_refused(monkeypatch):
    from parley.deploy import permissions

    real = permissions._read_stream
    monkeypatch.setattr(permissions, "_read_stream", lambda s: [*real(s), f"{permissions.API}.CONSUMER.CREATE.{s}"])
    with pytest.raises(AssertionError, match="would be allowed to make or change topology"):
        permissions.role_permissions("prod")
