"""Run configuration: every shipped file parses; unknown keys and bad values fail with their path."""

import tomllib
from pathlib import Path

import pytest

from deploy.config import ConfigError, RunConfig, convert_config, dump_config, load_config
from weights.config import CudaIpcWeights, NcclWeights, ObjstoreWeights, SharedDirWeights

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
    cfg = load_config(None, ['learner.weights={kind="shared_dir", dir="weights/shared"}'])
    assert cfg.learner.weights == SharedDirWeights(dir=str(tmp_path / "weights" / "shared"))
    monkeypatch.chdir("/")  # a child started elsewhere from the dumped config reads the same directory
    assert "[learner.weights]\nkind = \"shared_dir\"" in dump_config(cfg)
    assert convert_config(tomllib.loads(dump_config(cfg))).learner.weights == cfg.learner.weights


@pytest.mark.parametrize(
    "old, new",
    [
        ([], ObjstoreWeights()),
        (["learner.transport=objstore"], ObjstoreWeights()),
        (["learner.transport=shared_dir", "learner.shared_dir=/srv/w"], SharedDirWeights(dir="/srv/w")),
        (["learner.transport=cuda_ipc", "learner.ipc_hold_s=12.5", "learner.ipc_buffers=3"],
         CudaIpcWeights(hold_s=12.5, max_buffers=3)),
        (["learner.transport=nccl", 'learner.nccl_address="10.0.0.1:29600"', "learner.ipc_hold_s=9"],
         NcclWeights(address="10.0.0.1:29600", hold_s=9.0)),
        # keys that had no effect on the chosen transport are dropped, as they were ignored before
        (["learner.ipc_hold_s=5", "learner.shared_dir=/srv/w"], ObjstoreWeights()),
    ],
)
def test_old_flat_weight_keys_load_as_learner_weights(old, new):
    """Config files written before [learner.weights] (transport, shared_dir, ipc_hold_s, ipc_buffers,
    nccl_address in [learner]) load to the same configuration as the new table."""
    assert load_config(None, old).learner.weights == new


def test_old_and_new_weight_keys_together_name_the_new_key(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('[learner]\ntransport = "objstore"\n\n[learner.weights]\nkind = "objstore"\n')
    with pytest.raises(ConfigError, match=r"both transport .*\[learner.weights\].*transport -> kind") as e:
        load_config(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["learner.transport=ftp", 'learner.weights={kind="ftp"}'])
def test_an_unknown_weights_kind_names_the_known_ones(override):
    with pytest.raises(ConfigError, match=r"'ftp' not allowed; use one of \('objstore', 'shared_dir', 'cuda_ipc', 'nccl'\)"):
        load_config(None, [override])


def test_a_weights_option_of_another_kind_is_refused_with_its_path():
    with pytest.raises(ConfigError, match=r"address.*\$\.learner\.weights"):
        load_config(None, ['learner.weights={kind="cuda_ipc", address="h:1"}'])


def test_a_reference_service_without_kl_fails_at_load_naming_both_keys():
    with pytest.raises(ConfigError, match=r"reference='service' with kl_coef=0.0.*learner.kl_coef > 0 or "
                                          r"learner.reference = \"local\" - at `\$\.learner`"):
        load_config(None, ["learner.reference=service", "learner.kl_coef=0"])
    assert load_config(None, ["learner.reference=service"]).learner.reference == "service"  # kl_coef 0.001
