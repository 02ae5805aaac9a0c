"""CollabLLM medium document writing as an environment: an adapter over tasks/ (data, split, task
building) and rewards/ (metrics, weights, MR), adding no behaviour of its own. Registered as
`collabllm_medium` in pyproject.toml; the default environment of a run.
"""

from __future__ import annotations

from collections.abc import Mapping

from parley.environments.base import (
    Environment,
    EvalProtocol,
    Finished,
    JudgeMetric,
    PureMetric,
    Reward,
    SimulatorUser,
    TaskSource,
)
from parley.protocol.messages import JudgeReply, Task
from parley.rewards.extract import EXTRACTORS, last_document
from parley.rewards.metrics import (
    BLEU_VARIANTS,
    EXTRACT_QUOTES,
    INTERACTIVITY_SCALES,
    TOKEN_AMOUNTS,
    future_words,
    interactivity_from_3level,
    interactivity_from_distribution,
    interactivity_from_levels,
    quoted,
)
from parley.rewards.metrics import token_amount as tokens_k  # the parameter token_amount names the variant
from parley.rewards.reward import default_weights, mr
from parley.tasks.data import SIM_PROMPT, Item, load_items, split_items, task_from_item, train_eval_items

NAME = "collabllm_medium"

# The options that say how CollabLLM is scored. A run sets them in [scorer] (bleu_variant, extract,
# interactivity; `parley replay --scoring` names sets of them), and config/run.py passes them here.
SCORING_OPTIONS = ("bleu_variant", "extract", "interactivity", "token_amount", "extract_quotes")
# Named scoring variants (`parley replay --scoring NAME`): the [scorer] settings they fix. "collabllm" is
# the paper's scoring: character BLEU as NLTK computes it, the 3-level interactivity judge, and the
# document copied out by the judge, assistant tokens in thousands. "verl-collabllm" is verl's recipe
# (docs/recipe.md): character BLEU, the three-criteria rubric, words after the dataset prefix.
SCORING_VARIANTS: dict[str, dict[str, str]] = {
    "collabllm": {
        "bleu_variant": "char",
        "interactivity": "3level",
        "extract": "judge",
        "token_amount": "assistant_tokens_k",
        "extract_quotes": "keep",
    },
    "verl-collabllm": {
        "bleu_variant": "char",
        "interactivity": "rubric",
        "extract": "judge",
        "token_amount": "future_words",
        "extract_quotes": "single",
    },
}


def _leakage_keys(item: Item) -> Mapping[str, str]:
    # a shared reference document is the label itself; a shared prompt is only worth a note
    return {"reference": item.reference_key, "prompt": item.prompt_key}


def _tokens_k(metrics: Mapping[str, float], record: Finished) -> float:
    # the table's tokens (k) come from the record's own assistant tokens, not the (futures-averaged) metric
    return tokens_k(record.assistant_tokens)


def _mr(metrics: Mapping[str, float], record: Finished) -> float:
    return mr(metrics["bleu"], metrics["interactivity"], _tokens_k(metrics, record))


def _items_file(data, path: str) -> tuple[list[Item], list[Item]]:
    """`parley eval --items FILE`: the file's items, against the training data of [data] (only the
    train side of a file that is split for training)."""
    train = load_items(data.path)
    if not data.eval_path:
        train = split_items(train, data.eval_fraction, data.split_seed)[0]
    return train, load_items(path)


def _eval_task(
    item: Item, *, run: str, task_id: str, n: int, rollout, seed: int, version: int, split: str = "eval"
) -> Task:
    """The benchmark plays every item from scratch: the simulated user opens (no dataset prefix),
    whatever [rollout].mode training uses. The condition supplies the system prompt."""
    return Task(
        task_id=task_id,
        run=run,
        item_id=item.item_id,
        n=n,
        mode="conversation",
        prefix=[],
        reference=item.reference,
        title=item.title,
        summary=item.summary,
        sim_prompt=rollout.sim_prompt or SIM_PROMPT,
        max_new_turns=rollout.max_new_turns,
        max_tokens=rollout.max_tokens,
        seed=seed,
        admitted_version=version,
        split=split,
    )


def _document(conv: Finished, replies: Mapping[str, JudgeReply]) -> str:
    # what BLEU compared: the judge's copy when it made one, else the newest draft in the conversation
    return replies["extract"].document if "extract" in replies else last_document(conv.messages)


def environment(
    bleu_variant: str = "sacrebleu",
    extract: str = "judge",
    interactivity: str = "rubric",
    token_amount: str = "assistant_tokens_k",
    extract_quotes: str = "keep",
) -> Environment:
    """CollabLLM medium, scored as [scorer] says: `bleu_variant` sacrebleu | char; `extract` judge (the
    judge copies the document out) | last_document (rewards/extract.py, no judge call); `interactivity`
    rubric (levels 0..3 on three criteria) | rubric_expected (the same rubric, each criterion's expected
    level under the judge's own distribution over the level tokens) | 3level (CollabLLM's 1 / 0.5 / 0);
    `token_amount` assistant_tokens_k (assistant tokens / 1000) | future_words (the words after the
    dataset prefix, user and assistant, as verl's recipe counts them); `extract_quotes` keep | single
    (the document's double quotes written as single ones before BLEU, as verl's recipe asks its judge)."""
    for name, value, allowed in (
        ("bleu_variant", bleu_variant, tuple(BLEU_VARIANTS)),
        ("extract", extract, EXTRACTORS),
        ("interactivity", interactivity, tuple(INTERACTIVITY_SCALES)),
        ("token_amount", token_amount, TOKEN_AMOUNTS),
        ("extract_quotes", extract_quotes, EXTRACT_QUOTES),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} not allowed; use one of {allowed}")
    bleu_fn = BLEU_VARIANTS[bleu_variant]
    weights = default_weights()

    def bleu_of_reply(reply: JudgeReply, conv: Finished) -> float:
        return bleu_fn(quoted(reply.document, extract_quotes), conv.reference)

    def bleu_of_draft(conv: Finished) -> float:
        return bleu_fn(quoted(last_document(conv.messages), extract_quotes), conv.reference)

    def rubric(reply: JudgeReply, conv: Finished) -> float:
        return interactivity_from_levels(reply.levels)  # the levels are the verdict, not reply.score

    def rubric_expected(reply: JudgeReply, conv: Finished) -> float:
        return interactivity_from_distribution(reply.distribution)

    def three_level(reply: JudgeReply, conv: Finished) -> float:
        return interactivity_from_3level(reply.score)

    bleu = (
        JudgeMetric("bleu", op="extract", value=bleu_of_reply, weight=weights["bleu"])
        if extract == "judge"
        else PureMetric("bleu", compute=bleu_of_draft, weight=weights["bleu"])
    )
    inter_op = INTERACTIVITY_SCALES[interactivity]

    def amount(conv: Finished) -> float:
        if token_amount == "future_words":
            return future_words(m.content for m in conv.messages[getattr(conv, "new_from", 0) :])
        return tokens_k(conv.assistant_tokens)

    inter_value = {"rubric": rubric, "rubric_expected": rubric_expected, "3level": three_level}[interactivity]

    return Environment(
        name=NAME,
        description="CollabLLM medium: help a lazy user write a document (LLM simulator and judge)",
        tasks=TaskSource(
            train_eval=train_eval_items,
            task=task_from_item,
            leakage_keys=_leakage_keys,
            leaks=("reference",),
            items_file=_items_file,
        ),
        user=SimulatorUser(prompt=SIM_PROMPT),
        reward=Reward(
            metrics=(
                bleu,
                JudgeMetric("interactivity", op=inter_op, value=inter_value, weight=weights["interactivity"]),
                PureMetric("token_amount", compute=amount, weight=weights["token_amount"]),
            ),
            document=_document,
        ),
        scorer_options=SCORING_OPTIONS,
        scoring_variants=SCORING_VARIANTS,
        eval=EvalProtocol(
            columns=("bleu", "interactivity", "tokens_k", "mr"),
            select="mr",
            selectable=("bleu", "interactivity", "mr"),
            derived={"tokens_k": _tokens_k, "mr": _mr},
            task=_eval_task,
        ),
    )
