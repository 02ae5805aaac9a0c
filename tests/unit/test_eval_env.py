"""The benchmark side of an environment other than CollabLLM medium, on hidden_goal: held-out goals
become eval tasks as training plays them, the programmatic user answers in-process (no simulator) and
the reward scores without a judge, the table shows hidden_goal's columns, `select` picks by goal_match
unless told otherwise and refuses CollabLLM's columns, replay recomputes the pure metrics, and the
leakage guard works on the environment's own keys. The policy is a test double (ScriptedPolicy)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from parley.config.learner import DataConfig
from parley.config.scorer import ScorerConfig
from parley.environments.hidden_goal import NAME, Goal, environment, final_answer, world
from parley.evaluation.benchmark import summarize, to_markdown
from parley.evaluation.runner import Condition, EvalServices, EvalSettings, Policy, make_tasks, run_eval
from parley.protocol.messages import ChatMessage, EvalRecord
from tests.unit.test_environments import this_checkout  # noqa: F401  (fixture: this checkout's entry points)

PIZZA = Goal("pizza", (("size", "large"), ("crust", "thin"), ("topping", "ham")))
COFFEE = Goal("coffee", (("drink", "latte"), ("milk", "oat"), ("cup", "small")))
GUESS = "Guess at once."  # the system prompt of the condition that never asks


class ScriptedPolicy:
    """Test double of engines.engine.PolicyEngine: under the GUESS system prompt it answers at once with
    the first value of every slot; otherwise it asks for every slot in one message, then states what
    the user answered. It reads the conversation from the prompt, so concurrent conversations are fine."""

    class settings:
        max_model_len = 4096

    def __init__(self, tok):
        self.tok = tok
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.calls = 0

    async def generate(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop_token_ids=None):
        from parley.engines.engine import GenOut

        self.calls += 1
        prompt = self.tok.decode(prompt_ids)
        domain = next(d for d in world().domains.values() if d.opening in prompt)
        names = [s.name for s in domain.slots]
        answers = dict(re.findall(r"(\w+): ([\w ]+?)[,.]", prompt.split(domain.opening, 1)[1]))
        if GUESS in prompt:
            text = "FINAL: " + ", ".join(f"{s.name}={s.values[0]}" for s in domain.slots)
        elif all(n in answers for n in names):
            text = "FINAL: " + ", ".join(f"{n}={answers[n]}" for n in names)
        else:
            text = "Which " + ", which ".join(names) + "?"
        ids = self.tok.encode(text, add_special_tokens=False) + [self.end]
        return GenOut(ids, [-0.1] * len(ids), "stop", text)


def services_for(env, tok):
    engine = ScriptedPolicy(tok)

    async def open_policy(model):
        return Policy(engine=engine, tokenizer=tok, version=0)

    # No simulator and no judge: hidden_goal needs neither, so nothing may ask them.
    return EvalServices(open_policy=open_policy, sim=None, judge=None, scorer_cfg=ScorerConfig(), env=env), engine


def test_eval_tasks_are_the_environments():
    env = environment(n_items=6)
    settings = EvalSettings(seeds=2, max_new_turns=8, assistant_max_tokens=64, sim_prompt="", run="b")
    tasks = make_tasks([PIZZA, COFFEE], settings, env)
    assert [t.task_id for t in tasks] == [f"eval/{g.item_id}/{k}" for g in (PIZZA, COFFEE) for k in (0, 1)]
    t = tasks[0]
    assert t.prefix == [ChatMessage("user", "I want to order a pizza.")] and t.reference == PIZZA.hidden()
    assert "FINAL: size=<size>, crust=<crust>, topping=<topping>" in t.system_prompt
    assert (t.sim_prompt, t.split, t.mode, t.max_new_turns, t.max_tokens, t.n) == (
        NAME,
        "eval",
        "conversation",
        8,
        64,
        1,
    )


def test_hidden_goal_is_played_and_scored_without_simulator_or_judge(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    env = environment(n_items=6)
    services, engine = services_for(env, tok)
    conds = [Condition(name="ask", model="m"), Condition(name="guess", model="m", system_prompt=GUESS)]
    settings = EvalSettings(max_new_turns=8, assistant_max_tokens=64, concurrency=4, sim_prompt="")
    records = asyncio.run(run_eval(conds, [PIZZA, COFFEE], settings, services))

    by = {(r.condition, r.item_id): r for r in records}
    ask, guess = by["ask", PIZZA.item_id], by["guess", PIZZA.item_id]
    # the task's own system prompt unless the condition names one
    assert ask.messages[0].role == "system" and "FINAL:" in ask.messages[0].content and ask.system_prompt == ""
    assert guess.messages[0].content == GUESS
    assert [m.content for m in ask.messages if m.role == "user"] == [
        "I want to order a pizza.",
        "size: large, crust: thin, topping: ham.",
    ]
    assert ask.sim_model == f"programmatic:{NAME}" and ask.judge_model == "" and ask.sim_prompt == NAME
    assert ask.metrics == {"goal_match": 1.0, "exact": 1.0, "assistant_turns": 2.0}
    # pizza guessed small/thin/mushroom: only the crust is right
    assert guess.metrics == {"goal_match": pytest.approx(1 / 3), "exact": 0.0, "assistant_turns": 1.0}
    assert by["guess", COFFEE.item_id].metrics["goal_match"] == pytest.approx(1 / 3)  # espresso, whole, small: the cup
    assert engine.calls == 2 * 2 + 2  # two asking conversations of two turns, two guesses of one

    table = summarize(records, baseline="ask", env=env)
    assert table.metrics == ["goal_match", "exact", "assistant_turns"]
    assert table.row("ask").means == {"goal_match": 1.0, "exact": 1.0, "assistant_turns": 2.0}
    diff = table.row("guess").diffs["goal_match"]
    assert diff.n == 2 and diff.mean_diff == pytest.approx((1 / 3 + 1 / 3) / 2 - 1.0)
    md = to_markdown(table)
    assert "| condition | n | goal_match | exact | assistant_turns |" in md


def test_columns_of_another_environment_are_named_when_missing():
    from parley.evaluation.benchmark import record_value

    rec = EvalRecord(
        eval_id="v0/x/0",
        condition="v0",
        item_id="x",
        model="m",
        system_prompt="",
        sim_prompt=NAME,
        sim_model="",
        judge_model="",
        seed=0,
        messages=[],
        reference="",
        assistant_tokens=3,
        metrics={"goal_match": 0.5},
    )
    env = environment(n_items=4)
    assert record_value(rec, "goal_match", env) == 0.5
    with pytest.raises(ValueError, match="has no 'exact' metric"):
        record_value(rec, "exact", env)
    with pytest.raises(ValueError, match="has no 'bleu' metric"):  # CollabLLM's MR needs BLEU
        record_value(rec, "mr")


# ---- selection ---------------------------------------------------------------------------------


def hidden_goal_records(version, match, turns):
    return [
        EvalRecord(
            eval_id=f"v{version}/g{k}/0",
            condition=f"v{version}",
            item_id=f"g{k}",
            model="m",
            system_prompt="",
            sim_prompt=NAME,
            sim_model="",
            judge_model="",
            seed=0,
            messages=[],
            reference="",
            assistant_tokens=10,
            version=version,
            metrics={"goal_match": m, "exact": float(m == 1.0), "assistant_turns": t},
        )
        for k, (m, t) in enumerate(zip(match, turns))
    ]


@pytest.fixture
def hidden_goal_run(tmp_path):
    from parley.evaluation.evallog import write_parquet

    # v1 matches most of the goal (and has the most exact answers); v2 matches less with fewer turns
    plan = {
        0: ([0.0, 1 / 3, 0.0, 1 / 3], [1, 1, 1, 1]),
        1: ([1.0, 2 / 3, 1.0, 1.0], [3, 2, 3, 3]),
        2: ([1 / 3, 2 / 3, 1 / 3, 1.0], [1, 2, 1, 2]),
    }
    for v, (match, turns) in plan.items():
        write_parquet(hidden_goal_records(v, match, turns), tmp_path / "eval" / f"v{v}" / "records.parquet")
    (tmp_path / "eval" / "config.toml").write_text(
        '[env]\nname = "hidden_goal"\noptions = { n_items = 40, seed = 3 }\n'
    )
    return tmp_path


def test_select_picks_by_goal_match_by_default(hidden_goal_run, this_checkout):
    from parley.evaluation.selection import load_versions, run_environment, select_best

    env = run_environment(hidden_goal_run)
    assert env.name == NAME and env.eval.select == "goal_match"
    versions = load_versions(hidden_goal_run)
    assert set(versions[0].items["g0"]) == {"goal_match", "exact", "assistant_turns"}
    sel = select_best(hidden_goal_run)
    assert (sel.metric, sel.version) == ("goal_match", 1)
    assert sel.vs_first.mean_diff == pytest.approx((1 + 2 / 3 + 1 + 1) / 4 - (2 / 3) / 4)
    assert select_best(hidden_goal_run, "exact").version == 1


def test_select_refuses_columns_the_environment_has_not(hidden_goal_run, this_checkout):
    from parley.evaluation.selection import SelectionError, select_best

    with pytest.raises(SelectionError, match="'mr' not allowed; use one of goal_match, exact .*'hidden_goal'"):
        select_best(hidden_goal_run, "mr")
    with pytest.raises(SelectionError, match="'assistant_turns' not allowed"):  # a column, not selectable
        select_best(hidden_goal_run, "assistant_turns")
    with pytest.raises(SelectionError, match="training reward"):
        select_best(hidden_goal_run, "reward")


def test_an_unresolvable_env_section_is_named(tmp_path, this_checkout):
    from parley.evaluation.selection import SelectionError, run_environment

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "config.toml").write_text('[env]\nname = "no_such_env"\n')
    with pytest.raises(SelectionError, match="config.toml: cannot resolve .*unknown environment 'no_such_env'"):
        run_environment(tmp_path)


def test_summary_lines_hold_every_column(tmp_path, this_checkout):
    from parley.evaluation.selection import SelectionError, load_versions, select_best

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "config.toml").write_text('[env]\nname = "hidden_goal"\n')
    lines = [
        json.dumps(
            {
                "version": v,
                "items": {f"g{k}": {"goal_match": m + 0.1 * k, "exact": 0.0, "assistant_turns": 2} for k in range(3)},
            }
        )
        for v, m in ((0, 0.1), (4, 0.5))
    ]
    (tmp_path / "eval" / "summary.jsonl").write_text("\n".join(lines) + "\n")
    assert select_best(tmp_path).version == 4
    (tmp_path / "eval" / "summary.jsonl").write_text('{"version": 1, "items": {"a": {"goal_match": 1}}}\n')
    with pytest.raises(SelectionError, match="item 'a' needs numeric goal_match, exact and assistant_turns"):
        load_versions(tmp_path)


# ---- replay and the leakage guard --------------------------------------------------------------


def test_reweight_recomputes_the_pure_metrics():
    from parley.evaluation.evallog import reweight

    env = environment(n_items=4)
    messages = [
        ChatMessage("user", "I want to order a pizza."),
        ChatMessage("assistant", "Size, crust, topping?"),
        ChatMessage("user", "size: large, crust: thin, topping: ham."),
        ChatMessage("assistant", "FINAL: size=large, crust=thick, topping=ham"),
    ]
    rec = EvalRecord(
        eval_id="a/p/0",
        condition="a",
        item_id=PIZZA.item_id,
        model="m",
        system_prompt="",
        sim_prompt=NAME,
        sim_model="",
        judge_model="",
        seed=0,
        messages=messages,
        reference=PIZZA.hidden(),
        assistant_tokens=20,
        metrics={"goal_match": 0.0, "exact": 1.0, "assistant_turns": 9.0},
    )  # stale values
    [out] = reweight([rec], {"goal_match": 1.0, "assistant_turns": -0.1}, env=env)
    assert out.metrics == pytest.approx(
        {"goal_match": 2 / 3, "exact": 0.0, "assistant_turns": 2.0, "reward": 2 / 3 - 0.2}
    )
    assert final_answer(messages[-1].content) == {"size": {"large"}, "crust": {"thick"}, "topping": {"ham"}}


def test_an_items_file_is_refused_for_a_seeded_environment():
    from parley.evaluation.runner import eval_items

    env = environment(n_items=10)
    train, held = eval_items(DataConfig(eval_fraction=0.3), None, env)
    assert len(held) == 3 and not {g.item_id for g in train} & {g.item_id for g in held}
    with pytest.raises(ValueError, match="--items x.jsonl: environment 'hidden_goal' draws its held-out items"):
        eval_items(DataConfig(eval_fraction=0.3), "x.jsonl", env)


# ---- the learner's periodic eval ---------------------------------------------------------------


def test_periodic_eval_of_hidden_goal_stores_every_column_and_the_environment(tmp_path, this_checkout):
    from parley.config.env import EnvConfig
    from parley.config.learner import LearnerConfig
    from parley.config.run import RunConfig
    from parley.evaluation.periodic import PeriodicEval
    from parley.evaluation.selection import run_environment, select_best
    from parley.learner import checkpoint as ckpt
    from tests.unit.test_periodic_eval import play

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    ckpt.record_base_model(run_dir, base)
    cfg = RunConfig(
        env=EnvConfig(name=NAME, options={"n_items": 30}), learner=LearnerConfig(eval_every=1, eval_items=4)
    )
    cfg.run.dir = str(run_dir)
    assert cfg.learner.eval_metric == "goal_match"  # the environment's choice, resolved by the config
    plan = {0: ([0.0, 1 / 3, 0.0, 0.0], [3, 3, 3, 3]), 1: ([1.0, 1.0, 2 / 3, 1.0], [2, 2, 2, 3])}

    async def planted(job, out):
        from parley.evaluation.evallog import write_parquet

        write_parquet(hidden_goal_records(job.version, *plan[job.version]), out / "records.parquet")
        return 0

    def export(run_dir, version, out):
        out.mkdir(parents=True, exist_ok=True)
        return out

    pe = PeriodicEval(cfg, run_dir, export=export, launch=planted)
    assert pe.metric == "goal_match"
    asyncio.run(play(pe, [0, 1], last=1))
    history = [json.loads(x) for x in (run_dir / "eval" / "history.jsonl").read_text().splitlines()]
    assert [h["version"] for h in history] == [0, 1]
    assert history[1]["goal_match"] == pytest.approx((1 + 1 + 2 / 3 + 1) / 4) and history[1]["assistant_turns"] == 2.25
    assert history[1]["exact"] == 0.75 and "mr" not in history[1]
    assert history[0]["env"] == cfg.env.record() and history[0]["env"]["name"] == NAME
    assert run_environment(run_dir).name == NAME  # from the config the periodic eval wrote
    assert select_best(run_dir).version == 1 and pe.counters()["eval.goal_match"] == history[1]["goal_match"]


def test_parley_select_defaults_to_the_runs_environment(hidden_goal_run, this_checkout):
    """`parley select RUN_DIR` without --metric picks by the environment's own choice (goal_match for
    hidden_goal, never CollabLLM's mr), and --metric mr is refused with the environment's columns."""
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    out = CliRunner().invoke(app, ["select", str(hidden_goal_run)])
    assert out.exit_code == 0, out.output
    assert "goal_match" in out.output and "v1" in out.output.splitlines()[0]
    bad = CliRunner().invoke(app, ["select", str(hidden_goal_run), "--metric", "mr"])
    assert bad.exit_code != 0 and "'mr' not allowed" in bad.output


def test_parley_eval_refuses_a_simulator_prompt_for_a_programmatic_user(this_checkout):
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    out = CliRunner().invoke(
        app, ["eval", "-C", "base=x", "--user-sim-prompt", "lazy_full", "--set", "env.name=hidden_goal"]
    )
    assert out.exit_code == 2, out.output
    assert "programmatic user" in out.output


def test_parley_eval_guards_collabllm_with_the_learners_guard(this_checkout, tmp_path):
    """`parley eval` stops on shared reference targets through guard_environment, as the learner does."""
    from typer.testing import CliRunner

    from parley.deploy.cli import app

    out = CliRunner().invoke(
        app, ["eval", "-C", "base=x", "--items", "bundled", "--out", str(tmp_path), "--set", "data.eval_fraction=0.25"]
    )
    assert out.exit_code == 1, out.output
    assert "share 112 reference targets" in out.output and "--allow-overlap" in out.output  # the 150 - 38 train items


def test_parley_report_charts_the_runs_own_eval_columns(hidden_goal_run, this_checkout):
    """`parley report` (and the end of `parley up`) charts the held-out eval by the run's environment's
    columns: a hidden_goal run's evals have no CollabLLM BLEU or MR (it raised KeyError 'bleu' there)."""
    import json

    from parley.deploy import report

    seen = {}

    original = report.eval_figure

    def chart(series, **kw):  # a spy on the real chart: what the eval PNG was drawn from
        seen["eval.png"] = series
        return original(series, **kw)

    rows = [{"step": 1, "version": 1, "loss": 0.1, "reward_terms": {"goal_match": {"mean": 0.5}}}]
    (hidden_goal_run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report.eval_figure = chart
    try:
        written = report.write_report(hidden_goal_run, hidden_goal_run / "report")
    finally:
        report.eval_figure = original
    assert [p.name for p in written] == ["rewards.png", "kl.png", "eval.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert set(seen["eval.png"]) == {"goal_match", "exact", "assistant_turns"}
    assert seen["eval.png"]["goal_match"][1][:2] == (1, pytest.approx((1.0 + 2 / 3 + 1.0 + 1.0) / 4))
