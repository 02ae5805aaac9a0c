"""Prometheus metrics of a role process, fed by its own heartbeats: every Heartbeat the process sends
(protocol.status.send) becomes its latest metrics, so `parley top` and a Prometheus scrape read the
same numbers, built in one place (each role's `heartbeat()`). `serve(port)` starts the endpoint; the
`parley <role>` commands call it for `--metrics-port`. The same port answers /healthz and /readyz,
read from the same heartbeats (HeartbeatCollector.health), for a liveness and a readiness probe.
FAMILIES names every series a heartbeat key becomes; deploy/grafana/parley.json queries only those
(tests/unit/test_metrics_export.py).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

LABELS = ("run", "role", "instance")  # on every series: the run, the heartbeat's role and its id
SERVICES = ("sim", "judge", "reference")  # roles that are an engines.service.Service


@dataclass(frozen=True)
class Family:
    """One metric: the heartbeat counter keys it is made of (a full match of `key`, whose named
    groups become labels), for the roles in `roles` (() = any role)."""

    name: str  # as exposed: counters end in _total
    kind: str  # "counter" | "gauge"
    key: str
    help: str
    roles: tuple[str, ...] = ()

    @property
    def labels(self) -> tuple[str, ...]:
        return (*LABELS, *re.compile(self.key).groupindex)


def _f(name: str, key: str, help: str, *roles: str) -> Family:
    return Family(name, "counter" if name.endswith("_total") else "gauge", key, help, roles)


# First match wins: a role's own families come before the ones of any role.
FAMILIES: tuple[Family, ...] = (
    # actor (actors/actor.py heartbeat)
    _f("parley_actor_tasks_total", r"tasks", "Tasks taken and played to the end.", "actor"),
    _f("parley_actor_trajectories_total", r"trajectories", "Trajectories published to TRAJ.", "actor"),
    _f(
        "parley_actor_duplicate_trajectories_total",
        r"duplicates",
        "Trajectories TRAJ already held (a redelivery).",
        "actor",
    ),
    _f(
        "parley_actor_assistant_tokens_total",
        r"assistant_tokens",
        "Policy tokens generated in published trajectories.",
        "actor",
    ),
    _f(
        "parley_actor_sim_fallbacks_total",
        r"sim_fallbacks",
        "User turns the simulator answered with its fallback.",
        "actor",
    ),
    _f("parley_actor_sim_waits_total", r"sim_waits", "Waits for an unreachable simulator service.", "actor"),
    _f(
        "parley_actor_abandoned_stale_total",
        r"abandoned_stale",
        "Conversations stopped early because the learner could no longer train their group.",
        "actor",
    ),
    _f(
        "parley_actor_refused_versions",
        r"refused_versions",
        "Weight versions this actor refused (bad blob, failed load).",
        "actor",
    ),
    _f(
        "parley_actor_weights_announced_version",
        r"weights\.announced",
        "The weight version the learner announces now.",
        "actor",
    ),
    _f("parley_actor_version_lag", r"weights\.lag", "Announced version minus the version served.", "actor"),
    _f(
        "parley_actor_engine_preemptions_total",
        r"engine\.preemptions",
        "Requests the actor's vLLM engine preempted for lack of KV cache (each recomputes its prefix).",
        "actor",
    ),
    _f(
        "parley_actor_engine_prompt_tokens_total",
        r"engine\.prompt_tokens",
        "Prompt tokens of the requests the actor's vLLM engine finished.",
        "actor",
    ),
    _f(
        "parley_actor_engine_cached_tokens_total",
        r"engine\.cached_tokens",
        "Of those, the tokens vLLM took from its prefix cache (no prefill).",
        "actor",
    ),
    _f(
        "parley_actor_engine_stale_cached_tokens_total",
        r"engine\.stale_cached_tokens",
        "Of those, the tokens whose KV older weights computed ([actor.engine] prefix_cache_across_versions).",
        "actor",
    ),
    _f(
        "parley_actor_engine_stale_prefix_requests_total",
        r"engine\.stale_prefix_requests",
        "Requests (turns) generated over a prefix whose KV older weights computed.",
        "actor",
    ),
    _f(
        "parley_actor_phase_sleeps_total",
        r"phase\.sleeps",
        'Times the actor\'s engine went to sleep while the learner stepped ([up] gpu_share = "phased").',
        "actor",
    ),
    _f("parley_actor_phase_wakes_total", r"phase\.wakes", "Times the actor's engine woke from its sleep.", "actor"),
    _f(
        "parley_actor_phase_asleep_seconds_total",
        r"phase\.asleep_s",
        "Seconds the actor's engine spent asleep or waking.",
        "actor",
    ),
    _f("parley_actor_phase_asleep", r"phase\.asleep", "1 while the actor's engine sleeps or wakes, else 0.", "actor"),
    _f("parley_actor_weights_loads_total", r"weights\.loads", "Weight versions loaded into the engine.", "actor"),
    _f(
        "parley_actor_weights_load_seconds",
        r"weights\.load_s",
        "Seconds the last weight version took to fetch, verify and load.",
        "actor",
    ),
    _f(
        "parley_actor_weights_undecodable_total",
        r"weights\.undecodable",
        "Weights-key values that were no WeightVersion.",
        "actor",
    ),
    # scorer (scorer/scorer.py heartbeat)
    _f("parley_scorer_scored_total", r"scored", "Trajectories scored and stored in SCORED.", "scorer"),
    _f("parley_scorer_duplicates_total", r"duplicate", "Scored messages SCORED already held (a redelivery).", "scorer"),
    _f(
        "parley_scorer_unscorable_total",
        r"unscorable",
        "Trajectories that can never be scored (dead-lettered).",
        "scorer",
    ),
    _f(
        "parley_scorer_abandoned_stale_total",
        r"abandoned_stale",
        "Trajectories their actor stopped early, passed on unjudged.",
        "scorer",
    ),
    _f(
        "parley_scorer_retries_total",
        r"(?P<service>judge|reference)_retry",
        "Trajectories given back for a later try.",
        "scorer",
    ),
    _f(
        "parley_scorer_waits_total", r"(?P<service>judge|reference)_wait", "Waits for an unreachable service.", "scorer"
    ),
    # the judge's reliability (rewards.reliability, [scorer] audit_*)
    _f(
        "parley_scorer_judge_agreement",
        r"judge_audit\.agreement",
        "Share of second verdicts within audit_tolerance of the first (recent window).",
        "scorer",
    ),
    _f(
        "parley_scorer_judge_metric_agreement",
        r"judge_audit\.agreement\.(?P<metric>[a-z0-9_]+)",
        "Judge agreement of one judge metric (recent window).",
        "scorer",
    ),
    _f(
        "parley_scorer_judge_drift",
        r"judge_audit\.drift",
        "Judge agreement on the newest policy version's samples minus on the oldest's.",
        "scorer",
    ),
    _f("parley_scorer_judge_gap", r"judge_audit\.gap", "Mean first minus second verdict (recent window).", "scorer"),
    _f(
        "parley_scorer_judge_flagged",
        r"judge_audit\.flagged",
        "1 while judge agreement is below audit_min_agreement.",
        "scorer",
    ),
    _f("parley_scorer_judge_flags_total", r"judge_audit\.flags", "Times judge agreement fell below the bar.", "scorer"),
    _f("parley_scorer_judge_audits_total", r"judge_audit\.audited", "Trajectories given a second verdict.", "scorer"),
    _f(
        "parley_scorer_judge_audit_failures_total",
        r"judge_audit\.failed",
        "Second verdicts that could not be had (not retried).",
        "scorer",
    ),
    _f(
        "parley_scorer_judge_tie_share",
        r"judge\.tie_share",
        "Share of same-group sample pairs whose judge metrics tie (no advantage between them).",
        "scorer",
    ),
    # call budgets (services/budget.py): the actor's simulator share, the scorer's judge share
    _f(
        "parley_call_budget_calls_total",
        r"(?P<budget>sim_budget|judge_budget)\.calls",
        "Simulator / judge calls let through this process's share of the run's budget.",
        "actor",
        "scorer",
    ),
    _f(
        "parley_call_budget_waits_total",
        r"(?P<budget>sim_budget|judge_budget)\.waits",
        "Calls held back by the budget or the rate limit (they wait, never fail).",
        "actor",
        "scorer",
    ),
    _f(
        "parley_call_budget_wait_seconds_total",
        r"(?P<budget>sim_budget|judge_budget)\.wait_s",
        "Seconds calls waited on the budget or the rate limit.",
        "actor",
        "scorer",
    ),
    _f(
        "parley_call_budget_left",
        r"(?P<budget>sim_budget|judge_budget)\.left",
        "Calls left of this process's share (-1: no count limit).",
        "actor",
        "scorer",
    ),
    # services' backends: an OpenAI-compatible endpoint's usage fields (engines/backend.py)
    _f(
        "parley_backend_calls_total",
        r"backend\.(?P<kind>calls|calls_without_usage)",
        "Endpoint calls answered (and those whose response reported no usage).",
        *SERVICES,
    ),
    _f(
        "parley_backend_tokens_total",
        r"backend\.(?P<kind>prompt|completion)_tokens",
        "Prompt / completion tokens the endpoint reported.",
        *SERVICES,
    ),
    _f("parley_backend_cost_usd_total", r"backend\.usd", "Cost at [sim|judge] usd_per_mtok_in / _out.", *SERVICES),
    # services: sim, judge, reference (engines/service.py and each service's handler)
    _f(
        "parley_service_requests_total",
        r"(?P<outcome>served|shed|expired|repeated|joined|id_mismatch|errors|late|withdrawn|cancelled)",
        "Requests by outcome (engines/service.py; cancelled: computations cut once every requester withdrew).",
        *SERVICES,
    ),
    _f("parley_service_latency_seconds", r"latency_s", "Recent mean seconds to answer a request.", *SERVICES),
    _f("parley_service_bad_requests_total", r"bad_request", "Requests that did not decode.", *SERVICES),
    _f("parley_sim_fallbacks_total", r"fallback", "Simulator replies replaced by the fallback message.", "sim"),
    _f("parley_sim_malformed_total", r"malformed", "Simulator generations that were malformed.", "sim"),
    _f("parley_judge_ops_total", r"(?P<op>[a-z0-9_]+)\.(?P<result>ok|failed)", "Judge operations by result.", "judge"),
    _f(
        "parley_reference_replies_total",
        r"(?P<result>ok|refused)",
        "Reference log-prob replies by result.",
        "reference",
    ),
    _f("parley_reference_tokens_total", r"tokens", "Tokens whose reference log-probs were computed.", "reference"),
    # learner (learner/service.py heartbeat, learner.stepper.live_counters)
    _f("parley_learner_step", r"step", "Optimizer steps done (the latest policy version).", "learner"),
    _f("parley_learner_trained_tokens_total", r"train\.tokens_total", "Tokens trained on by this process.", "learner"),
    _f("parley_learner_step_seconds", r"train\.step_s", "Seconds of the last optimizer step.", "learner"),
    _f("parley_learner_wait_seconds", r"train\.wait_s", "Seconds the last step waited for its groups.", "learner"),
    _f("parley_learner_step_tokens", r"train\.tokens", "Tokens in the last step.", "learner"),
    _f("parley_learner_loss", r"train\.loss", "Loss of the last step.", "learner"),
    _f("parley_learner_kl", r"train\.kl", "Mean KL to the reference in the last step.", "learner"),
    _f("parley_learner_grad_norm", r"train\.grad_norm", "Gradient norm of the last step.", "learner"),
    _f(
        "parley_learner_logp_mismatch",
        r"train\.logp_mismatch",
        "Last step's mean |learner - behaviour| token log-prob (nats).",
        "learner",
    ),
    _f(
        "parley_learner_behaviour_gap",
        r"train\.behaviour_gap",
        "1 when the last step's logp_mismatch exceeded [learner] behaviour_gap_alarm.",
        "learner",
    ),
    _f("parley_learner_checkpoint_seconds", r"train\.checkpoint_s", "Seconds the last checkpoint took.", "learner"),
    _f(
        "parley_learner_weights_publish_seconds",
        r"train\.publish_s",
        "Seconds the last publication held the step (the copy off the GPU, and the file for an eval).",
        "learner",
    ),
    _f(
        "parley_learner_reward",
        r"reward\.(?P<term>[^.]+)",
        "Last step's mean of each weighted reward term (term=total: the reward).",
        "learner",
    ),
    _f(
        "parley_learner_reward_group_std",
        r"reward\.(?P<term>[^.]+)\.group_std",
        "Last step's mean within-group std of each term.",
        "learner",
    ),
    _f(
        "parley_learner_reward_no_signal",
        r"reward\.(?P<term>[^.]+)\.NO_SIGNAL",
        "1 for a term with no within-group signal for many steps.",
        "learner",
    ),
    _f(
        "parley_learner_staleness",
        r"staleness\.(?P<stat>mean|max)",
        "Versions the last step's groups lagged behind.",
        "learner",
    ),
    _f("parley_learner_buffered_groups", r"buffered_groups", "Groups buffered, complete or not.", "learner"),
    _f(
        "parley_learner_pending_acks", r"pending_acks", "Scored messages held until the ledger records them.", "learner"
    ),
    _f(
        "parley_learner_scored_total", r"scored\.(?P<result>[a-z_]+)", "Scored messages taken in, by result.", "learner"
    ),
    _f(
        "parley_learner_group_fates_total",
        r"groups\.(?P<kind>[a-z_]+)",
        "Groups that left the buffer untrained, by kind.",
        "learner",
    ),
    _f(
        "parley_learner_groups_total",
        r"(?P<outcome>trained|corrected|late|duplicate|nonfinite|stale|timeout|dead|deadline|zero_advantage)",
        "Groups by outcome (learner/groups.py).",
        "learner",
    ),
    _f(
        "parley_learner_steps_skipped_total",
        r"steps\.skipped",
        "Steps refused for a non-finite loss or gradient.",
        "learner",
    ),
    _f(
        "parley_learner_ledger_written_bytes_total", r"ledger\.bytes_written", "Bytes written to the ledger.", "learner"
    ),
    _f(
        "parley_learner_ledger_last_write_bytes",
        r"ledger\.last_write_bytes",
        "Bytes of the last ledger write.",
        "learner",
    ),
    _f("parley_learner_ledger_compactions_total", r"ledger\.compactions", "Ledger compactions.", "learner"),
    _f("parley_learner_weights_publishing", r"weights\.publishing", "1 while a version is being published.", "learner"),
    _f(
        "parley_learner_weights_waiting",
        r"weights\.waiting",
        "1 while a version waits for the one being published.",
        "learner",
    ),
    _f(
        "parley_learner_weights_versions_total",
        r"weights\.(?P<outcome>published|superseded)",
        "Weight versions by outcome.",
        "learner",
    ),
    _f(
        "parley_stream_backlog_ratio",
        r"backlog\.(?P<channel>[a-z]+)",
        "Share of a stream's max_bytes its unconsumed messages fill.",
        "learner",
    ),
    _f(
        "parley_tasks_waiting",
        r"tasks\.waiting",
        "TASKS messages no actor has taken yet (the consumer's pending count: KEDA's signal).",
        "learner",
    ),
    _f("parley_tasks_playing", r"tasks\.playing", "TASKS messages an actor holds and has not finished.", "learner"),
    _f("parley_tasks_unplayed", r"tasks\.unplayed", "Admitted tasks not played yet: waiting + playing.", "learner"),
    _f("parley_learner_eval_queued", r"eval\.queued", "Versions queued for the periodic eval.", "learner"),
    _f("parley_learner_eval_running", r"eval\.running", "The version being evaluated (-1: none).", "learner"),
    _f("parley_learner_eval_version", r"eval\.version", "The last evaluated version.", "learner"),
    _f("parley_learner_eval_failed", r"eval\.failed", "Periodic evals that failed.", "learner"),
    _f(
        "parley_learner_eval",
        r"eval\.(?P<metric>[a-z0-9_]+)",
        "The last evaluated version's mean of each eval column.",
        "learner",
    ),
    # any role
    _f(
        "parley_dead_letters_total",
        r"dead\.(?P<channel>[a-z]+)\.(?P<reason>[a-z_]+)",
        "Messages this process dead-lettered, by the channel they came from and why (protocol/bus.py).",
    ),
    _f(
        "parley_publish_duplicates_total",
        r"duplicate\.(?P<channel>[a-z]+)\.(?P<origin>retry|earlier)",
        "Publishes the server dropped as repeats (Nats-Msg-Id) of this call's own timed-out attempt (retry) "
        "or of a message stored before it (earlier; the learner's feeder re-issues such a task).",
    ),
    _f(
        "parley_in_flight",
        r"in_flight",
        "Work in progress (conversations, trajectories, requests; the learner: admitted tasks).",
    ),
)
# Not from a counter: from the heartbeat's own fields.
STATE = Family("parley_role_state", "gauge", "", "1 for the role's state (starting, ready, busy, stopping).")
VERSION = Family(
    "parley_policy_version", "gauge", "", "The policy version: an actor's served one, the learner's latest."
)
BEAT = Family("parley_heartbeat_timestamp_seconds", "gauge", "", "Unix time of the role's last heartbeat.")
OTHER = Family("parley_heartbeat_value", "gauge", r"(?P<key>.+)", "A heartbeat counter no family above names.")


def exposed_names() -> set[str]:
    """Every metric name a scrape can show."""
    return {f.name for f in (*FAMILIES, STATE, VERSION, BEAT, OTHER)}


def family_of(role: str, key: str) -> tuple[Family, dict[str, str]]:
    """The family heartbeat counter `key` of `role` belongs to, and its labels beyond LABELS."""
    for f in FAMILIES:
        if (not f.roles or role in f.roles) and (m := _compiled(f.key).fullmatch(key)):
            return f, m.groupdict()
    return OTHER, {"key": key}


_PATTERNS: dict[str, re.Pattern] = {}


def _compiled(key: str) -> re.Pattern:
    if key not in _PATTERNS:
        _PATTERNS[key] = re.compile(key)
    return _PATTERNS[key]


class HeartbeatCollector:
    """A prometheus-client collector over the latest heartbeat of each (role, id) this process sent."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, str], tuple[str, object]] = {}  # (role, id) -> (run, Heartbeat)
        # set on SIGTERM/SIGINT (runtime.process): the roles drain and their heartbeats stop while the
        # learner may still upload for minutes; live, not ready, until the process exits
        self.stopping = False

    def begin_stop(self) -> None:
        self.stopping = True

    def observe(self, run: str, hb) -> None:
        """protocol.status's observer: called in the event loop for every heartbeat sent."""
        with self._lock:
            self._latest[(hb.role, hb.id)] = (run, hb)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            beats = list(self._latest.values())
        out: dict[str, object] = {}

        def add(f: Family, base: list[str], extra: dict[str, str], value: float) -> None:
            if f.name not in out:
                cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
                out[f.name] = cls(
                    f.name.removesuffix("_total") if f.kind == "counter" else f.name, f.help, labels=list(f.labels)
                )
            out[f.name].add_metric(base + [extra[k] for k in f.labels[len(LABELS) :]], float(value))

        for run, hb in beats:
            base = [run, hb.role, hb.id]
            out.setdefault(STATE.name, GaugeMetricFamily(STATE.name, STATE.help, labels=[*LABELS, "state"]))
            out[STATE.name].add_metric([*base, hb.state], 1.0)
            add(BEAT, base, {}, hb.created)
            if hb.version >= 0:
                add(VERSION, base, {}, hb.version)
            for key, value in hb.counters.items():
                f, extra = family_of(hb.role, key)
                add(f, base, extra, value)
        yield from out.values()

    def health(self, now: float | None = None) -> tuple[bool, bool, str]:
        """(live, ready, one line per (role, id)) from the latest heartbeats. Ready: every role this
        process announced has connected to NATS (its first heartbeat, "starting", goes out over the
        connection) and started its work loop (a state past "starting"), and none is "stopping".
        Live: no role that reached its work loop has been silent for STALE_S (its event loop is stuck);
        a role still starting may block while it loads its model, so it is live."""
        import time

        now = time.time() if now is None else now
        with self._lock:
            beats = sorted(self._latest.items())
        if self.stopping:
            return True, False, "stopping: draining after a stop signal\n"
        if not beats:
            return True, False, "no heartbeat yet: not connected to NATS\n"
        live, ready, lines = True, True, []
        for (role, ident), (_, hb) in beats:
            age = now - hb.created
            stuck = hb.state not in NOT_STARTED and age > STALE_S
            live = live and not stuck
            ready = ready and hb.state not in NOT_STARTED and hb.state != "stopping" and not stuck
            lines.append(f"{role} {ident}: {hb.state}, last heartbeat {age:.1f}s ago{' (stuck)' if stuck else ''}")
        return live, ready, "".join(line + "\n" for line in lines)


# Heartbeat states before a role's work loop runs, and how long a running role may stay silent (its
# heartbeat goes every 2 s, protocol.status) before /healthz calls the process stuck.
NOT_STARTED = ("starting",)
STALE_S = 120.0

COLLECTOR = HeartbeatCollector()


def app(registry, collector: HeartbeatCollector = COLLECTOR):
    """The WSGI app of a role's endpoint: /healthz (liveness), /readyz (readiness), anything else the
    Prometheus exposition of `registry` (as prometheus_client's own server does)."""
    from prometheus_client import make_wsgi_app

    metrics = make_wsgi_app(registry)

    def serve(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path not in ("/healthz", "/readyz"):
            return metrics(environ, start_response)
        live, ready, detail = collector.health()
        ok = live if path == "/healthz" else ready
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
        return [detail.encode()]

    return serve


def serve(port: int, host: str = "0.0.0.0", collector: HeartbeatCollector = COLLECTOR) -> int:
    """Serve /metrics, /healthz and /readyz on `host`:`port` (0 = a free port) from a daemon thread;
    returns the port. From now on every heartbeat this process sends is also its metrics and health."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import CollectorRegistry

    from parley.protocol import status

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, format, *args):  # probes every few seconds would flood the role's log
            pass

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server = make_server(host, port, app(registry, collector), server_class=Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="parley-metrics", daemon=True).start()
    if collector.observe not in status.OBSERVERS:
        status.OBSERVERS.append(collector.observe)
    return server.server_port
