"""Run configuration: every shipped file parses; unknown keys and bad values fail with their path."""

import tomllib
from pathlib import Path

import pytest

from parley.config.run import ConfigError, RunConfig, convert_config, dump_config, load_config
from parley.weights.config import CudaIpcWeights, NcclWeights, ObjstoreWeights, SharedDirWeights

ROOT = Path(__file__).resolve().parents[2]


# Run configs ship under deploy/ (environments/ and tests/data hold other TOML files: data, packages).
@pytest.mark.parametrize("path", sorted((ROOT / "deploy").rglob("*.toml")))
def test_every_shipped_config_parses(path, caplog):
    assert isinstance(load_config(path), RunConfig)
    assert "is now" not in caplog.text  # and uses no key of an earlier release (config.run.RENAMED)


def test_one_sampling_struct_serves_the_actor_the_eval_and_the_conversation_loop():
    from parley.evaluation.runner import EvalSettings
    from parley.protocol.messages import Sampling
    from parley.rollout.conversation import PolicySettings

    for holder in (RunConfig().actor, EvalSettings(), PolicySettings(max_model_len=64)):
        assert type(holder.sampling) is Sampling, holder
        assert not hasattr(holder, "temperature") and not hasattr(holder, "top_p"), holder


def test_overrides_and_dump_round_trip():
    cfg = load_config(None, ["actor.concurrency=3", "actor.engine.model=tiny", "scorer.weights={bleu=2.0}"])
    assert cfg.actor.concurrency == 3 and cfg.actor.engine.model == "tiny" and cfg.scorer.weights == {"bleu": 2.0}
    import tomllib

    assert convert_config(tomllib.loads(dump_config(cfg))) == cfg


def test_unknown_key_is_rejected_with_its_path():
    # the error names the source of the bad key (this --set, not the file it is laid over)
    with pytest.raises(
        ConfigError,
        match=r"^--set actor.engine.bogus=1: actor.engine.bogus: unknown key; \[actor.engine\] has model, dtype",
    ):
        load_config(None, ["actor.engine.bogus=1"])


@pytest.mark.parametrize(
    "override,needle",
    [
        ("sim.backend=foo", "sim.backend = 'foo': expected one of 'openai', 'vllm'$"),
        (
            "learner.loss_agg=mean",
            "learner.loss_agg = 'mean': expected one of 'seq-mean-token-mean', 'seq-mean-token-sum', 'token-mean'$",
        ),
        ("bus.replicas=2", "bus.replicas = 2: expected one of 1, 3, 5$"),
        ("run.name=a.b", r"run.name = 'a.b': expected a str matching .* \(use 1-64 of A-Z a-z 0-9 _ -\)$"),
        ("rollout.n=1", r"--set rollout.n=1: rollout.n = 1: expected an int >= 2 and <= 1024 \(GRPO needs a group\)$"),
        ("rollout.futures=65", "rollout.futures = 65: expected an int >= 0 and <= 64$"),
        ("actor.concurrency=abc", "actor.concurrency = 'abc': expected an int >= 1, got `str`$"),
        ("actor.sampling.top_p=0", r"actor.sampling.top_p = 0: expected a float > 0.0 and <= 1.0 \(1.0 keeps"),
        ("learner.task_deadline_s=60", "task_deadline_s=60.0 must be >= group_timeout_s=1800.0"),
        ("learner.publish_every=3", r"publish_every=3 must be <= max_staleness \+ 1 = 2"),
        ("actor.sim_wait_s=-1", r"actor.sim_wait_s = -1: expected a float >= 0 \(0 gives a task up at the first"),
        ("policy.reference=remote", "policy.reference = 'remote': expected one of 'local', 'service'$"),
        ("scorer.reference_timeout_s=0", "scorer.reference_timeout_s = 0: expected a float > 0$"),
        ("scorer.retry_delay_s=60", "retry_delay_s=60.0, retry_max_delay_s=30.0: need 0 < retry_delay_s <= "),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_values(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_a_relative_shared_dir_is_made_absolute_once_at_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ['weights={kind="shared_dir", dir="weights/shared"}'])
    assert cfg.weights == SharedDirWeights(dir=str(tmp_path / "weights" / "shared"))
    monkeypatch.chdir("/")  # a child started elsewhere from the dumped config reads the same directory
    assert '[weights]\nkind = "shared_dir"' in dump_config(cfg)
    assert convert_config(tomllib.loads(dump_config(cfg))).weights == cfg.weights


@pytest.mark.parametrize(
    "old, new",
    [
        ([], ObjstoreWeights()),
        (["learner.transport=objstore"], ObjstoreWeights()),
        (["learner.transport=shared_dir", "learner.shared_dir=/srv/w"], SharedDirWeights(dir="/srv/w")),
        (
            ["learner.transport=cuda_ipc", "learner.ipc_hold_s=12.5", "learner.ipc_buffers=3"],
            CudaIpcWeights(hold_s=12.5, max_buffers=3),
        ),
        (
            ["learner.transport=nccl", 'learner.nccl_address="10.0.0.1:29600"', "learner.ipc_hold_s=9"],
            NcclWeights(address="10.0.0.1:29600", hold_s=9.0),
        ),
        # keys that had no effect on the chosen transport are dropped, as they were ignored before
        (["learner.ipc_hold_s=5", "learner.shared_dir=/srv/w"], ObjstoreWeights()),
    ],
)
def test_old_flat_weight_keys_load_as_learner_weights(old, new):
    """Config files written before [weights] (transport, shared_dir, ipc_hold_s, ipc_buffers,
    nccl_address in [learner]) load to the same configuration as the new table."""
    assert load_config(None, old).weights == new


def test_old_and_new_weight_keys_together_name_the_new_key(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('[learner]\ntransport = "objstore"\n\n[weights]\nkind = "objstore"\n')
    with pytest.raises(ConfigError, match=r"sets transport .*\[weights\].*transport -> kind") as e:
        load_config(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["learner.transport=ftp", 'weights={kind="ftp"}'])
def test_an_unknown_weights_kind_names_the_known_ones(override):
    with pytest.raises(
        ConfigError, match=r"'ftp' not allowed; use one of \('objstore', 'shared_dir', 'cuda_ipc', 'nccl'\)"
    ):
        load_config(None, [override])


def test_a_weights_option_of_another_kind_is_refused_with_its_path():
    with pytest.raises(
        ConfigError, match=r"weights\.address: unknown key for kind = 'cuda_ipc'; it is a key of kind = 'nccl'"
    ):
        load_config(None, ['weights={kind="cuda_ipc", address="h:1"}'])


def test_a_reference_service_without_kl_fails_at_load_naming_both_keys():
    with pytest.raises(
        ConfigError,
        match=r"policy.reference='service' with learner.kl_coef=0.0.*learner.kl_coef > 0 "
        r"or policy.reference = \"local\"",
    ):
        load_config(None, ["policy.reference=service", "learner.kl_coef=0"])
    assert load_config(None, ["policy.reference=service"]).policy.reference == "service"  # kl_coef 0.001


OLD_FILE = """
[actor]
temperature = 0.7
top_p = 0.9
[actor.engine]
chat_template_kwargs = { enable_thinking = false }
[judge.engine]
chat_template_kwargs = { enable_thinking = true }
[learner]
model = "tiny"
reference = "service"
"""


def test_an_old_file_loads_with_its_keys_under_their_new_names(tmp_path, caplog):
    path = tmp_path / "old.toml"
    path.write_text(OLD_FILE)
    cfg = load_config(path)
    assert (cfg.actor.sampling.temperature, cfg.actor.sampling.top_p) == (0.7, 0.9)
    assert cfg.actor.engine.template_kwargs == {"enable_thinking": False}
    assert cfg.judge.engine.template_kwargs == {"enable_thinking": True} and cfg.sim.engine.template_kwargs == {}
    assert (cfg.policy.model, cfg.policy.reference) == ("tiny", "service")
    assert "learner.model is now policy.model" in caplog.text
    import tomllib

    dumped = tomllib.loads(dump_config(cfg))  # written back under the new names only
    assert "model" not in dumped["learner"] and "temperature" not in dumped["actor"]
    assert dumped["policy"]["model"] == "tiny" and dumped["actor"]["sampling"]["top_p"] == 0.9


def test_old_keys_in_overrides_are_read_under_their_new_names():
    cfg = load_config(
        None, ["learner.model=tiny", "actor.temperature=0.5", "actor.engine.chat_template_kwargs.enable_thinking=false"]
    )
    assert cfg.policy.model == "tiny" and cfg.actor.sampling.temperature == 0.5
    assert cfg.actor.engine.template_kwargs == {"enable_thinking": False}


def test_an_old_key_beside_its_new_name_fails_naming_both(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('[learner]\nmodel = "tiny"\n[policy]\nmodel = "smol"\n')
    with pytest.raises(
        ConfigError,
        match=r"both.toml: both learner.model and policy.model are set; learner.model is "
        r"the old name of policy.model: keep only policy.model",
    ):
        load_config(path)
