"""Every sampling setting that shapes a trajectory's log-probs travels with it, and the learner's
intake refuses what it cannot recompute, naming the value: an actor started by hand with top_p 0.9,
a temperature below vLLM's greedy threshold, or a tempered policy against the raw reference service.
Before, a Trajectory carried its temperature only and these passed intake (check_training runs only
for `parley learner` and `parley up`, not for an actor started elsewhere)."""

from __future__ import annotations

import msgspec
import pytest

from parley.config.run import ConfigError, check_training, load_config
from parley.learner.groups import BadTrajectory, check_hostile_values
from parley.protocol import codec
from parley.protocol.messages import GREEDY_BELOW, Trajectory
from tests import factories


def _scored(**traj_fields):
    traj = msgspec.structs.replace(factories.trajectory("wire"), **traj_fields)
    return factories.scored(traj, {"bleu": 0.5})


def test_top_p_travels_with_the_trajectory_and_old_messages_decode_as_top_p_1():
    traj = msgspec.structs.replace(factories.trajectory("wire"), top_p=0.9)
    assert codec.decode("traj", codec.encode(traj)).top_p == 0.9
    fields = msgspec.structs.asdict(factories.trajectory("wire"))
    del fields["top_p"]  # a message of a release before top_p was on the wire
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=Trajectory).top_p == 1.0


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"top_p": 0.9}, "top_p 0.9"),
        ({"temperature": 5e-6}, "temperature 5e-06 is not a finite number >= 1e-05"),
        ({"temperature": float("nan")}, "temperature nan"),
        ({"temperature": 1e-30}, "temperature 1e-30"),
    ],
)
def test_intake_refuses_log_probs_it_cannot_recompute(fields, words):
    with pytest.raises(BadTrajectory, match=words):
        check_hostile_values(_scored(**fields), vocab_size=16)


def test_a_tempered_policy_is_refused_against_the_raw_reference_service():
    scored = _scored(temperature=0.7)
    check_hostile_values(scored, vocab_size=16)  # the learner's own reference takes T per sample
    with pytest.raises(BadTrajectory, match=r"temperature 0.7 with \[policy\] reference = \"service\""):
        check_hostile_values(msgspec.structs.replace(scored, ref_logp_f32=b"\0" * 32), vocab_size=16, reference=True)


def test_training_refuses_a_temperature_below_the_greedy_threshold():
    cfg = load_config(None, [f"actor.sampling.temperature={GREEDY_BELOW / 2}"])
    with pytest.raises(ConfigError, match=r"actor.sampling.temperature=5e-06: training needs a temperature >= 1e-05"):
        check_training(cfg)
    check_training(load_config(None, [f"actor.sampling.temperature={GREEDY_BELOW}"]))
