"""`parley eval --protocol card` (issue 60, item 2): the model card's benchmark as one name. The table in
docs/benchmark.md is exactly evaluation.protocols.CARD; the arms are base / versions / proact; every
value is checked before work starts with a one-line error; the public data (a Hub id, from a cache the
test lays out, offline) loads deduplicated by reference document with the leakage guard applied; and the
command runs end to end through the real runner and report with test doubles for the policy engine,
the simulator and the judge (the card's 14 messages of 4096 tokens are too slow for a real model on CPU)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from parley.evaluation import protocols
from parley.evaluation.protocols import CARD
from parley.evaluation.runner import EvalSettings, make_tasks, parse_condition
from parley.tasks.data import load_items, system_prompt_text
from tests.unit.test_data_by_id import DATASET, TEST, TRAIN, hf_cache, lay_out_dataset  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]


def doc_table() -> dict[str, str]:
    text = (REPO / "docs" / "benchmark.md").read_text()
    section = text.split("## `parley eval --protocol card`", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([a-z_]+)` \| `([^`]*)` \|", section, flags=re.M))


def test_the_docs_table_is_the_protocol():
    table = doc_table()
    fields = {f.name: getattr(CARD, f.name) for f in dataclasses.fields(CARD) if f.name != "name"}
    assert set(table) == set(fields)
    for key, value in fields.items():
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert table[key] == shown, key


def test_the_arms_are_base_the_versions_and_proact_on_the_base_model():
    conds = [parse_condition(c) for c in ("v50=runs/r/checkpoints/v50", "base=Qwen/Qwen3-4B", "v100=ckpt100")]
    given = dict.fromkeys(protocols.FLAGS)  # nothing set on the command line
    applied = protocols.apply(CARD, given, conds, None, None)
    assert [c.name for c in applied.conditions] == ["base", "v50", "v100", "proact"]
    proact = applied.conditions[-1]
    assert proact.model == "Qwen/Qwen3-4B" and proact.system_prompt == system_prompt_text("proact")
    assert "specific" in proact.system_prompt and applied.conditions[0].system_prompt == ""
    assert applied.baseline == "base" and applied.n_items == 100
    assert applied.settings == {
        "sim_prompt": "lazy_full",
        "max_new_turns": 14,
        "assistant_max_tokens": 4096,
        "enable_thinking": False,
        "seeds": 1,
    }
    # what the eval plays: the simulator opens (no dataset prefix), 14 messages, 4096 tokens, lazy_full
    settings = EvalSettings(**applied.settings)
    tasks = make_tasks(load_items("bundled")[:2], settings)
    assert {(t.mode, len(t.prefix), t.max_new_turns, t.max_tokens, t.sim_prompt) for t in tasks} == {
        ("conversation", 0, 14, 4096, "lazy_full")
    }
    # a flag given with the protocol's own value is fine
    same = protocols.apply(CARD, {**given, "max_new_turns": 14, "enable_thinking": False}, conds, "base", 3)
    assert same.n_items == 3


REFUSED = [
    (dict(max_new_turns=10), ["base=m"], None, None, "--max-new-turns 10 conflicts with --protocol card (14)"),
    (dict(enable_thinking=True), ["base=m"], None, None, "--thinking conflicts with --protocol card (thinking off)"),
    (dict(sim_prompt="cooperative"), ["base=m"], None, None, "--user-sim-prompt 'cooperative' conflicts with"),
    ({}, ["v50=ckpt"], None, None, "needs the base model as -C base=MODEL (conditions given: ['v50'])"),
    ({}, ["base=m", "proact=m,system_prompt=proactive"], None, None, "adds the 'proact' arm itself"),
    ({}, ["base=m", "v50=c"], "v50", None, "--baseline 'v50': --protocol card compares with the arm 'base'"),
    ({}, ["base=m,system_prompt=proactive"], None, None, "runs without a system prompt; drop the option"),
    ({}, ["base=m"], None, 0, "--n-items 0: --protocol card needs n >= 1"),
]


@pytest.mark.parametrize("given,conds,baseline,n,needle", REFUSED, ids=[r[-1][:40] for r in REFUSED])
def test_each_bad_value_is_one_line_naming_it_and_the_fix(given, conds, baseline, n, needle):
    with pytest.raises(ValueError) as e:
        protocols.apply(CARD, given, [parse_condition(c) for c in conds], baseline, n)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_protocol_and_too_few_items_are_refused():
    with pytest.raises(ValueError, match=r"^--protocol 'paper' not known; use one of card"):
        protocols.protocol("paper")
    with pytest.raises(ValueError, match=r"^--n-items 20: --items x holds 15 eval items .*pass --n-items 15 or fewer"):
        protocols.check_n(20, 15, "--items x")
    protocols.check_n(15, 15, "--items x")


def cli(*args: str):
    from parley.deploy.cli import app

    return CliRunner().invoke(app, ["eval", *args], catch_exceptions=False)


def test_the_command_checks_n_against_the_deduplicated_items_before_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = cli("--protocol", "card", "-C", "base=tiny", "--dry-run")
    assert out.exit_code == 2
    assert out.output.strip().splitlines() == [
        "parley eval: --protocol card (n = 100): the eval split of [data] holds 38 eval items (one per reference "
        "document); pass --n-items 38 or fewer, or --items a larger set (e.g. the public "
        "collabllm/collabllm-multiturn-medium Hub dataset)"
    ]
    out = cli("--protocol", "card", "-C", "base=tiny", "--max-new-turns", "10", "--n-items", "2", "--dry-run")
    assert out.exit_code == 2 and "--max-new-turns 10 conflicts with --protocol card (14)" in out.output
    out = cli("-C", "base=tiny", "--n-items", "50", "--dry-run")  # without a protocol too: no silent shortfall
    assert out.exit_code == 2 and "--n-items 50: the eval split of [data] holds 38 eval items" in out.output
    out = cli("-C", "base=tiny", "--n-items", "0", "--dry-run")  # 0: all of them, as before
    assert out.exit_code == 0 and "on 38 held-out items" in out.output, out.output
    # the periodic eval's child: [learner] eval_items is "at most" (a run is not stopped at its first eval)
    out = cli("--follow", "--services", "nats", "--n-items", "50", "--dry-run")
    assert out.exit_code == 0 and "on 38 held-out items" in out.output, out.output
    out = cli("--protocol", "card", "-C", "base=tiny", "-C", "v50=tiny", "--n-items", "4", "--dry-run")
    assert out.exit_code == 0, out.output
    assert "# eval: conditions base, v50, proact on 4 held-out items" in out.output
    assert "# protocol card: the simulator (lazy_full) opens, 14 messages, 4096 tokens per assistant turn" in out.output


def test_the_public_data_by_hub_id_is_deduplicated_and_guarded(hf_cache, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    lay_out_dataset(hf_cache, DATASET, {"train": TRAIN, "test": TEST})
    # four rows of two reference documents: two items; n beyond them is refused with the count
    out = cli("--protocol", "card", "-C", "base=tiny", "--items", DATASET, "--dry-run")
    assert out.exit_code == 2
    assert f"--protocol card (n = 100): --items {DATASET} holds 2 eval items (one per reference document)" in out.output
    out = cli("--protocol", "card", "-C", "base=tiny", "--items", DATASET, "--n-items", "2", "--dry-run")
    assert out.exit_code == 0 and "on 2 held-out items" in out.output, out.output
    # trained on the Hub train split, evaluated on its test split: document B is on both sides
    args = ["--protocol", "card", "-C", "base=tiny", "--items", f"{DATASET}#test", "--n-items", "2", "--dry-run"]
    out = cli(*args, "--set", f'data.path="{DATASET}"', "--set", "data.eval_fraction=0.0")
    assert out.exit_code == 1 and "train and eval share 1 reference targets" in out.output, out.output
    out = cli(*args, "--set", f'data.path="{DATASET}"', "--set", "data.eval_fraction=0.0", "--allow-overlap")
    assert out.exit_code == 0, out.output


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_parley_eval_with_the_card_protocol_plays_the_arms_and_prints_the_winners_and_the_flag(
    tok, tmp_path, monkeypatch
):
    """The command itself, through the real runner (rollout.conversation, rollout.score) and report: only
    the policy engine, the simulator and the judge are test doubles. The proact arm writes long drafts and
    v50 short ones, so v50's MR gain over base is bought by the token term and flagged."""
    import parley.evaluation.commands as commands
    from parley.evaluation.runner import EvalServices, Policy
    from parley.evaluation.runner import run_eval as play
    from parley.protocol.messages import JudgeReply, SimReply
    from tests.unit.test_rollout import EngineDouble

    monkeypatch.chdir(tmp_path)
    seen = SimpleNamespace(sim=[], prompts={}, settings=None, conds=None)
    drafts = {"tiny": "A draft. " * 40, "smol": "A draft."}

    class Sim:
        async def ask(self, req):
            seen.sim.append(req)
            return SimReply(message="a blog post please" if not req.messages else "thanks", done=bool(req.messages))

    class Judge:
        async def ask(self, op, messages, *, seed=0):
            if op == "extract":
                return JudgeReply(ok=True, document=messages[-1].content, model="judge-double")
            levels = {"understanding": 2, "clarification": 1, "suggestions": 1}
            dist = {k: {str(v): 1.0} for k, v in levels.items()}  # the embedded default's rubric_expected
            return JudgeReply(ok=True, levels=levels, distribution=dist, model="judge-double")

    async def fake_run_eval(stop, cfg, conds, held, settings, services, baseline, out, version, env, in_process):
        seen.settings, seen.conds = settings, conds

        async def open_policy(model):
            engine = EngineDouble(tok, [drafts[model]])
            engine.settings = SimpleNamespace(max_model_len=8192)
            return Policy(engine=engine, tokenizer=tok, version=0)

        svc = EvalServices(open_policy=open_policy, sim=Sim(), judge=Judge(), scorer_cfg=cfg.scorer, env=env)
        records = await play(conds, held, settings, svc)
        for r in records:
            seen.prompts[r.condition] = r.system_prompt
        return commands.report(records, [], len(conds) * len(held), baseline, out, env)

    monkeypatch.setattr(commands, "run_eval", fake_run_eval)
    out = cli("--protocol", "card", "-C", "base=tiny", "-C", "v50=smol", "--n-items", "2", "--out", str(tmp_path))
    assert out.exit_code == 0, out.output
    s = seen.settings
    assert (s.max_new_turns, s.assistant_max_tokens, s.sim_prompt, s.enable_thinking, s.seeds) == (
        14,
        4096,
        "lazy_full",
        False,
        1,
    )
    assert [c.name for c in seen.conds] == ["base", "v50", "proact"]
    assert seen.prompts["proact"] == system_prompt_text("proact") and seen.prompts["base"] == ""
    assert all(r.prompt == "lazy_full" for r in seen.sim)
    assert sum(not r.messages for r in seen.sim) == 2 * 3  # the simulator opened every conversation
    assert "protocol card: the simulator (lazy_full) opens" in out.output
    assert "| base |" in out.output and "| v50 |" in out.output and "| proact |" in out.output
    assert "Best mean of each metric:" in out.output
    assert re.search(r"\| v50 \| .*\| MR gain dominated by the token term \|", out.output), out.output
    assert (tmp_path / "flags.json").is_file() and (tmp_path / "table.md").is_file()
    record = json.loads((tmp_path / "protocol.json").read_text())
    assert record["name"] == "card" and record["n_items"] == 2 and record["max_new_turns"] == 14
    assert [(a["name"], a["model"], a["system_prompt"]) for a in record["arms"]] == [
        ("base", "tiny", ""),
        ("v50", "smol", ""),
        ("proact", "tiny", "proact"),
    ]
