"""score_trajectory with a judge test double: metrics, futures averaging, clamps, failures (never a 0)."""

from __future__ import annotations

import pytest

from parley.config.scorer import ScorerConfig
from parley.protocol import examples
from parley.protocol.messages import ChatMessage, FutureRollout
from parley.rewards.metrics import bleu, char_bleu
from parley.rewards.reward import default_weights
from parley.rollout.score import Unscorable, conversations, score_trajectory
from parley.services.judge.client import JudgeFailed, JudgeUnavailable
from tests.factories import JudgeDouble

REFERENCE = "A Week in Lisbon\n\nThe trams climb the hills while the river shines below."


def judge_double(levels_by_len=None, **kw) -> JudgeDouble:
    """The extracted document is the last assistant message of the conversation it is shown, and the
    interactivity levels come from a table keyed by the number of messages."""
    return JudgeDouble(
        model="fake", levels_by_len=levels_by_len, score=0.123, raw=lambda doc: f'{{"document": "{doc[:10]}"}}', **kw
    )


def _traj(**kw):
    traj = examples.trajectory("unit")
    traj.reference = REFERENCE
    traj.futures = []
    traj.messages = [
        ChatMessage("user", "can you help me with a blog post"),
        ChatMessage("assistant", "A Week in Lisbon\n\nThe trams climb the hills."),
    ]
    traj.assistant_tokens = 400
    for k, v in kw.items():
        setattr(traj, k, v)
    return traj


async def test_one_conversation_metrics_and_total():
    traj = _traj()
    judge = judge_double({2: {"understanding": 3, "clarification": 0, "suggestions": 3}})
    cfg = ScorerConfig()
    scored = await score_trajectory(traj, judge, cfg, scorer="s-1")
    doc = traj.messages[-1].content
    assert scored.document == doc
    assert scored.metrics["bleu"] == pytest.approx(bleu(doc, REFERENCE))
    # The score is recomputed from the levels, not taken from the reply's score field.
    assert scored.metrics["interactivity"] == pytest.approx(6 / 9)
    assert scored.metrics["token_amount"] == pytest.approx(0.4)
    expected = scored.metrics["bleu"] + 6 / 9 - 0.1 * 0.4
    assert scored.total == pytest.approx(expected)
    assert scored.weights == default_weights()  # [scorer] weights {} = the reward's default weights
    assert (scored.traj_id, scored.task_id, scored.sample, scored.run) == (
        traj.traj_id,
        traj.task_id,
        traj.sample,
        "unit",
    )
    assert scored.trajectory == traj and scored.scorer == "s-1" and scored.judge_model == "fake"
    assert [o.op for o in scored.judge] == ["extract", "interactivity"] and all(o.ok for o in scored.judge)
    assert {"extract", "interactivity", "total"} <= set(scored.timings)


async def test_char_bleu_variant():
    traj = _traj()
    scored = await score_trajectory(traj, judge_double(), ScorerConfig(bleu_variant="char"))
    assert scored.metrics["bleu"] == pytest.approx(char_bleu(traj.messages[-1].content, REFERENCE))


async def test_futures_are_averaged_per_metric_before_weighting():
    traj = _traj(
        futures=[
            FutureRollout(
                messages=[ChatMessage("user", "shorter"), ChatMessage("assistant", REFERENCE)], assistant_tokens=100
            ),
            FutureRollout(messages=[ChatMessage("user", "ok")], assistant_tokens=0),
        ]
    )
    # Future 0 -> 4 messages, future 1 -> 3 messages.
    judge = judge_double(
        {
            4: {"understanding": 3, "clarification": 3, "suggestions": 3},
            3: {"understanding": 0, "clarification": 0, "suggestions": 0},
        }
    )
    convs = conversations(traj)
    assert [len(m) for m, _ in convs] == [4, 3] and [n for _, n in convs] == [500, 400]
    scored = await score_trajectory(traj, judge, ScorerConfig())
    # Future 0 ends with the reference itself (BLEU 1); future 1's last assistant turn is the trajectory's.
    b1 = bleu(traj.messages[-1].content, REFERENCE)
    assert scored.metrics["bleu"] == pytest.approx((1.0 + b1) / 2)
    assert scored.metrics["interactivity"] == pytest.approx(0.5)
    assert scored.metrics["token_amount"] == pytest.approx((0.5 + 0.4) / 2)
    assert scored.total == pytest.approx((1.0 + b1) / 2 + 0.5 - 0.1 * 0.45)
    assert sorted(judge.calls) == sorted([("extract", 4), ("interactivity", 4), ("extract", 3), ("interactivity", 3)])
    assert len(scored.judge) == 4
    assert scored.document == REFERENCE  # the first future's document


async def test_clamps_bound_the_metric_before_weighting():
    traj = _traj(assistant_tokens=5000)  # 5 k tokens
    cfg = ScorerConfig(clamps={"token_amount": [0.0, 1.0], "interactivity": [0.0, 0.5]})
    scored = await score_trajectory(traj, judge_double(), cfg)
    assert scored.metrics["token_amount"] == pytest.approx(5.0)  # stored unclamped
    assert scored.metrics["interactivity"] == pytest.approx(1.0)
    assert scored.total == pytest.approx(scored.metrics["bleu"] + 0.5 - 0.1 * 1.0)
    # the recipe travels with the total: a reader (the learner's diagnostics) needs no [scorer] section
    assert scored.clamps == {"token_amount": [0.0, 1.0], "interactivity": [0.0, 0.5]}


async def test_clamp_acts_on_the_future_average():
    futures = [FutureRollout(messages=[ChatMessage("user", "go on")], assistant_tokens=t) for t in (0, 2000)]
    traj = _traj(assistant_tokens=0, futures=futures)
    cfg = ScorerConfig(weights={"token_amount": -1.0}, clamps={"token_amount": [0.0, 1.5]})
    scored = await score_trajectory(traj, judge_double(), cfg)
    # mean(0, 2) = 1.0 lies inside the clamp; clamping each future first would give mean(0, 1.5) = 0.75.
    assert scored.total == pytest.approx(-1.0)


@pytest.mark.parametrize("op", ["extract", "interactivity"])
async def test_judge_failure_raises_and_never_scores_zero(op):
    with pytest.raises(JudgeFailed, match=f"judge {op} failed for t-0001/0 after 4 attempt"):
        await score_trajectory(_traj(), judge_double(fail_op=op), ScorerConfig())


async def test_failure_in_one_future_fails_the_whole_trajectory():
    futures = [FutureRollout(messages=[ChatMessage("user", "go on")]), FutureRollout(messages=[])]
    judge = judge_double({3: {"understanding": 9, "clarification": 0, "suggestions": 0}})  # level out of range
    with pytest.raises(JudgeFailed, match="unusable"):
        await score_trajectory(_traj(futures=futures), judge, ScorerConfig())


async def test_unavailable_judge_propagates():
    with pytest.raises(JudgeUnavailable):
        await score_trajectory(_traj(), judge_double(unavailable=True), ScorerConfig())


async def test_missing_levels_are_a_failure_not_a_zero():
    judge = judge_double({2: {"understanding": 2}})
    with pytest.raises(JudgeFailed, match="clarification"):
        await score_trajectory(_traj(), judge, ScorerConfig())


async def test_trajectory_without_reference_is_unscorable():
    with pytest.raises(Unscorable, match="no reference"):
        await score_trajectory(_traj(reference="  "), judge_double(), ScorerConfig())


def test_retry_delay_doubles_and_is_capped():
    cfg = ScorerConfig(retry_delay_s=2.0, retry_max_delay_s=10.0)
    assert [cfg.retry_delay(n) for n in (1, 2, 3, 4, 5)] == [2.0, 4.0, 8.0, 10.0, 10.0]


async def test_seed_goes_to_the_judge():
    seen = []

    class SeedJudgeDouble(JudgeDouble):
        async def extract(self, messages, *, seed=0):
            seen.append(seed)
            return await super().extract(messages, seed=seed)

    await score_trajectory(_traj(seed=7), SeedJudgeDouble(), ScorerConfig())
    await score_trajectory(_traj(seed=7), SeedJudgeDouble(), ScorerConfig(), seed=2007)
    assert seen == [7, 2007]


async def test_last_document_extractor_asks_no_judge_for_the_document():
    draft = "A Week in Lisbon\n\n" + "The trams climb the hills while the river shines below us all day. " * 3
    traj = _traj(
        messages=[
            ChatMessage("user", "can you help me with a blog post"),
            ChatMessage("assistant", "Sure! Here is a draft:\n\n" + draft + "\n\nLet me know what you think!"),
        ]
    )
    judge = judge_double()
    scored = await score_trajectory(traj, judge, ScorerConfig(extract="last_document"))
    assert scored.document == draft.strip()
    assert scored.metrics["bleu"] == pytest.approx(bleu(draft.strip(), REFERENCE))
    assert [op for op, _ in judge.calls] == ["interactivity"]
    assert [o.op for o in scored.judge] == ["interactivity"] and scored.judge_model == "fake"


def three_level_judge(value, ok=True) -> JudgeDouble:
    return judge_double(score_3level=value, **({} if ok else {"fail_op": "interactivity_3level", "attempts": 2}))


async def test_collabllm_variant_uses_the_3level_judge_and_nltk_char_bleu():
    from parley.environments.collabllm import SCORING_VARIANTS

    traj = _traj()
    judge = three_level_judge(0.5)
    scored = await score_trajectory(traj, judge, ScorerConfig(**SCORING_VARIANTS["collabllm"]))
    assert sorted(op for op, _ in judge.calls) == ["extract", "interactivity_3level"]
    assert scored.metrics["interactivity"] == 0.5
    assert scored.metrics["bleu"] == pytest.approx(char_bleu(traj.messages[-1].content, REFERENCE))
    # token amount: the same assistant tokens / 1000 as the default scoring
    assert scored.metrics["token_amount"] == pytest.approx(0.4)
    assert scored.total == pytest.approx(scored.metrics["bleu"] + 0.5 - 0.04)


async def test_3level_value_off_the_scale_or_a_failure_is_never_a_score():
    cfg = ScorerConfig(interactivity="3level")
    with pytest.raises(JudgeFailed, match="unusable.*must be one of"):
        await score_trajectory(_traj(), three_level_judge(0.7), cfg)
    with pytest.raises(JudgeFailed, match="interactivity_3level failed"):
        await score_trajectory(_traj(), three_level_judge(1.0, ok=False), cfg)


@pytest.mark.parametrize("field,value", [("extract", "longest"), ("interactivity", "5level")])
def test_unknown_variants_are_refused_with_the_allowed_names(field, value):
    with pytest.raises(ValueError, match=f"{field}='{value}' not allowed; use one of"):
        ScorerConfig(**{field: value})
