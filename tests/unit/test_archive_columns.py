"""The learner's archive read without parley: token ids, the loss mask and log-probs are Arrow list
columns of numbers (int32, uint8, float32) under plain names, reward weights say so, and parley's own
reader still gives back the Scored it wrote (and reads a file of the layout before, byte fields)."""

import json
import subprocess
import sys
import textwrap

import msgspec
import pytest

from parley.evaluation.evallog import read_log, write_parquet
from parley.learner.checkpoint import write_archive
from parley.protocol import arrays
from parley.protocol.messages import AssistantTurn, ChatMessage, Scored, Trajectory

TOKENS = [151644, 872, 198, 9707, 0, 2147483647]
MASK = [0, 0, 0, 1, 1, 1]
LOGPROBS = [[-0.125, -2.5], [-0.0009765625]]
REF = [0.0, -1.5, -0.25, -3.0, -0.5, -0.75]


def scored(sample: int = 0) -> Scored:
    traj = Trajectory(
        traj_id=f"t1/{sample}",
        task_id="t1",
        sample=sample,
        run="r",
        item_id="item-0",
        messages=[ChatMessage("user", "u"), ChatMessage("assistant", "a")],
        token_ids_i32=arrays.pack_ids(TOKENS),
        loss_mask_u8=arrays.pack_mask(MASK),
        turns=[
            AssistantTurn(start=3, version=1, finish_reason="stop", logprobs_f32=arrays.pack_logprobs(LOGPROBS[0])),
            AssistantTurn(start=5, version=2, finish_reason="length", logprobs_f32=arrays.pack_logprobs(LOGPROBS[1])),
        ],
        timings={"generate": 0.5},
    )
    return Scored(
        traj_id=traj.traj_id,
        task_id="t1",
        sample=sample,
        run="r",
        metrics={"bleu": 0.25},
        weights={"bleu": 1.0, "token_amount": -0.1},
        total=0.25,
        trajectory=traj,
        ref_logp_f32=arrays.pack_logprobs(REF),
    )


# Runs in a child process in which importing parley fails: only pyarrow (and duckdb, when installed).
READER = textwrap.dedent(
    """
    import json, sys
    sys.modules["parley"] = None
    import pyarrow.parquet as pq
    t = pq.read_table(sys.argv[1])
    row = t.to_pylist()[0]
    traj = row["trajectory"]
    out = {
        "types": {
            "token_ids": str(t.schema.field("trajectory").type.field("token_ids").type.value_type),
            "loss_mask": str(t.schema.field("trajectory").type.field("loss_mask").type.value_type),
            "ref_logprobs": str(t.schema.field("ref_logprobs").type.value_type),
        },
        "columns": t.column_names,
        "trajectory_fields": [f.name for f in t.schema.field("trajectory").type],
        "token_ids": traj["token_ids"],
        "loss_mask": traj["loss_mask"],
        "logprobs": [turn["logprobs"] for turn in traj["turns"]],
        "ref_logprobs": row["ref_logprobs"],
        "reward_weights": dict(row["reward_weights"]),
    }
    try:
        import duckdb
    except ImportError:
        duckdb = None
    if duckdb is not None:
        q = "select trajectory.token_ids from read_parquet(?) order by sample"
        out["duckdb_token_ids"] = duckdb.execute(q, [sys.argv[1]]).fetchall()[0][0]
    print(json.dumps(out))
    """
)


def test_the_archive_reads_as_numbers_without_parley(tmp_path):
    path = write_archive(tmp_path, 1, [scored(0), scored(1)])
    done = subprocess.run([sys.executable, "-c", READER, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["types"] == {"token_ids": "int32", "loss_mask": "uint8", "ref_logprobs": "float"}
    assert got["token_ids"] == TOKENS and got["loss_mask"] == MASK
    assert got["logprobs"] == LOGPROBS and got["ref_logprobs"] == REF  # each exactly a float32
    assert got["reward_weights"] == {"bleu": 1.0, "token_amount": -0.1}
    # one column per fact: no byte blobs, no empty list beside them, no bare "weights"
    assert "weights" not in got["columns"] and "ref_logp_f32" not in got["columns"]
    assert not {"token_ids_i32", "loss_mask_u8"} & set(got["trajectory_fields"])
    if "duckdb_token_ids" in got:
        assert got["duckdb_token_ids"] == TOKENS


def test_parley_reads_back_what_it_wrote(tmp_path):
    samples = [scored(0), scored(1)]
    path = write_archive(tmp_path, 1, samples)
    assert read_log(path) == samples


@pytest.mark.parametrize("empty", ["ref_logp_f32", "logprobs_f32"])
def test_empty_arrays_come_back_empty(tmp_path, empty):
    s = scored()
    if empty == "ref_logp_f32":
        s = msgspec.structs.replace(s, ref_logp_f32=b"")
    else:
        turns = [msgspec.structs.replace(t, logprobs_f32=b"") for t in s.trajectory.turns]
        s = msgspec.structs.replace(s, trajectory=msgspec.structs.replace(s.trajectory, turns=turns))
    assert read_log(write_parquet([s], tmp_path / "s.parquet")) == [s]
