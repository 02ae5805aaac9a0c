"""deploy/configs/gpu-1-collab.toml, issue 31's CollabLLM-medium run on one GPU: it is the run the card's
table needs (at least 50 steps, the embedded default's scoring, an eval every 10 versions on 24 held-out
items that its [data] split really holds) and it keeps on disk every version bench/collab_gpu.sh phase 2
evaluates: 0, the versions at 25/50/75/100 % of the run and any version the periodic eval can select."""

from __future__ import annotations

from pathlib import Path

from bench.collab_table import FRACTIONS
from parley.config.run import load_config

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "gpu-1-collab.toml"


def test_the_collab_run_has_the_issues_shape_and_the_embedded_default_scoring():
    cfg = load_config(CONFIG)
    lc = cfg.learner
    assert cfg.env.name == "collabllm_medium"
    assert lc.steps >= 50 and lc.eval_every == 10 and lc.eval_items >= 24
    assert (cfg.scorer.extract, cfg.scorer.bleu_variant, cfg.scorer.interactivity) == (
        "last_document",
        "char",
        "rubric_expected",
    )
    assert cfg.sim.engine.model == cfg.judge.engine.model == cfg.policy.model == "smol"


def test_the_held_out_split_holds_the_24_items_the_eval_asks_for():
    # the split the learner's feeder, its leakage guard and `parley eval` all take: the run's
    # environment splitting its [data] (for collabllm_medium, tasks.data.train_eval_items)
    cfg = load_config(CONFIG)
    train, held = cfg.env.load().tasks.train_eval(cfg.data)
    assert len(held) >= cfg.learner.eval_items >= 24, (len(held), cfg.learner.eval_items, cfg.data)
    assert len({it.reference_key for it in held}) == len(held)  # 24 documents, not 24 copies of fewer
    assert train and not {it.reference_key for it in train} & {it.reference_key for it in held}


def test_every_version_phase_2_evaluates_is_checkpointed_and_kept():
    lc = load_config(CONFIG).learner
    assert lc.keep_checkpoints == 0  # all kept: `parley export` consolidates any of them
    fractions = {round(f * lc.steps) for f in FRACTIONS}
    evaluated = set(range(lc.eval_every, lc.steps + 1, lc.eval_every))  # what `parley select` can name
    assert all(v % lc.checkpoint_every == 0 for v in fractions | evaluated), (fractions, evaluated, lc.checkpoint_every)
