"""The environment interface and the registry: the checks an Environment makes of itself, reward
evaluation, overlap finding, and resolution by name through the `parley.environments` entry points.

The registry reads installed distributions' metadata. `install_dist` writes a distribution's
dist-info (METADATA, entry_points.txt) into a directory put first on sys.path, which is what
`pip install` leaves behind; with pyproject.toml's own table it stands in for reinstalling this
checkout, whose entry points the shared environment's older install does not have yet.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from parley.config.learner import DataConfig
from parley.environments import registry
from parley.environments.base import (
    Conversation,
    EvalProtocol,
    JudgeMetric,
    PureMetric,
    Reward,
    TaskSource,
    find_overlap,
    leaking,
    split_by_key,
)
from parley.protocol.messages import ChatMessage, JudgeReply

ROOT = Path(__file__).resolve().parents[2]


def install_dist(where: Path, monkeypatch, name: str, version: str, entries: dict[str, str]) -> None:
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"[{registry.GROUP}]", *(f"{k} = {v}" for k, v in entries.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(where))


def pyproject_entries() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"][registry.GROUP]


@pytest.fixture
def this_checkout(tmp_path, monkeypatch):
    install_dist(tmp_path / "site", monkeypatch, "parley-grpo", "0.1.0", pyproject_entries())


# ---- registry --------------------------------------------------------------------------------


def test_bundled_environments_resolve_by_name(this_checkout):
    assert {"collabllm_medium", "hidden_goal"} <= set(registry.names())
    for name in ("collabllm_medium", "hidden_goal"):
        env = registry.load(name)
        assert env.name == name
        assert registry.record(name).as_dict() == {
            "name": name,
            "distribution": "parley-grpo",
            "version": "0.1.0",
            "entry_point": pyproject_entries()[name],
        }


def test_options_reach_the_environment(this_checkout):
    small = registry.load("hidden_goal", {"n_items": 10, "seed": 3})
    assert len(small.tasks.train_eval(DataConfig(eval_fraction=0.2))[0]) == 8
    with pytest.raises(ValueError, match=r"environment 'hidden_goal' .* rejected options \{'n_itmes': 10\}"):
        registry.load("hidden_goal", {"n_itmes": 10})


def test_an_unknown_name_lists_the_known_ones(this_checkout):
    with pytest.raises(LookupError, match=r"unknown environment 'hiden_goal'; known: .*collabllm_medium, hidden_goal"):
        registry.load("hiden_goal")


PLANTED = """
import dataclasses
from parley.environments.hidden_goal import environment

# Named apart from the bundled hidden_goal, which the installed parley registers under that name.
AN_ENV = dataclasses.replace(environment(n_items=4), name="planted_goal")
NOT_AN_ENV = 3

def misnamed():
    return dataclasses.replace(environment(n_items=4), name="something_else")
"""


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("planted_envs:NOT_AN_ENV", TypeError, "is a int, not an Environment or a function returning one"),
        (
            "planted_envs:misnamed",
            ValueError,
            "built an environment named 'something_else'; the two names must be the same",
        ),
    ],
)
def test_a_bad_entry_point_is_named(tmp_path, monkeypatch, value, error, match):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "planted_envs.py").write_text(PLANTED)
    install_dist(tmp_path / "site", monkeypatch, "planted", "1.0", {"planted": value})
    with pytest.raises(error, match=match):
        registry.load("planted")


def test_an_environment_object_takes_no_options(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "planted_envs.py").write_text(PLANTED)
    install_dist(tmp_path / "site", monkeypatch, "planted", "1.0", {"planted_goal": "planted_envs:AN_ENV"})
    assert registry.load("planted_goal").name == "planted_goal"
    with pytest.raises(ValueError, match=r"takes no options; got \['seed'\]"):
        registry.load("planted_goal", {"seed": 1})


def test_one_name_from_two_distributions_is_refused(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "planted_envs.py").write_text(PLANTED)
    install_dist(tmp_path / "a", monkeypatch, "first-pkg", "1.0", {"twice": "planted_envs:AN_ENV"})
    install_dist(tmp_path / "b", monkeypatch, "second-pkg", "2.0", {"twice": "planted_envs:misnamed"})
    with pytest.raises(LookupError, match="'twice' is registered twice") as e:
        registry.load("twice")
    assert "first-pkg 1.0" in str(e.value) and "second-pkg 2.0" in str(e.value)


# ---- the interface's own checks --------------------------------------------------------------


def test_reward_refuses_duplicate_names_and_an_all_zero_total():
    one = PureMetric("a", compute=lambda c: 1.0, weight=1.0)
    with pytest.raises(ValueError, match=r"metric names \['a'\] appear more than once"):
        Reward(metrics=(one, one))
    with pytest.raises(ValueError, match="no metric of .* has a non-zero default weight"):
        Reward(metrics=(PureMetric("a", compute=lambda c: 1.0),))


def test_reward_evaluates_pure_and_judge_metrics_and_asks_each_op_once():
    reward = Reward(
        metrics=(
            JudgeMetric("doc_len", op="extract", value=lambda r, c: len(r.document), weight=1.0),
            JudgeMetric("doc_words", op="extract", value=lambda r, c: len(r.document.split())),
            PureMetric("turns", compute=lambda c: len(c.messages), weight=-0.5),
        )
    )
    conv = Conversation(messages=[ChatMessage("user", "hi"), ChatMessage("assistant", "hello")])
    assert reward.judge_ops == ("extract",)
    assert reward.default_weights() == {"doc_len": 1.0, "turns": -0.5}
    assert reward.evaluate(conv, {"extract": JudgeReply(ok=True, document="two words")}) == {
        "doc_len": 9.0,
        "doc_words": 2.0,
        "turns": 2.0,
    }
    with pytest.raises(ValueError, match=r"judge replies for \['extract'\] are missing"):
        reward.evaluate(conv)


def test_a_metric_must_be_finite():
    reward = Reward(metrics=(PureMetric("x", compute=lambda c: float("nan"), weight=1.0),))
    with pytest.raises(ValueError, match="metric 'x' is nan"):
        reward.evaluate(Conversation(messages=[]))


def test_eval_protocol_selects_only_what_the_table_shows():
    with pytest.raises(ValueError, match="select='b' is not one of selectable"):
        EvalProtocol(columns=("a", "b"), select="b", selectable=("a",))
    with pytest.raises(ValueError, match=r"selectable \['c'\] are not table columns"):
        EvalProtocol(columns=("a",), select="a", selectable=("a", "c"))


def test_eval_columns_must_be_metrics_or_derived():
    env = registry_free_hidden_goal()
    with pytest.raises(ValueError, match=r"eval columns \['mr'\] are neither reward metrics"):
        dataclasses.replace(
            env, eval=EvalProtocol(columns=("goal_match", "mr"), select="goal_match", selectable=("goal_match",))
        )


def registry_free_hidden_goal():
    from parley.environments.hidden_goal import environment

    return environment(n_items=4)


# ---- split and overlap -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _It:
    item_id: str
    target: str
    prompt: str


SOURCE = TaskSource(
    train_eval=lambda data: ([], []),
    task=None,
    leakage_keys=lambda it: {"target": it.target, "prompt": it.prompt},
    leaks=("target",),
)


def test_split_by_key_keeps_each_key_on_one_side():
    items = [_It(f"i{k}", target=f"t{k % 7}", prompt=f"p{k}") for k in range(40)]
    train, held = split_by_key(items, lambda it: it.target, 0.3, seed=1)
    assert len(train) + len(held) == 40 and held
    assert not {it.target for it in train} & {it.target for it in held}
    assert leaking(SOURCE, train, held) == {}
    with pytest.raises(ValueError, match=r"eval_fraction=1.0 must be in \[0, 1\)"):
        split_by_key(items, lambda it: it.target, 1.0)


def test_overlap_names_the_pairs_and_only_label_kinds_leak():
    train = [_It("a", "t1", "p1"), _It("b", "t2", "p2")]
    held = [_It("c", "t1", "p9"), _It("d", "t8", "p2")]
    assert find_overlap(SOURCE, train, held) == {"prompt": [("b", "d")], "target": [("a", "c")]}
    assert leaking(SOURCE, train, held) == {"target": [("a", "c")]}


# ---- [env] -----------------------------------------------------------------------------------


def test_env_section_names_the_environment_and_its_options(this_checkout):
    import msgspec

    from parley.config.env import EnvConfig

    assert EnvConfig().load().name == "collabllm_medium"
    cfg = msgspec.toml.decode(b'name = "hidden_goal"\noptions = { n_items = 12, seed = 4 }\n', type=EnvConfig)
    assert len(cfg.load().tasks.train_eval(DataConfig(eval_fraction=0.25))[1]) == 3
    assert cfg.record() == {
        "name": "hidden_goal",
        "distribution": "parley-grpo",
        "version": "0.1.0",
        "entry_point": "parley.environments.hidden_goal:environment",
        "options": {"n_items": 12, "seed": 4},
    }
    with pytest.raises(msgspec.ValidationError, match="env.name='hidden goal' is not an environment name"):
        msgspec.convert({"name": "hidden goal"}, EnvConfig)
    with pytest.raises(msgspec.ValidationError, match="unknown field `nmae`"):
        msgspec.convert({"nmae": "hidden_goal"}, EnvConfig)
