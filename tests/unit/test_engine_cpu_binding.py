"""The CPU binding parley's vLLM engines start with: vLLM's "auto" pins every engine of a 2-core
machine to core 0 (the other core reserved for the engine's scheduler), so `parley up`'s engines
shared one core; parley leaves placement to the OS unless the operator chose a binding."""

from __future__ import annotations

from engines.engine import CPU_BIND_ENV, share_cpu_cores


def test_engines_are_not_pinned_unless_the_operator_pins_them():
    environ: dict[str, str] = {}
    assert share_cpu_cores(environ) == "nobind" and environ == {CPU_BIND_ENV: "nobind"}
    chosen = {CPU_BIND_ENV: "0-1"}
    assert share_cpu_cores(chosen) == "0-1" and chosen == {CPU_BIND_ENV: "0-1"}
