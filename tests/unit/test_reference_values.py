"""The reference log-probs a Scored carries for [policy] reference = "service": the learner's
intake refuses missing, misaligned, non-finite and positive values with the reason; an old Scored
without the field still decodes; a Sample's `ref` is gathered with its trained tokens."""

from __future__ import annotations

import math
import re

import msgspec
import numpy as np
import pytest

from parley.learner.groups import BadTrajectory, check_hostile_values, check_reference
from parley.learner.packing import Sample, build_batch
from parley.protocol import arrays, codec
from parley.protocol.messages import Scored
from tests.unit.test_groups import scored

VOCAB = 100
GOOD = [0.0, -1.5, -0.25, -3.0, -0.5, -2.0]  # six tokens, as tests.unit.test_groups.scored has


def with_ref(values) -> Scored:
    return msgspec.structs.replace(scored("t", 0, 0.5), ref_logp_f32=arrays.pack_logprobs(values))


def test_good_reference_logprobs_pass_and_are_read_as_sent():
    s = with_ref(GOOD)
    check_hostile_values(s, VOCAB, reference=True)
    np.testing.assert_array_equal(arrays.ref_logprobs(s), np.array(GOOD, np.float32))


@pytest.mark.parametrize(
    "values,needle",
    [
        (None, "no reference log-probs (ref_logp_f32) while policy.reference='service'"),
        (GOOD[:-1], "5 reference log-probs for 6 tokens"),
        (GOOD + [-1.0], "7 reference log-probs for 6 tokens"),
        ([0.0, -1.0, math.nan, -1.0, -1.0, -1.0], "reference log-prob 2 is nan"),
        ([0.0, -1.0, -1.0, -math.inf, -1.0, -1.0], "reference log-prob 3 is -inf"),
        ([0.0, -1.0, -1.0, -1.0, 0.5, -1.0], "reference log-prob 4 is 0.5"),
    ],
)
def test_bad_reference_logprobs_are_refused_with_the_reason(values, needle):
    s = scored("t", 0, 0.5) if values is None else with_ref(values)
    with pytest.raises(BadTrajectory, match=r"^t/0: " + re.escape(needle)):
        check_hostile_values(s, VOCAB, reference=True)
    check_hostile_values(s, VOCAB)  # a learner with its own reference does not read them


def test_a_packed_field_of_a_bad_byte_length_is_refused():
    s = msgspec.structs.replace(scored("t", 0, 0.5), ref_logp_f32=b"\x00" * 7)
    with pytest.raises(BadTrajectory, match="ref_logp_f32 holds 7 bytes"):
        check_reference(s, 6)


def test_a_scored_of_the_schema_before_the_field_decodes_without_it():
    s = scored("t", 0, 0.5)
    old = msgspec.structs.asdict(s)
    del old["ref_logp_f32"]  # what a scorer before this field wrote
    back = codec.decode("scored", msgspec.msgpack.encode(old))
    assert back.ref_logp_f32 == b"" and arrays.ref_logprobs(back).size == 0
    new = with_ref(GOOD)
    assert arrays.ref_logprobs(codec.decode("scored", codec.encode(new))).tolist() == pytest.approx(GOOD)


def test_a_batch_gathers_the_reference_of_its_trained_tokens():
    a = Sample("a", [1, 2, 3, 4], [0, 1, 0, 1], [0, -0.1, 0, -0.2], 1.0, ref=[0.0, -1.0, -2.0, -3.0])
    b = Sample("b", [5, 6, 7], [0, 1, 1], [0, -0.3, -0.4], -1.0, ref=[0.0, -4.0, -5.0])
    batch = build_batch([a, b])
    assert batch.targets.tolist() == [2, 4, 6, 7]
    assert batch.ref.tolist() == [-1.0, -3.0, -4.0, -5.0]  # the same positions as the targets
    assert build_batch([a, Sample("c", [1, 2], [0, 1], [0, -0.1], 0.0)]).ref is None  # not every sample has one
    with pytest.raises(ValueError, match="ref \\(3,\\) and token_ids \\(4,\\)"):
        Sample("d", [1, 2, 3, 4], [0, 1, 1, 1], [0, -1, -1, -1], 0.0, ref=[0.0, -1.0, -1.0])


def test_up_starts_the_reference_service_only_when_the_run_uses_it(tmp_path):
    from parley.config.run import load_config
    from parley.deploy.permissions import role_permissions
    from parley.deploy.up import plan_children, ready_children
    from parley.protocol import topology
    from parley.protocol.messages import Heartbeat
    from parley.runtime.supervisor import Supervisor

    sup = Supervisor(tmp_path)
    names = [name for name, _ in plan_children(load_config(), sup, tmp_path / "c.toml")]
    assert "reference" not in names
    plan = dict(plan_children(load_config(None, ["policy.reference=service"]), sup, tmp_path / "c.toml"))
    assert plan["reference"][-4:] == ["--config", str(tmp_path / "c.toml"), "--id", "reference"]
    assert plan["reference"][plan["reference"].index("parley.deploy.cli") + 1] == "reference"
    assert list(plan).index("reference") < list(plan).index("scorer-0")  # up before anyone asks it
    assert "reference" in ready_children([Heartbeat(role="reference", id="reference", state="ready")])
    perms = role_permissions("r")
    assert (
        topology.REFERENCE_SUBJECTS in perms["reference"]["subscribe"]["allow"]
        and perms["reference"]["allow_responses"]
    )
    assert topology.REFERENCE_SUBJECTS in perms["scorer"]["publish"]["allow"]


def test_an_evals_scorer_asks_no_reference_service(tmp_path):
    from parley.config.run import load_config
    from parley.evaluation.fleet import scorer_args

    path = tmp_path / "run.toml"
    path.write_text('[policy]\nreference = "service"\n')
    args = scorer_args(["--config", str(path), "--set", 'run.name="r-eval"'], "base")
    assert args[0] == "scorer"
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert load_config(path).policy.reference == "service"
    assert load_config(path, sets).policy.reference == "local"
