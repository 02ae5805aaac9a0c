"""Wire contract without a server: round trips, identities, old-schema decoding, typed errors."""

from pathlib import Path

import msgspec
import pytest

from parley.protocol import arrays, codec, examples, topology
from parley.protocol.messages import Trajectory

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
    assert arrays.turn_logprobs(traj.turns[0]).tolist() == [-0.5, -1.5]
    assert arrays.token_ids(traj).tolist() == traj.token_ids and arrays.loss_mask(traj).tolist() == traj.loss_mask


V1_IDS = [1, 151644, 872, 198, 300, 70000, 151645, 198, 151644, 872, 198, 2000, 151645, 198]
V1_MASK = [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0]
V1_TURNS = [(4, [-0.5, -1.25, -0.125], 3), (11, [-2.0, -0.0625], 4)]


def _token_values(traj: Trajectory):
    return (
        arrays.token_ids(traj).tolist(),
        arrays.loss_mask(traj).tolist(),
        [(t.start, arrays.turn_logprobs(t).tolist(), t.version) for t in traj.turns],
    )


def test_trajectory_of_the_list_schema_decodes():
    # trajectory_v1.msgpack was encoded by the last schema that carried tokens as msgpack lists of
    # numbers (before the packed arrays): two turns, ids above 65535.
    traj = codec.decode("traj", (DATA / "trajectory_v1.msgpack").read_bytes())
    assert traj.traj_id == "t-v1/1" and len(traj.messages) == 4
    assert traj.token_ids == V1_IDS and traj.loss_mask == V1_MASK
    assert [(t.start, t.logprobs, t.version) for t in traj.turns] == V1_TURNS
    assert traj.token_ids_i32 == traj.loss_mask_u8 == b""
    assert _token_values(traj) == (V1_IDS, V1_MASK, V1_TURNS)


def test_packed_trajectory_reads_the_same_values_in_fewer_bytes():
    old_bytes = (DATA / "trajectory_v1.msgpack").read_bytes()
    old = codec.decode("traj", old_bytes)
    turns = [msgspec.structs.replace(t, logprobs=[], logprobs_f32=arrays.pack_logprobs(t.logprobs)) for t in old.turns]
    new = msgspec.structs.replace(
        old,
        token_ids=[],
        loss_mask=[],
        token_ids_i32=arrays.pack_ids(old.token_ids),
        loss_mask_u8=arrays.pack_mask(old.loss_mask),
        turns=turns,
    )
    new_bytes = codec.encode(new)
    back = codec.decode("traj", new_bytes)
    assert back == new and _token_values(back) == _token_values(old) == (V1_IDS, V1_MASK, V1_TURNS)
    # the views are over the decoded bytes, not copies
    assert not arrays.token_ids(back).flags.owndata and arrays.token_ids(back).dtype.str == "<i4"
    assert len(new_bytes) < len(old_bytes)


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


def test_packing_lists_and_arrays_gives_the_same_little_endian_bytes():
    import numpy as np

    ids, mask, lps = [0, 1, 70000, 2**31 - 1], [0, 1, 1, 0], [-0.5, -1.25, 0.0, -3.0e-8]
    assert arrays.pack_ids(ids) == arrays.pack_ids(np.array(ids)) == np.array(ids, dtype="<i4").tobytes()
    assert arrays.pack_mask(mask) == arrays.pack_mask(np.array(mask)) == bytes(mask)
    assert arrays.pack_logprobs(lps) == arrays.pack_logprobs(np.array(lps)) == np.array(lps, dtype="<f4").tobytes()
    assert arrays.pack_ids([]) == arrays.pack_mask([]) == arrays.pack_logprobs([]) == b""
