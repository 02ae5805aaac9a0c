"""Run configuration: every shipped file parses; unknown keys and bad values fail with their path."""

from pathlib import Path

import pytest

from config.run import ConfigError, RunConfig, convert_config, dump_config, load_config

ROOT = Path(__file__).resolve().parents[2]


# Run configs ship under deploy/ (environments/ and tests/data hold other TOML files: data, packages).
@pytest.mark.parametrize("path", sorted((ROOT / "deploy").rglob("*.toml")))
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), RunConfig)


def test_overrides_and_dump_round_trip():
    cfg = load_config(None, ["actor.concurrency=3", "actor.engine.model=tiny", "scorer.weights={bleu=2.0}"])
    assert cfg.actor.concurrency == 3 and cfg.actor.engine.model == "tiny" and cfg.scorer.weights == {"bleu": 2.0}
    import tomllib

    assert convert_config(tomllib.loads(dump_config(cfg))) == cfg


def test_unknown_key_is_rejected_with_its_path():
    with pytest.raises(ConfigError, match=r"unknown field `bogus` - at `\$\.actor\.engine`"):
        load_config(None, ["actor.engine.bogus=1"])


@pytest.mark.parametrize(
    "override,needle",
    [
        ("sim.backend=foo", "backend='foo' not allowed; use one of"),
        ("learner.loss_agg=mean", "loss_agg='mean' not allowed"),
        ("bus.replicas=2", "replicas=2 is not allowed"),
        ("run.name=a.b", "name='a.b' not allowed"),
        ("rollout.n=1", "n=1 must be >= 2"),
        ("learner.task_deadline_s=60", "task_deadline_s=60.0 must be >= group_timeout_s=1800.0"),
        ("learner.publish_every=3", r"publish_every=3 must be <= max_staleness \+ 1 = 2"),
        ("actor.sim_wait_s=-1", "sim_wait_s=-1.0 must be >= 0"),
        ("learner.reference=remote", "reference='remote' not allowed; use one of"),
        ("scorer.reference_timeout_s=0", "reference_timeout_s=0.0 must be > 0"),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_values(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_a_relative_shared_dir_is_made_absolute_once_at_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ['learner.transport="shared_dir"', 'learner.shared_dir="weights/shared"'])
    assert cfg.learner.shared_dir == str(tmp_path / "weights" / "shared")
    monkeypatch.chdir("/")  # a child started elsewhere from the dumped config reads the same directory
    assert convert_config(__import__("tomllib").loads(dump_config(cfg))).learner.shared_dir == cfg.learner.shared_dir


def test_a_reference_service_without_kl_fails_at_load_naming_both_keys():
    with pytest.raises(ConfigError, match=r"reference='service' with kl_coef=0.0.*learner.kl_coef > 0 or "
                                          r"learner.reference = \"local\" - at `\$\.learner`"):
        load_config(None, ["learner.reference=service", "learner.kl_coef=0"])
    assert load_config(None, ["learner.reference=service"]).learner.reference == "service"  # kl_coef 0.001
