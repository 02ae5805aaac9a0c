"""An environment from outside the repository: pip installs the tiny package in
tests/data/parley_env_parrot (into a directory of this test's, never the shared environment),
and parley finds it by name through its `parley.environments` entry point, records its
distribution and version, and plays and scores a conversation of it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

from parley.config.learner import DataConfig, RolloutConfig
from parley.environments import registry
from parley.environments.base import Conversation, LocalUser
from parley.protocol.messages import ChatMessage, SimRequest

PACKAGE = Path(__file__).resolve().parents[1] / "data" / "parley_env_parrot"


def test_an_installed_third_party_environment_resolves_by_name(tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src)  # pip builds in the source tree; tests/data stays as committed
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--quiet",
            "--target",
            str(target),
            str(src),
        ],
        check=False,
        capture_output=True,
        text=True,  # a failure is shown by the assert below
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parrot" not in registry.names()  # not found before its directory is on the path
    monkeypatch.syspath_prepend(str(target))

    assert "parrot" in registry.names()
    env = registry.load("parrot")
    assert registry.record("parrot").as_dict() == {
        "name": "parrot",
        "distribution": "parley-parrot",
        "version": "0.3.1",
        "entry_point": "parley_parrot:ENVIRONMENT",
    }

    train, held = env.tasks.train_eval(DataConfig(eval_fraction=0.25))
    assert len(train) + len(held) == 36 and not {p.item_id for p in train} & {p.item_id for p in held}
    task = env.tasks.task(held[0], run="r", task_id="r-g000000", n=2, rollout=RolloutConfig(), seed=0, version=0)

    # the user side as the actor would run it: the simulator client's interface, in-process
    said = [*task.prefix, ChatMessage("assistant", held[0].item_id.capitalize() + ".")]
    reply = asyncio.run(
        LocalUser(env.user).ask(SimRequest(prompt=task.sim_prompt, messages=said, reference=task.reference))
    )
    assert reply.done and reply.model == "programmatic:parrot"
    assert env.reward.evaluate(Conversation(messages=said, reference=task.reference)) == {
        "echo": 1.0,
        "similarity": 1.0,
    }
