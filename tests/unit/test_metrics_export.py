"""runtime.metrics: heartbeat keys become Prometheus series named by convention, and the Grafana
dashboard (deploy/grafana/parley.json) queries only series the registry can expose."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from parley.protocol.messages import Heartbeat
from parley.runtime import metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "parley.json"


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def metric_names(expr: str) -> set[str]:
    """The parley_ series a PromQL expression reads (label values in quotes left out)."""
    return set(re.findall(r"\bparley_[a-zA-Z0-9_]+", re.sub(r'"[^"]*"', '""', expr)))


def test_every_dashboard_query_names_series_the_registry_exposes():
    exposed = metrics.exposed_names()
    exprs = dashboard_queries()
    assert len(exprs) >= 10
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"query reads no parley series: {expr}"
        assert names <= exposed, f"{expr}: {sorted(names - exposed)} is not a series of runtime.metrics"
        # rate() and increase() only make sense over counters
        for fn, name in re.findall(r"\b(rate|increase)\(\s*(parley_[a-zA-Z0-9_]+)", expr):
            assert name.endswith("_total"), f"{expr}: {fn}() over the gauge {name}"


def test_the_check_above_can_fail():
    assert metric_names('sum(rate(parley_no_such_total{run="parley_x"}[1m]))') == {"parley_no_such_total"}
    assert not {"parley_no_such_total"} <= metrics.exposed_names()


def test_families_follow_prometheus_naming():
    names = [f.name for f in metrics.FAMILIES]
    for f in (*metrics.FAMILIES, metrics.STATE, metrics.VERSION, metrics.BEAT, metrics.OTHER):
        assert re.fullmatch(r"parley_[a-z0-9_]+", f.name), f.name
        assert (f.kind == "counter") == f.name.endswith("_total"), f.name
        assert f.help
    # one name, one label set: two families of one name would be merged wrongly
    by_name: dict[str, set] = {}
    for f in metrics.FAMILIES:
        by_name.setdefault(f.name, set()).add(f.labels)
    assert all(len(v) == 1 for v in by_name.values()), {k: v for k, v in by_name.items() if len(v) > 1}
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "role, key, name, labels",
    [
        ("actor", "trajectories", "parley_actor_trajectories_total", {}),
        ("actor", "dead.tasks.poison", "parley_dead_letters_total", {"channel": "tasks", "reason": "poison"}),
        (
            "learner",
            "dead.scored.undecodable",
            "parley_dead_letters_total",
            {"channel": "scored", "reason": "undecodable"},
        ),
        (
            "learner",
            "duplicate.tasks.earlier",
            "parley_publish_duplicates_total",
            {"channel": "tasks", "origin": "earlier"},
        ),
        (
            "scorer",
            "duplicate.scored.retry",
            "parley_publish_duplicates_total",
            {"channel": "scored", "origin": "retry"},
        ),
        ("learner", "step", "parley_learner_step", {}),
        ("learner", "reward.total", "parley_learner_reward", {"term": "total"}),
        ("learner", "reward.bleu.group_std", "parley_learner_reward_group_std", {"term": "bleu"}),
        ("learner", "tasks.waiting", "parley_tasks_waiting", {}),
        ("learner", "eval.mr", "parley_learner_eval", {"metric": "mr"}),
        ("learner", "eval.queued", "parley_learner_eval_queued", {}),
        ("scorer", "judge_retry", "parley_scorer_retries_total", {"service": "judge"}),
        ("judge", "interactivity.ok", "parley_judge_ops_total", {"op": "interactivity", "result": "ok"}),
        ("sim", "served", "parley_service_requests_total", {"outcome": "served"}),
        ("scorer", "in_flight", "parley_in_flight", {}),
        ("scorer", "judge_audit.agreement", "parley_scorer_judge_agreement", {}),
        (
            "scorer",
            "judge_audit.agreement.interactivity",
            "parley_scorer_judge_metric_agreement",
            {"metric": "interactivity"},
        ),
        ("scorer", "judge_audit.flagged", "parley_scorer_judge_flagged", {}),
        ("scorer", "judge_audit.drift", "parley_scorer_judge_drift", {}),
        ("scorer", "judge.tie_share", "parley_scorer_judge_tie_share", {}),
        ("scorer", "something_new", "parley_heartbeat_value", {"key": "something_new"}),
    ],
)
def test_heartbeat_keys_map_to_families(role, key, name, labels):
    family, extra = metrics.family_of(role, key)
    assert (family.name, extra) == (name, labels)


def test_collector_exposes_the_latest_heartbeat_of_each_role():
    from prometheus_client import CollectorRegistry, generate_latest

    collector = metrics.HeartbeatCollector()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    collector.observe(
        "r1",
        Heartbeat(
            role="actor",
            id="actor-0",
            state="busy",
            version=3,
            counters={"trajectories": 5.0, "dead.tasks.poison": 1.0},
            created=1.5,
        ),
    )
    collector.observe(
        "r1",
        Heartbeat(
            role="actor",
            id="actor-0",
            state="ready",
            version=4,
            counters={"trajectories": 7.0, "dead.tasks.poison": 1.0},
            created=2.5,
        ),
    )
    collector.observe(
        "r1",
        Heartbeat(
            role="learner",
            id="learner",
            state="ready",
            version=4,
            counters={"step": 4.0, "reward.total": 0.25},
            created=2.0,
        ),
    )
    text = generate_latest(registry).decode()
    from prometheus_client.parser import text_string_to_metric_families

    got = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    base = {"run": "r1", "role": "actor", "instance": "actor-0"}

    def at(name, **labels):
        return got.get((name, tuple(sorted((base | labels).items()))))

    assert at("parley_actor_trajectories_total") == 7.0  # the latest heartbeat, not the first
    assert at("parley_dead_letters_total", channel="tasks", reason="poison") == 1.0
    assert at("parley_role_state", state="ready") == 1.0 and at("parley_role_state", state="busy") is None
    assert at("parley_policy_version") == 4.0
    assert at("parley_learner_reward", role="learner", instance="learner", term="total") == 0.25
    assert "# TYPE parley_actor_trajectories_total counter" in text
