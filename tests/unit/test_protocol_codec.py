"""Wire contract without a server: round trips, identities, old-schema decoding, typed errors."""

from pathlib import Path

import msgspec
import pytest

from protocol import codec, examples, topology
from protocol.messages import Trajectory

DATA = Path(__file__).parent.parent / "data"


@pytest.mark.parametrize("key,msg", list(examples.channel_examples().items()) + list(examples.other_examples().items()))
def test_every_message_type_round_trips(key, msg):
    assert codec.decode(key, codec.encode(msg)) == msg


def test_msg_id_is_identity_not_random():
    t1, t2 = examples.trajectory(sample=1), examples.trajectory(sample=1)
    assert codec.msg_id(t1) == codec.msg_id(t2) == "traj:t-0001/1"
    assert codec.msg_id(examples.trajectory(sample=2)) != codec.msg_id(t1)
    assert codec.msg_id(examples.scored()) != codec.msg_id(examples.trajectory())


def test_trajectory_from_older_schema_decodes():
    # trajectory_v0.msgpack was encoded by the first schema (no `mode` .. `created` fields yet);
    # the current decoder fills the later fields with their defaults.
    old = (DATA / "trajectory_v0.msgpack").read_bytes()
    traj = codec.decode("traj", old)
    assert isinstance(traj, Trajectory)
    assert traj.traj_id == "t-old/2" and traj.turns[0].logprobs == [-0.5, -1.5]
    assert traj.mode == "conversation" and traj.timings == {} and traj.futures == []


def test_bad_message_fails_with_a_path():
    raw = msgspec.msgpack.encode({**msgspec.to_builtins(examples.trajectory()), "turns": [{"start": "x"}]})
    with pytest.raises(msgspec.ValidationError, match=r"\$\.turns\[0\]"):
        codec.decode("traj", raw)


def test_names_come_from_protocol_and_reject_bad_runs():
    assert topology.subject("r1", "traj") == "parley.r1.traj"
    assert topology.stream_name("r1", "scored") == "PARLEY_r1_SCORED"
    with pytest.raises(ValueError, match="run name"):
        topology.subject("bad.name", "traj")
    with pytest.raises(ValueError, match="unknown channel"):
        topology.subject("r1", "nope")
