"""Wire contract without a server: round trips, identities, typed errors."""

import msgspec
import pytest

from parley.protocol import arrays, codec, examples, topology
from parley.protocol.messages import Trajectory


@pytest.mark.parametrize("key,msg", list(examples.channel_examples().items()) + list(examples.other_examples().items()))
def test_every_message_type_round_trips(key, msg):
    assert codec.decode(key, codec.encode(msg)) == msg


def test_msg_id_is_identity_not_random():
    t1, t2 = examples.trajectory(sample=1), examples.trajectory(sample=1)
    assert codec.msg_id(t1) == codec.msg_id(t2) == "traj:t-0001/1"
    assert codec.msg_id(examples.trajectory(sample=2)) != codec.msg_id(t1)
    assert codec.msg_id(examples.scored()) != codec.msg_id(examples.trajectory())


def _token_values(traj: Trajectory):
    return (
        arrays.token_ids(traj).tolist(),
        arrays.loss_mask(traj).tolist(),
        [(t.start, arrays.turn_logprobs(t).tolist(), t.version) for t in traj.turns],
    )


IDS = [1, 151644, 872, 198, 300, 70000, 151645, 198, 151644, 872, 198, 2000, 151645, 198]
MASK = [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0]
TURNS = [(4, [-0.5, -1.25, -0.125], 3), (11, [-2.0, -0.0625], 4)]


def test_a_packed_trajectory_round_trips_its_token_values_as_views():
    traj = examples.trajectory()
    traj = msgspec.structs.replace(
        traj,
        token_ids_i32=arrays.pack_ids(IDS),
        loss_mask_u8=arrays.pack_mask(MASK),
        turns=[
            msgspec.structs.replace(traj.turns[0], start=s, logprobs_f32=arrays.pack_logprobs(lp), version=v)
            for s, lp, v in TURNS
        ],
    )
    back = codec.decode("traj", codec.encode(traj))
    assert back == traj and _token_values(back) == (IDS, MASK, TURNS)
    # the views are over the decoded bytes, not copies
    assert not arrays.token_ids(back).flags.owndata and arrays.token_ids(back).dtype.str == "<i4"


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
