"""Who plays the user in the actor: the environment's programmatic user in-process (hidden_goal,
played here through the actor's own conversation loop), else the simulator service's client."""

from __future__ import annotations

import asyncio

from parley.actors.actor import user_client
from parley.config.actor import ActorConfig
from parley.config.run import load_config
from parley.environments.base import LocalUser
from parley.environments.hidden_goal import Goal
from parley.rollout.conversation import PolicySettings, run_conversation
from parley.services.sim.client import SimClient
from tests.unit.test_env_hidden_goal import ScriptedEngine  # the scripted policy double

PIZZA = Goal("pizza", (("size", "large"), ("crust", "thin"), ("topping", "ham")))


def test_collabllm_asks_the_simulator_service():
    cfg = load_config()
    assert isinstance(user_client(cfg.env.load(), None, cfg.actor), SimClient)


def test_hidden_goal_plays_its_user_in_the_actor(tiny_model):
    from transformers import AutoTokenizer

    cfg = load_config(None, ["env.name=hidden_goal", "rollout.max_new_turns=8"])
    env = cfg.env.load()
    user = user_client(env, None, ActorConfig())  # no connection: nothing is asked over NATS
    assert isinstance(user, LocalUser)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = env.tasks.task(PIZZA, run="r", task_id="r-g000000", n=2, rollout=cfg.rollout, seed=1, version=0)
    engine = ScriptedEngine(
        tok, ["Which size and crust?", "And the topping?", "FINAL: size=large, crust=thin, topping=ham"]
    )
    traj = asyncio.run(
        run_conversation(engine, user, task, 0, lambda: 0, tokenizer=tok, policy=PolicySettings(max_model_len=2048))
    )
    assert traj.terminated == "sim_done" and traj.sim_prompt == "hidden_goal"
    assert [m.content for m in traj.messages if m.role == "user"] == [
        "I want to order a pizza.",
        "size: large, crust: thin.",
        "topping: ham.",
    ]
    assert env.reward.evaluate(traj) == {"goal_match": 1.0, "exact": 1.0, "assistant_turns": 3.0}


def test_the_actor_watches_staleness_only_where_the_learner_drops_stale_groups():
    """A task's samples share one StaleWatch reading the announced version, for training tasks under
    stale_policy "drop"; eval tasks, stale_policy "correct" (a stale group is still trained) and
    [actor] abandon_stale = false play every conversation to its end."""
    from types import SimpleNamespace

    from parley.actors.actor import Actor
    from parley.protocol.messages import Task

    announcement = asyncio.Event()

    def watch(*sets, split="train", announced=3):
        follower = SimpleNamespace(announced=announced, announcement=lambda: announcement)
        me = SimpleNamespace(cfg=load_config(None, list(sets)), follower=follower)
        return Actor.stale_watch(me, Task(task_id="t", run="r", item_id="i", n=2, split=split))

    w = watch("learner.max_staleness=1")
    assert w is not None and w.max_staleness == 1 and w.announced() == 3
    assert announcement in w.events()  # a running call is cut as the follower's announcement arrives
    w.saw(2)
    assert w.why() == ""
    w.saw(1)
    assert "lags the announced version 3 by 2 > max_staleness 1" in w.why()
    assert watch(split="eval") is None
    assert watch('learner.stale_policy="correct"') is None
    assert watch("actor.abandon_stale=false") is None


def test_a_tasks_log_line_splits_its_samples_play_into_engine_simulator_and_the_rest():
    """The tail of the actor's "samples stored in" line: the mean over the task's samples of their
    trajectory timings, the rest being play less generate and simulator (bench/peer_compare.py reads it)."""
    from parley.actors.actor import sample_split

    timings = [{"generate": 0.4, "sim": 0.1, "total": 0.6}, {"generate": 0.2, "sim": 0.1, "total": 0.4}]
    assert sample_split(timings) == "a sample's mean: play 0.500s, generate 0.300s, simulator 0.100s, rest 0.100s"
    assert sample_split([]) == "no samples"
