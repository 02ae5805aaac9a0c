"""Which failed children a supervisor starts again, as the run config says ([up] restarts and
restart_window_s): `parley up` (deploy/up.py) and the eval fleet (evaluation/fleet.py) build their
runtime.supervisor.RestartPolicy here, so both leave out the same roles for the same reasons.
"""

from __future__ import annotations

from collections.abc import Iterable

from parley.config.run import RunConfig
from parley.runtime.supervisor import RestartPolicy


def restart_policy(cfg: RunConfig, roles: Iterable[str] = RestartPolicy.roles) -> RestartPolicy:
    """The policy of [up] restarts / restart_window_s over `roles`, less the actors while [rollout]
    sim_call_budget is set and the scorers while judge_call_budget is: each such process holds a share
    of the budget from its start (services/budget.py), and one started again would spend a fresh share,
    past the run's budget. A role left out so says why in the policy's `held`."""
    ro, kept, held = cfg.rollout, set(roles), []
    for role, key, budget in (
        ("actor", "sim_call_budget", ro.sim_call_budget),
        ("scorer", "judge_call_budget", ro.judge_call_budget),
    ):
        if budget and role in kept:
            kept.discard(role)
            held.append(
                (
                    role,
                    f"[rollout] {key} = {budget} is set, and each {role} started again would spend a fresh share of it",
                )
            )
    return RestartPolicy(
        limit=cfg.up.restarts, window_s=cfg.up.restart_window_s, roles=frozenset(kept), held=tuple(held)
    )
