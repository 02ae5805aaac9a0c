"""Run configuration: every shipped file parses; unknown keys and bad values fail with their path."""

import tomllib
from pathlib import Path

import pytest

from parley.config.run import ConfigError, RunConfig, convert_config, dump_config, load_config
from parley.weights.config import SharedDirWeights

ROOT = Path(__file__).resolve().parents[2]


# Run configs ship under deploy/ (environments/ and tests/data hold other TOML files: data, packages).
@pytest.mark.parametrize("path", sorted((ROOT / "deploy").rglob("*.toml")))
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), RunConfig)


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


@pytest.mark.parametrize(
    "override",
    ["learner.transport=nccl", "learner.shared_dir=/srv/w", "learner.model=smol", "actor.temperature=0.7"],
)
def test_keys_no_release_ever_had_are_unknown(override):
    """Nothing was released before [weights], [policy] and actor.sampling: their earlier names are
    plain unknown keys, refused with their path like any other."""
    with pytest.raises(ConfigError, match=override.partition("=")[0].replace(".", r"\.")):
        load_config(None, [override])


def test_a_relative_shared_dir_is_made_absolute_once_at_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ['weights={kind="shared_dir", dir="weights/shared"}'])
    assert cfg.weights == SharedDirWeights(dir=str(tmp_path / "weights" / "shared"))
    monkeypatch.chdir("/")  # a child started elsewhere from the dumped config reads the same directory
    assert '[weights]\nkind = "shared_dir"' in dump_config(cfg)
    assert convert_config(tomllib.loads(dump_config(cfg))).weights == cfg.weights


@pytest.mark.parametrize("override", ['weights={kind="ftp"}'])
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
