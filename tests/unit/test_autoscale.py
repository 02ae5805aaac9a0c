"""deploy.autoscale: the actor pool's decisions (KEDA's rule: ceil(waiting / per_actor) within the
bounds; one start at a time; removal only after the backlog wanted fewer for down_after_s) and
`parley up --actors auto`'s config."""

from __future__ import annotations

import pytest

from parley.config.run import ConfigError, load_config
from parley.deploy.autoscale import ActorPool, ScalePolicy


def test_want_follows_the_backlog_within_the_bounds():
    p = ScalePolicy(low=1, high=3, per_actor=4, down_after_s=10.0)
    assert [p.want(w) for w in (0, 1, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 3]


async def test_pool_adds_one_at_a_time_and_removes_after_the_delay():
    spawned, retired = [], []

    async def retire(name):
        retired.append(name)

    pool = ActorPool(ScalePolicy(1, 3, 2, down_after_s=5.0), spawned.append, retire, ["actor-0"])
    assert await pool.step(10, {"actor-0"}, now=0.0) == pool._say("added actor-1", 10, 3)
    assert await pool.step(10, {"actor-0"}, now=1.0) == ""  # actor-1 still starting
    assert (await pool.step(10, {"actor-0", "actor-1"}, now=2.0)).startswith("added actor-2")
    assert await pool.step(0, {"actor-0", "actor-1", "actor-2"}, now=3.0) == ""  # fewer wanted: wait
    assert await pool.step(0, set(), now=7.9) == ""
    assert (await pool.step(0, set(), now=8.0)).startswith("removed actor-2")
    assert await pool.step(0, set(), now=9.0) == ""  # the next removal waits as long again
    assert (await pool.step(0, set(), now=13.0)).startswith("removed actor-1")
    assert await pool.step(0, set(), now=30.0) == ""  # at the lower bound
    assert spawned == ["actor-1", "actor-2"] and retired == ["actor-2", "actor-1"] and pool.names == ["actor-0"]


def test_up_config_of_auto_actors():
    cfg = load_config(None, ["up.autoscale=true", "up.min_actors=2", "up.max_actors=5"])
    assert (cfg.up.first_actors(), cfg.up.most_actors()) == (2, 5)
    assert ScalePolicy.of(cfg).per_actor == max(1, cfg.actor.concurrency // cfg.rollout.n)
    with pytest.raises(ConfigError, match="min_actors=3 > up.max_actors=2"):
        load_config(None, ["up.min_actors=3", "up.max_actors=2"])


def test_up_cli_takes_actors_auto_and_its_bounds():
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    out = CliRunner().invoke(app, ["up", "--actors", "auto", "--min-actors", "1", "--max-actors", "3", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "autoscale = true" in out.output and "max_actors = 3" in out.output
    bad = CliRunner().invoke(app, ["up", "--actors", "many", "--dry-run"])
    assert bad.exit_code == 2 and 'give a number or "auto"' in bad.output
