"""Unit tests of the eval runner's setup (no engine): condition parsing, tasks shared by every condition."""

import pytest

from parley.evaluation.runner import EvalSettings, make_tasks, parse_condition
from parley.tasks.data import load_items


def test_parse_condition_forms(tmp_path):
    base = parse_condition("base=smol")
    assert (base.name, base.model, base.system_prompt) == ("base", "smol", "")
    pro = parse_condition("proactive=smol,system_prompt=proactive")
    assert pro.system_prompt and pro.system_prompt_file == "proactive"
    own = tmp_path / "sys.txt"
    own.write_text("Ask one question at a time.\n")
    step = parse_condition(f"step50=runs/x/ckpt/v50, system_prompt={own}")
    assert (step.model, step.system_prompt) == ("runs/x/ckpt/v50", "Ask one question at a time.")


@pytest.mark.parametrize(
    "bad,match",
    [
        ("base", "must look like name=MODEL_OR_CHECKPOINT"),
        ("=smol", "must look like"),
        ("a b=smol", "may hold only letters"),
        ("base=smol,temperature=0", "option 'temperature=0' not understood"),
        ("base=smol,system_prompt=missing", "neither a file nor a bundled prompt"),
    ],
)
def test_parse_condition_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_condition(bad)


def test_tasks_start_from_scratch_with_condition_free_ids():
    items = load_items("bundled")[:3]
    tasks = make_tasks(items, EvalSettings(seeds=2, assistant_max_tokens=64, max_new_turns=6))
    assert [t.task_id for t in tasks[:2]] == [f"eval/{items[0].item_id}/0", f"eval/{items[0].item_id}/1"]
    assert all(t.prefix == [] and t.system_prompt == "" and t.split == "eval" and t.n == 1 for t in tasks)
    assert {(t.max_tokens, t.max_new_turns, t.sim_prompt) for t in tasks} == {(64, 6, "lazy_full")}
    with pytest.raises(ValueError, match="max_new_turns=1"):
        EvalSettings(max_new_turns=1)


def test_eval_items_against_training_data(tmp_path):
    from parley.config.learner import DataConfig
    from parley.evaluation.leakage import LeakageError, guard_overlap
    from parley.evaluation.runner import eval_items

    train, held = eval_items(DataConfig(eval_fraction=0.25), None)  # the config's per-reference split
    assert len(train) + len(held) == 150 and len(held) == 38  # round(150 x 0.25)
    guard_overlap(train, held, allow=False, run_dir=tmp_path)
    train, held = eval_items(DataConfig(eval_fraction=0.25), "bundled")  # the whole file, against its train side
    assert len(held) == 150
    with pytest.raises(LeakageError, match="share 112 reference targets"):
        guard_overlap(train, held, allow=False, run_dir=tmp_path)
