"""The learner with the run's environment (no NATS: construction only, with a trainer test double):
its feeder builds the environment's tasks from the environment's split, the run records which
environment it trains (RUN_DIR/environment.json) and a resume under another one is refused; the
leakage guard refuses the kinds the environment calls leaks."""

from __future__ import annotations

import json

import pytest

from parley.config.run import load_config
from parley.environments import hidden_goal
from parley.evaluation.leakage import OVERLAP_FILE, LeakageError, guard_environment
from parley.learner import checkpoint as ckpt
from parley.learner import envrecord
from parley.learner.resume import LearnerStateError
from parley.learner.service import Learner, check_leakage
from tests.driver_double import DriverDouble


class TrainerDouble(DriverDouble):
    """Stands in for learner.ranks.Driver: records calls, makes the checkpoint directory it is asked for."""

    def __init__(self):
        self.calls = []

    def __call__(self, op, *args):
        self.calls.append(op)
        if op == "save_checkpoint":
            (args[0] / args[1]).mkdir(parents=True, exist_ok=True)


def _cfg(run_dir, *overrides):
    cfg = load_config(None, ["learner.eval_every=0", f'run.dir="{run_dir}"', *overrides])
    return cfg


def _base(tmp_path):
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text('{"vocab_size": 16}')
    return base


def _learner(cfg, tmp_path, resume=False):
    return Learner(cfg, None, None, TrainerDouble(), model_dir=_base(tmp_path), resume=resume, steps=1)


HIDDEN = ("env.name=hidden_goal", "env.options={n_items = 12, seed = 3}")


def test_the_feeder_issues_the_environments_tasks_and_the_run_records_it(tmp_path):
    cfg = _cfg(tmp_path / "run", *HIDDEN)
    learner = _learner(cfg, tmp_path)
    train, held = hidden_goal.environment(n_items=12, seed=3).tasks.train_eval(cfg.data)
    tasks = [learner.feeder.task(i) for i in range(len(train))]
    assert {t.item_id for t in tasks} == {g.item_id for g in train}  # one epoch: every training goal, no held-out one
    openings = {d.opening for d in hidden_goal.world().domains.values()}
    assert all(
        t.sim_prompt == "hidden_goal" and [m.content for m in t.prefix] in ([o] for o in openings) for t in tasks
    )
    assert hidden_goal.parse_hidden(tasks[0].reference)[1]  # the hidden goal travels as the reference
    record = json.loads((tmp_path / "run" / "environment.json").read_text())
    assert {k: record[k] for k in ("name", "distribution", "entry_point", "options")} == {
        "name": "hidden_goal",
        "distribution": "parley-grpo",
        "entry_point": "parley.environments.hidden_goal:environment",
        "options": {"n_items": 12, "seed": 3},
    }
    assert record["version"]


@pytest.mark.parametrize(
    "changed,needle",
    [
        (("env.name=collabllm_medium",), r"name 'hidden_goal' -> 'collabllm_medium'"),
        (
            ("env.name=hidden_goal", "env.options={n_items = 13, seed = 3}"),
            r"options \{'n_items': 12, 'seed': 3\} -> "
            r"\{'n_items': 13, 'seed': 3\}",
        ),
    ],
)
def test_resume_under_another_environment_is_refused(tmp_path, changed, needle):
    run_dir = tmp_path / "run"
    _learner(_cfg(run_dir, *HIDDEN), tmp_path)
    ckpt.write_state(run_dir, ckpt.LearnerState())  # a ledger, as after a first flush
    with pytest.raises(LearnerStateError, match=f"--resume: the run started with environment 'hidden_goal'.*{needle}"):
        _learner(_cfg(run_dir, *changed), tmp_path, resume=True)
    assert _learner(_cfg(run_dir, *HIDDEN), tmp_path, resume=True).env.name == "hidden_goal"  # the same one resumes


def test_a_run_from_before_environments_were_recorded_resumes_as_collabllm_only(tmp_path):
    run_dir = tmp_path / "run"
    ckpt.write_state(run_dir, ckpt.LearnerState())
    with pytest.raises(LearnerStateError, match=r"environment.json is missing, so this run trained 'collabllm_medium'"):
        _learner(_cfg(run_dir, *HIDDEN), tmp_path, resume=True)
    _learner(_cfg(run_dir), tmp_path, resume=True)
    assert envrecord.read(run_dir)["name"] == "collabllm_medium"


def test_the_leakage_guard_refuses_the_environments_leaking_kind(tmp_path):
    env = hidden_goal.environment(n_items=6, seed=0)
    goals = hidden_goal.generate(6, 0)
    train, held = goals[:4], goals[3:]  # goals[3] on both sides
    with pytest.raises(
        LeakageError,
        match=rf"share 1 goal targets \(train {goals[3].item_id} = eval {goals[3].item_id}\)"
        r".*--allow-overlap",
    ):
        guard_environment(env.tasks, train, held, False, tmp_path)
    assert not (tmp_path / OVERLAP_FILE).exists()
    guard_environment(env.tasks, train, held, True, tmp_path)
    saved = json.loads((tmp_path / OVERLAP_FILE).read_text())
    assert saved["overlap"] == {"goal": [[goals[3].item_id, goals[3].item_id]]} and saved["leaking_kinds"] == ["goal"]


def test_check_leakage_splits_with_the_environment(tmp_path):
    assert check_leakage(_cfg(tmp_path / "run", *HIDDEN)) is None
    # hidden_goal's goals come from its options: a data file is refused with the fix
    problem = check_leakage(_cfg(tmp_path / "run", *HIDDEN, 'data.path="/tmp/x.jsonl"'))
    assert "draws its goals from a seed" in problem and "set [env] options instead" in problem
