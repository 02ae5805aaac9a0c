"""The CPU binding parley's vLLM engines start with: vLLM's "auto" pins every engine of a 2-core
machine to core 0 (the other core reserved for the engine's scheduler), so `parley up`'s engines
shared one core; parley leaves placement to the OS unless the operator chose a binding."""

from __future__ import annotations

from parley.engines.engine import CPU_BIND_ENV, share_cpu_cores


def test_engines_are_not_pinned_unless_the_operator_pins_them():
    environ: dict[str, str] = {}
    assert share_cpu_cores(environ) == "nobind" and environ == {CPU_BIND_ENV: "nobind"}
    chosen = {CPU_BIND_ENV: "0-1"}
    assert share_cpu_cores(chosen) == "0-1" and chosen == {CPU_BIND_ENV: "0-1"}


def test_unbound_engines_split_the_cores_the_launcher_says_they_share():
    from parley.engines.engine import CPU_ENGINES_ENV

    three_on_two = {CPU_ENGINES_ENV: "3"}
    share_cpu_cores(three_on_two, cpus=2)
    assert three_on_two["OMP_NUM_THREADS"] == "1"  # not 2 each: six spinning threads on two cores
    two_on_eight = {CPU_ENGINES_ENV: "2"}
    share_cpu_cores(two_on_eight, cpus=8)
    assert two_on_eight["OMP_NUM_THREADS"] == "4"
    operator = {CPU_ENGINES_ENV: "3", "OMP_NUM_THREADS": "2"}
    share_cpu_cores(operator, cpus=2)
    assert operator["OMP_NUM_THREADS"] == "2"  # the operator's choice stands
    pinned = {CPU_ENGINES_ENV: "3", CPU_BIND_ENV: "0"}
    share_cpu_cores(pinned, cpus=2)
    assert "OMP_NUM_THREADS" not in pinned  # vLLM sizes a bound engine's threads by its cores
    alone: dict[str, str] = {}
    share_cpu_cores(alone, cpus=2)
    assert "OMP_NUM_THREADS" not in alone  # started by hand: the engine has the machine


def test_a_bad_engine_count_names_the_variable():
    import pytest

    from parley.engines.engine import CPU_ENGINES_ENV

    for bad in ("0", "two"):
        with pytest.raises(ValueError, match=CPU_ENGINES_ENV):
            share_cpu_cores({CPU_ENGINES_ENV: bad}, cpus=2)


def test_parley_up_counts_the_engines_it_runs_at_once(tmp_path):
    from parley.config.run import load_config
    from parley.deploy.up import cpu_engines, plan_children
    from parley.runtime.supervisor import Supervisor

    sup = Supervisor(tmp_path)

    def count(overrides):
        cfg = load_config(None, overrides)
        return cpu_engines(cfg, plan_children(cfg, sup, tmp_path / "c.toml"))

    assert count([]) == 3  # the embedded default: the actor's, the services' (sim + judge share one), the eval child's
    assert count(["up.actors=2", "learner.eval_every=0"]) == 3
    assert count(['judge.engine.model="tiny"']) == 4  # sim and judge on different models: one engine each
    assert count(['env.name="hidden_goal"']) == 2  # no simulator, no judge


def test_an_unbound_single_worker_engine_runs_its_worker_in_the_engine_core():
    from parley.engines.engine import IN_CORE_EXECUTOR, cpu_executor

    assert cpu_executor("nobind", 1) == IN_CORE_EXECUTOR  # no binding to set up: no worker process of its own
    assert cpu_executor("nobind", 2) is None  # several workers: vLLM's multiprocess executor
    assert cpu_executor("0-1", 1) is None  # the operator's binding needs the worker process vLLM sets up
    assert cpu_executor("auto", 1) is None
