"""[*.engine] start_method (engines.engine.start_method_choice / apply_start_method): how vLLM starts an
engine's engine-core process. "fork" spares the engine core its own import of torch and vLLM; "spawn"
is for a process that holds several engines; "env" (the default) leaves VLLM_WORKER_MULTIPROC_METHOD
as it is. Decided before the engine is made, without starting one."""

from __future__ import annotations

import logging

import pytest

from parley.config.run import load_config
from parley.engines.engine import START_METHOD_ENV, apply_start_method, start_method_choice
from parley.errors import ConfigError


def test_the_setting_is_checked_at_config_load_with_the_value_and_the_choices():
    assert load_config(None, []).actor.engine.start_method == "env"  # the default: today's behaviour
    assert load_config(None, ['actor.engine.start_method="fork"']).actor.engine.start_method == "fork"
    with pytest.raises(ConfigError) as e:
        load_config(None, ['actor.engine.start_method="forkk"'])
    assert "actor.engine.start_method = 'forkk'" in str(e.value) and "'env', 'fork', 'spawn'" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("setting", "current", "value", "method", "why"),
    [
        ("env", None, None, "fork", "vLLM's default"),
        ("env", "spawn", None, "spawn", f"{START_METHOD_ENV}=spawn"),
        ("fork", "spawn", "fork", "fork", 'start_method = "fork"'),
        ("spawn", None, "spawn", "spawn", 'start_method = "spawn"'),
    ],
)
def test_on_a_gpu_the_setting_decides_the_variable(setting, current, value, method, why):
    choice = start_method_choice(setting, current, cuda_initialized=False, cpu=False)
    assert (choice.value, choice.method, choice.warn) == (value, method, False)
    assert choice.line == f"engine core start method: {method} ({why})"


def test_fork_where_cuda_is_initialized_is_refused_naming_the_setting():
    with pytest.raises(ConfigError, match=r'start_method = "fork".*CUDA is already initialized.*"spawn"') as e:
        start_method_choice("fork", None, cuda_initialized=True, cpu=False)
    assert "\n" not in str(e.value)
    # left to the variable, vLLM's own switch to spawn is said aloud
    env = start_method_choice("env", None, cuda_initialized=True, cpu=False)
    assert (env.value, env.method, env.warn) == (None, "spawn", True) and "CUDA is initialized" in env.line


def test_on_the_cpu_platform_fork_is_noted_as_overridden_by_vllm():
    fork = start_method_choice("fork", None, cuda_initialized=False, cpu=True)
    assert (fork.value, fork.method, fork.warn) == ("fork", "spawn", True)
    assert "spawn, not fork" in fork.line and "CPU platform always spawns" in fork.line
    env = start_method_choice("env", None, cuda_initialized=False, cpu=True)
    assert (env.method, env.warn) == ("spawn", False)  # nothing was asked: a note, no warning


def test_an_unknown_value_is_refused_where_it_is_decided_too():
    with pytest.raises(ConfigError, match=r"start_method = 'forkk': expected one of 'env', 'fork', 'spawn'"):
        start_method_choice("forkk", None, cuda_initialized=False, cpu=False)


def test_the_choice_is_applied_to_the_environment_and_logged(caplog):
    environ = {START_METHOD_ENV: "spawn"}
    with caplog.at_level(logging.INFO, logger="parley.engines.engine"):
        choice = apply_start_method("fork", environ)  # this machine: vLLM's CPU platform
    assert environ[START_METHOD_ENV] == "fork" and choice.method == "spawn"
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "always spawns" in caplog.records[0].message
    untouched = {START_METHOD_ENV: "spawn"}
    apply_start_method("env", untouched)
    assert untouched == {START_METHOD_ENV: "spawn"}


def test_a_process_s_later_engines_are_spawned_whatever_the_setting():
    # with fork the second engine of one process failed to initialize CUDA (docs/gpu.md), where vLLM
    # saw no reason to spawn: only a process's first engine (the actor's, the eval child's) forks
    first = start_method_choice("fork", "spawn", cuda_initialized=False, cpu=False, earlier_engines=0)
    second = start_method_choice("fork", "fork", cuda_initialized=False, cpu=False, earlier_engines=1)
    assert (first.value, first.method, first.warn) == ("fork", "fork", False)
    assert (second.value, second.method, second.warn) == ("spawn", "spawn", True)
    assert "started 1 engine(s) before" in second.line
    # "env" and "spawn" are left as they were: the operator's variable decides
    assert start_method_choice("env", "fork", cuda_initialized=False, cpu=False, earlier_engines=1).value is None
