"""vLLM preemptions counted: the stat logger engines.engine.counting_logger builds is a real vLLM
StatLoggerBase, and the IterationStats vLLM fills from its PREEMPTED events move the engine's count; the
actor's heartbeat carries it, and the metrics export names it. No engine is started (vLLM's stats
classes only); the per-LoRA request states are a test double."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from parley.actors.actor import Actor
from parley.engines.engine import EngineCounts, counting_logger
from parley.runtime.metrics import family_of


class LoraStatesDouble:
    """Test double for vLLM's LoRARequestStates: IterationStats.update_from_events tells it of every
    request's state change, which this counter ignores."""

    def request_waiting(self, req_id, lora_name):
        pass

    def request_running(self, req_id, lora_name):
        pass


def iteration(*events: str):
    """vLLM's own IterationStats after one request's engine-core events of these types."""
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType
    from vllm.v1.metrics.stats import IterationStats, RequestStateStats

    stats = IterationStats()
    evs = [EngineCoreEvent.new_event(getattr(EngineCoreEventType, e)) for e in events]
    stats.update_from_events("r0", evs, False, RequestStateStats(), LoraStatesDouble(), None)
    return stats


def test_the_counting_logger_moves_with_vllms_preempted_events():
    from vllm.v1.metrics.loggers import StatLoggerBase

    counts = EngineCounts()
    cls = counting_logger(counts)
    assert issubclass(cls, StatLoggerBase)
    logger = cls(None, 0)  # vLLM builds it as factory(vllm_config, engine_index)
    logger.log_engine_initialized()
    logger.record(None, iteration("SCHEDULED"))
    assert counts.preemptions == 0
    logger.record(None, iteration("SCHEDULED", "PREEMPTED", "SCHEDULED", "PREEMPTED"))
    logger.record(None, None)  # a batch without outputs
    logger.record(None, iteration("PREEMPTED"), None, 0)  # vLLM passes mm_cache_stats and engine_idx too
    assert counts.preemptions == 3


def test_the_heartbeat_carries_the_count_and_the_metrics_name_it():
    counts = EngineCounts()
    counts.preemptions = 5
    follower = SimpleNamespace(refused=[], announced=2, loaded=[1, 2], load_s=0.1)
    actor = SimpleNamespace(
        counters=Counter(tasks=1),
        follower=follower,
        engine=SimpleNamespace(version=2, counts=counts),
        sim=object(),
        sim_budget=SimpleNamespace(counters=dict),  # no [rollout] sim_call_budget: nothing to count
        in_flight=0,
        state="ready",
        ident="a0",
    )
    beat = Actor.heartbeat(actor)
    assert beat.counters["engine.preemptions"] == 5.0
    family, _ = family_of("actor", "engine.preemptions")
    assert family.name == "parley_actor_engine_preemptions_total" and family.kind == "counter"
    actor.engine = SimpleNamespace(version=2)  # a scripted engine of a test: no scheduler, no count
    assert "engine.preemptions" not in Actor.heartbeat(actor).counters
