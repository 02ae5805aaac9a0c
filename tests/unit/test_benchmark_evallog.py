"""Unit tests for evaluation.evallog: exact Parquet/JSONL round trips of EvalRecord and Scored, training
trajectories as eval records, re-weighting without a judge, re-judging through a test-double judge,
and `parley replay` on a log file."""

import msgspec
import pytest
from typer.testing import CliRunner

from parley.config.scorer import ScorerConfig
from parley.deploy.cli import app
from parley.evaluation.evallog import from_scored, read_log, read_records, rejudge, reweight, write_jsonl, write_parquet
from parley.protocol import arrays
from parley.protocol.messages import (
    ABANDONED_STALE,
    AssistantTurn,
    ChatMessage,
    EvalRecord,
    JudgeOutput,
    Scored,
    Trajectory,
)
from parley.rewards.metrics import bleu, char_bleu
from tests.factories import JudgeDouble, first_assistant

REFERENCE = "Three Days in Lisbon\n\nWe walked the hills of Alfama and ate too many custard tarts in Belem."
DOCS = [
    "Three Days in Lisbon\n\nWe walked up the hills of Alfama and ate custard tarts in Belem.",
    "Lisbon trip\n\nHills, trams and pastries.",
    "",
]


def eval_record(condition, k, *, inter=0.5, tokens=1234, **kw):
    doc = DOCS[k % len(DOCS)]
    return EvalRecord(
        eval_id=f"{condition}/{k}",
        condition=condition,
        item_id=f"item-{k}",
        model=f"model-{condition}",
        system_prompt="Be proactive. ✓",
        sim_prompt="lazy_full",
        sim_model="sim-9b",
        judge_model="judge-27b",
        seed=k,
        messages=[ChatMessage("user", "help me write about lisbon"), ChatMessage("assistant", "Sure — which days?")],
        reference=REFERENCE,
        assistant_tokens=tokens + k,
        metrics={"bleu": bleu(doc, REFERENCE), "interactivity": inter, "token_amount": (tokens + k) / 1000},
        document=doc,
        judge=[
            JudgeOutput(op="extract", raw="{...}", attempts=2),
            JudgeOutput(op="interactivity", raw="x", ok=False, error="bad json"),
        ],
        version=3,
        created=1717000000.123456789,
        **kw,
    )


def scored(version=2):
    tokens = dict(token_ids_i32=arrays.pack_ids([1, 2, 3, 4]), loss_mask_u8=arrays.pack_mask([0, 0, 1, 1]))
    lps = [dict(logprobs_f32=arrays.pack_logprobs(x)) for x in [[-0.1, -0.2], [-0.3]]]
    traj = Trajectory(
        traj_id="t1/0",
        task_id="t1",
        sample=0,
        run="r",
        item_id="item-0",
        messages=[ChatMessage("system", "sys"), ChatMessage("user", "u"), ChatMessage("assistant", "a")],
        **tokens,
        turns=[
            AssistantTurn(start=2, version=version - 1, finish_reason="stop", **lps[0]),
            AssistantTurn(start=3, version=version, finish_reason="length", **lps[1]),
        ],
        reference=REFERENCE,
        assistant_tokens=3,
        sim_prompt="lazy_full",
        model="smol",
        seed=7,
        timings={"generate": 0.5},
    )
    return Scored(
        traj_id="t1/0",
        task_id="t1",
        sample=0,
        run="r",
        metrics={"bleu": 0.25, "interactivity": 2 / 3, "token_amount": 0.003},
        weights={"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1},
        total=0.9163,
        trajectory=traj,
        document=DOCS[0],
        judge_model="judge",
        created=5.0,
    )


def test_parquet_round_trip_is_exact(tmp_path):
    recs = [eval_record("base", k, inter=0.1 + 0.2) for k in range(3)]
    recs.append(
        EvalRecord(
            eval_id="bare",
            condition="c",
            item_id="i",
            model="",
            system_prompt="",
            sim_prompt="",
            sim_model="",
            judge_model="",
            seed=0,
            messages=[],
            reference="",
            assistant_tokens=0,
        )
    )
    path = write_parquet(recs, tmp_path / "log" / "records.parquet")
    assert read_records(path) == recs
    assert read_records(write_jsonl(recs, tmp_path / "records.jsonl")) == recs


def test_scored_round_trip_and_conversion(tmp_path):
    s = scored()
    # the Parquet log stores the arrays as lists of numbers and reads them back packed
    [back] = read_log(write_parquet([s], tmp_path / "scored.parquet"))
    assert back == s
    assert read_log(write_jsonl([s], tmp_path / "scored.jsonl")) == [s]
    rec = read_records(tmp_path / "scored.parquet")[0]
    assert rec == from_scored(s)
    assert (rec.condition, rec.version, rec.item_id, rec.seed) == ("v2", 2, "item-0", 7)
    assert rec.system_prompt == "sys" and rec.assistant_tokens == 3 and rec.metrics == s.metrics


def test_bad_logs_fail_with_the_path(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:1: neither an EvalRecord"):
        read_records(tmp_path / "x.jsonl")
    (tmp_path / "x.csv").write_text("")
    with pytest.raises(ValueError, match="suffix '.csv'"):
        read_records(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "missing.parquet")


def test_reweight_reproduces_stored_bleu_and_applies_new_weights():
    recs = [eval_record("base", k, inter=0.7) for k in range(3)]
    same = reweight(recs, {"bleu": 1.0, "interactivity": 1.0, "token_amount": -0.1})
    for old, new in zip(recs, same):
        assert new.metrics["bleu"] == old.metrics["bleu"]  # exactly: same document, same function
        assert new.metrics["interactivity"] == 0.7
        assert new.metrics["reward"] == pytest.approx(old.metrics["bleu"] + 0.7 - 0.1 * old.assistant_tokens / 1000)
        assert new.messages == old.messages and new.document == old.document
    other = reweight(
        recs, {"bleu": 2.0, "token_amount": -1.0}, clamps={"token_amount": (0.0, 1.0)}, bleu_variant="char"
    )
    assert other[0].metrics["bleu"] == char_bleu(DOCS[0], REFERENCE) != recs[0].metrics["bleu"]
    assert other[0].metrics["reward"] == pytest.approx(2 * char_bleu(DOCS[0], REFERENCE) - 1.0)
    with pytest.raises(ValueError, match="bleu_variant='nltk' not allowed"):
        reweight(recs, {}, bleu_variant="nltk")
    unjudged = EvalRecord(
        eval_id="u",
        condition="c",
        item_id="i",
        model="",
        system_prompt="",
        sim_prompt="",
        sim_model="",
        judge_model="",
        seed=0,
        messages=[],
        reference="r",
        assistant_tokens=1,
    )
    with pytest.raises(ValueError, match="'u' has no stored interactivity"):
        reweight([unjudged], {"bleu": 1.0})


def judge_double(**kw) -> JudgeDouble:
    """The first assistant message as the document and fixed levels."""
    return JudgeDouble(
        model="fake-judge",
        document=first_assistant,
        raw=lambda doc: doc,
        levels={"understanding": 3, "clarification": 0, "suggestions": 3},
        score=2 / 3,
        **kw,
    )


async def test_rejudge_with_another_judge():
    recs = [eval_record("base", k) for k in range(2)]
    out = await rejudge(recs, judge_double(), ScorerConfig(weights={"bleu": 1.0, "interactivity": 1.0}))
    assert [r.document for r in out] == ["Sure — which days?"] * 2
    assert all(r.judge_model == "fake-judge" and r.metrics["interactivity"] == pytest.approx(2 / 3) for r in out)
    assert out[0].metrics["bleu"] == bleu("Sure — which days?", REFERENCE)
    assert out[0].metrics["reward"] == pytest.approx(out[0].metrics["bleu"] + 2 / 3)
    assert out[1].metrics["token_amount"] == recs[1].assistant_tokens / 1000


def test_cli_replay_reweights_a_log_without_generating(tmp_path):
    recs = [eval_record("base", k, inter=0.6) for k in range(3)] + [
        eval_record("new", k, inter=0.8, tokens=900) for k in range(3)
    ]
    log = write_parquet(recs, tmp_path / "records.parquet")
    runner = CliRunner()
    # The records hold sacreBLEU; the embedded default config compares by character BLEU.
    res = runner.invoke(
        app,
        [
            "replay",
            str(log),
            "--weights",
            "bleu=1,interactivity=0.5",
            "--bleu-variant",
            "sacrebleu",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "| condition | n | BLEU | interactivity | tokens (k) | MR | reward |" in res.stdout
    assert "reward weights bleu=1, interactivity=0.5" in res.stdout
    replayed = read_records(tmp_path / "out" / "records.parquet")
    assert [r.metrics["bleu"] for r in replayed] == [r.metrics["bleu"] for r in recs]
    assert [r.metrics["interactivity"] for r in replayed] == [r.metrics["interactivity"] for r in recs]
    assert replayed[3].metrics["reward"] == pytest.approx(recs[3].metrics["bleu"] + 0.4)
    assert (tmp_path / "out" / "chart.png").exists() and (tmp_path / "out" / "table.csv").exists()
    res = runner.invoke(app, ["replay", str(log), "--weights", "bleu=high"])
    assert res.exit_code == 2 and res.stderr.startswith("parley replay: --weights 'bleu=high'")
    res = runner.invoke(app, ["replay", str(log), "--weights", "fluency=1"])
    assert res.exit_code == 2 and "unknown reward metric 'fluency'" in res.stderr
    res = runner.invoke(app, ["replay", str(log), "--baseline", "nope"])
    assert res.exit_code == 2 and "baseline condition 'nope'" in res.stderr


async def test_rejudge_with_the_collabllm_scoring():
    from parley.environments.collabllm import SCORING_VARIANTS

    recs = [eval_record("base", k) for k in range(2)]
    out = await rejudge(
        recs,
        judge_double(score_3level=0.5, raw_3level='{"thought": "one question", "interactivity": 0.5}'),
        ScorerConfig(**SCORING_VARIANTS["collabllm"]),
    )
    assert all(r.metrics["interactivity"] == 0.5 for r in out)
    assert out[0].metrics["bleu"] == char_bleu("Sure — which days?", REFERENCE)
    assert [o.op for o in out[0].judge] == ["extract", "interactivity_3level"]
    # The re-judged log now holds 3-level verdicts, so a later replay without the judge reuses them...
    again = reweight(out, {"bleu": 1.0, "interactivity": 1.0}, bleu_variant="char", interactivity="3level")
    assert [r.metrics["interactivity"] for r in again] == [0.5, 0.5]
    # ...and, asked for a scale, refuses to read them as the rubric (and rubric verdicts as 3-level);
    # asked for none, it reuses what is stored.
    with pytest.raises(ValueError, match="on the '3level' scale, not 'rubric'; re-rate it with the judge"):
        reweight(out, {"bleu": 1.0}, interactivity="rubric")
    assert [r.metrics["interactivity"] for r in reweight(out, {"bleu": 1.0})] == [0.5, 0.5]
    with pytest.raises(ValueError, match="on the 'rubric' scale, not '3level'"):
        reweight(recs, {"bleu": 1.0}, interactivity="3level")


def test_cli_replay_scoring_collabllm(tmp_path):
    recs = [eval_record("base", k, inter=0.6) for k in range(3)]
    log = write_parquet(recs, tmp_path / "records.parquet")
    runner = CliRunner()
    # The stored verdicts are on the rubric: the exact variant needs the judge to re-rate them.
    res = runner.invoke(app, ["replay", str(log), "--scoring", "collabllm"])
    assert res.exit_code == 2 and "on the 'rubric' scale, not '3level'" in res.stderr
    res = runner.invoke(app, ["replay", str(log), "--scoring", "paper"])
    assert res.exit_code == 2 and res.stderr.startswith(
        "parley replay: --scoring 'paper' not allowed; use one of collabllm"
    )
    threes = [
        msgspec.structs.replace(
            r,
            judge=[JudgeOutput(op="extract", raw="{}"), JudgeOutput(op="interactivity_3level", raw="{}")],
            metrics={**r.metrics, "interactivity": 1.0},
        )
        for r in recs
    ]
    log3 = write_parquet(threes, tmp_path / "threes.parquet")
    res = runner.invoke(app, ["replay", str(log3), "--scoring", "collabllm", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "BLEU char, interactivity 3level" in res.stdout
    replayed = read_records(tmp_path / "out" / "records.parquet")
    assert [r.metrics["bleu"] for r in replayed] == [char_bleu(r.document, REFERENCE) for r in recs]


def test_the_learner_archive_is_one_log_per_step_and_a_resume_forgets_later_steps(tmp_path):
    import msgspec

    from parley.learner.checkpoint import archive_dir, truncate_archive, write_archive, write_dropped

    s = scored()
    late = msgspec.structs.replace(s, traj_id="t2/0", task_id="t2")
    assert write_archive(tmp_path, 1, [s]).name == "step000001-trained.parquet"
    write_archive(tmp_path, 2, [late])
    write_dropped(tmp_path, 0, [s])
    write_dropped(tmp_path, 1, [s])
    assert sorted(p.name for p in archive_dir(tmp_path).iterdir()) == [
        "dropped-00000000.parquet",
        "dropped-00000001.parquet",
        "step000001-trained.parquet",
        "step000002-trained.parquet",
    ]
    assert read_log(archive_dir(tmp_path)) == [s, s, s, late]  # a directory reads in name order
    # the ledger names step 1 and archive_seq 1: dropped-00000001 was written before a write that never came
    assert truncate_archive(tmp_path, 1, 1) == 2 and read_log(archive_dir(tmp_path)) == [s, s]
    write_archive(tmp_path, 1, [late])  # trained again after a resume: replaced
    assert read_log(archive_dir(tmp_path)) == [s, late]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no .parquet or .jsonl logs"):
        read_log(empty)


def test_a_conversation_its_actor_abandoned_is_no_record(tmp_path):
    """The learner's archive keeps abandoned samples (cut short, never judged, total 0) with their
    dropped groups; a replay must neither judge half a conversation nor average its empty reward."""
    s = scored()
    cut = msgspec.structs.replace(
        s,
        traj_id="t/1",
        sample=1,
        metrics={},
        weights={},
        total=0.0,
        trajectory=msgspec.structs.replace(s.trajectory, terminated=ABANDONED_STALE),
    )
    path = write_parquet([s, cut], tmp_path / "archive.parquet")
    assert len(read_log(path)) == 2
    assert read_records(path) == [from_scored(s)]
