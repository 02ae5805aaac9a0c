"""CollabLLM medium document writing as an environment: an adapter over tasks/ (data, split, task
building) and rewards/ (metrics, weights, MR), adding no behaviour of its own. Registered as
`collabllm_medium` in pyproject.toml; the default environment of a run.
"""

from __future__ import annotations

from collections.abc import Mapping

from environments.base import (
    Environment,
    EvalProtocol,
    Finished,
    JudgeMetric,
    PureMetric,
    Reward,
    SimulatorUser,
    TaskSource,
)
from protocol.messages import JudgeReply, Task
from rewards.metrics import BLEU_VARIANTS, interactivity_from_levels, token_amount
from rewards.reward import default_weights, mr
from tasks.data import Item, task_from_item, train_eval_items

NAME = "collabllm_medium"

# The simulator prompt a CollabLLM run plays under by default ([rollout].sim_prompt's default).
SIM_PROMPT = "lazy_full"


def _leakage_keys(item: Item) -> Mapping[str, str]:
    # a shared reference document is the label itself; a shared prompt is only worth a note
    return {"reference": item.reference_key, "prompt": item.prompt_key}


def _tokens_k(metrics: Mapping[str, float], record: Finished) -> float:
    # the table's tokens (k) come from the record's own assistant tokens, not the (futures-averaged) metric
    return token_amount(record.assistant_tokens)


def _mr(metrics: Mapping[str, float], record: Finished) -> float:
    return mr(metrics["bleu"], metrics["interactivity"], _tokens_k(metrics, record))


def _eval_task(item: Item, *, run: str, task_id: str, n: int, rollout, seed: int, version: int,
               split: str = "eval") -> Task:
    """The benchmark plays every item from scratch: the simulated user opens (no dataset prefix),
    whatever [rollout].mode training uses. The condition supplies the system prompt."""
    return Task(
        task_id=task_id, run=run, item_id=item.item_id, n=n, mode="conversation", prefix=[],
        reference=item.reference, title=item.title, summary=item.summary, sim_prompt=rollout.sim_prompt,
        max_new_turns=rollout.max_new_turns, max_tokens=rollout.max_tokens, seed=seed,
        admitted_version=version, split=split,
    )


def environment(bleu_variant: str = "sacrebleu") -> Environment:
    """CollabLLM medium; `bleu_variant` is [scorer].bleu_variant (sacrebleu | char)."""
    if bleu_variant not in BLEU_VARIANTS:
        raise ValueError(f"bleu_variant={bleu_variant!r} not allowed; use one of {tuple(BLEU_VARIANTS)}")
    bleu_fn = BLEU_VARIANTS[bleu_variant]
    weights = default_weights()

    def bleu(reply: JudgeReply, conv: Finished) -> float:
        return bleu_fn(reply.document, conv.reference)

    def interactivity(reply: JudgeReply, conv: Finished) -> float:
        return interactivity_from_levels(reply.levels)  # the levels are the verdict, not reply.score

    return Environment(
        name=NAME,
        description="CollabLLM medium: help a lazy user write a document (LLM simulator and judge)",
        tasks=TaskSource(train_eval=train_eval_items, task=task_from_item, leakage_keys=_leakage_keys,
                         leaks=("reference",)),
        user=SimulatorUser(prompt=SIM_PROMPT),
        reward=Reward(metrics=(
            JudgeMetric("bleu", op="extract", value=bleu, weight=weights["bleu"]),
            JudgeMetric("interactivity", op="interactivity", value=interactivity, weight=weights["interactivity"]),
            PureMetric("token_amount", compute=lambda conv: token_amount(conv.assistant_tokens),
                       weight=weights["token_amount"]),
        )),
        eval=EvalProtocol(
            columns=("bleu", "interactivity", "tokens_k", "mr"),
            select="mr",
            selectable=("bleu", "interactivity", "mr"),
            derived={"tokens_k": _tokens_k, "mr": _mr},
            task=_eval_task,
        ),
    )
