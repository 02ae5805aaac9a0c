"""bench/peer_trl.py and bench/peer_compare.py without TRL: the recipe is part P's run, TRL's config
says what parley's learner does (or the script refuses), the items are the ones parley's feeder and
periodic eval play, the rollout hook plays parley conversations in engine batches and hands TRL
parley's tokens, mask, log-probs and reward, and the comparison reads both runs' records."""

from __future__ import annotations

import json
import re
import shlex
import types
from pathlib import Path

import pytest

from bench import peer_compare, peer_trl
from parley.engines.engine import GenOut
from parley.environments.hidden_goal import parse_hidden
from parley.learner.feeder import item_order

ROOT = Path(__file__).resolve().parents[2]


def part_p_sets(eval_every: int) -> list[str]:
    """The --set values bench/gpu_run.sh part P gives both systems (its HG list)."""
    text = (ROOT / "bench" / "gpu_run.sh").read_text()
    body = re.search(r"\n    HG=\((.*?)\)\n", text, re.S).group(1).replace("$EVAL_EVERY", str(eval_every))
    body = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", body)  # ${LR:-1e-4}: what bash gives with LR unset
    words = shlex.split(body)
    return [words[i + 1] for i, w in enumerate(words) if w == "--set"]


def test_the_default_recipe_is_part_ps_run_of_parley():
    default = peer_trl.recipe_dict(peer_trl.load_recipe(None, [], steps=30, eval_every=10))
    part_p = peer_trl.recipe_dict(peer_trl.load_recipe(peer_trl.DEFAULT_CONFIG, part_p_sets(10), steps=30))
    assert default == part_p
    assert (default["n"], default["groups_per_step"], default["max_tokens"], default["max_new_turns"]) == (8, 1, 32, 6)
    assert (default["temperature"], default["lr"], default["kl_coef"], default["eval_items"]) == (0.7, 1e-4, 0.0, 24)
    assert default["env_options"] == {"n_items": 120, "seed": 0, "nudge": "slots", "answer": "mentions"}
    assert default["reward_weights"] == {"goal_match": 1.0, "assistant_turns": -0.05}


def test_trls_config_is_parleys_loss_and_schedule():
    cfg = peer_trl.load_recipe(None, ["learner.clip_low=0.1", "learner.clip_high=0.3", "learner.is_cap=4.0"], steps=7)
    kw = peer_trl.trl_kwargs(cfg, output_dir="/tmp/x")
    assert (kw["num_generations"], kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (8, 8, 1)
    assert (kw["max_steps"], kw["max_completion_length"], kw["learning_rate"]) == (7, 32, 1e-4)
    assert (kw["epsilon"], kw["epsilon_high"], kw["vllm_importance_sampling_clip_max"]) == (0.1, 0.3, 4.0)
    assert (kw["beta"], kw["loss_type"], kw["scale_rewards"], kw["lr_scheduler_type"]) == (
        0.0,
        "dapo",
        "group",
        "constant",
    )
    assert (kw["vllm_mode"], kw["use_vllm"], kw["shuffle_dataset"], kw["num_iterations"]) == (
        "colocate",
        True,
        False,
        1,
    )
    assert (kw["temperature"], kw["top_p"], kw["max_grad_norm"], kw["gradient_checkpointing"]) == (0.7, 1.0, 1.0, False)
    assert "vllm_mode" not in peer_trl.trl_kwargs(cfg, output_dir="/tmp/x", vllm=False)
    clipped = peer_trl.load_recipe(None, ['learner.behaviour_correction="clip"', "learner.dual_clip=5.0"])
    assert peer_trl.trl_kwargs(clipped, output_dir="/tmp/x")["vllm_importance_sampling_clip_max"] == 5.0


@pytest.mark.parametrize(
    "sets, match",
    [
        (['learner.adv_std="population"'], "TRL divides by the sample std only"),
        (['learner.loss_agg="seq-mean-token-sum"'], "has no TRL loss_type"),
    ],
)
def test_what_trl_cannot_match_is_refused_with_the_setting(sets, match):
    with pytest.raises(ValueError, match=match):
        peer_trl.trl_kwargs(peer_trl.load_recipe(None, sets), output_dir="/tmp/x")


def test_the_docstrings_table_is_the_settings_at_the_defaults():
    rows = peer_trl.settings_rows(peer_trl.load_recipe(None, []))
    assert peer_trl.settings_markdown(rows) in peer_trl.__doc__
    by_name = {r["setting"]: r for r in rows}
    assert by_name["reward"]["parley"] == "goal_match - 0.05 assistant_turns (parley's scorer)"
    assert by_name["advantage"]["parley"].startswith("(r - mean) / (sample std")


def test_the_items_are_the_feeders_tasks_and_the_periodic_evals():
    cfg = peer_trl.load_recipe(None, [], steps=130)
    env = cfg.env.load()
    train, held = env.tasks.train_eval(cfg.data)
    items = peer_trl.build_items(cfg, env)
    assert len(items.train) == 130 and len(items.held) == 24 == len(held)
    assert [t.task_id for t in items.train[:2]] == ["gpu1-g000000", "gpu1-g000001"]
    # the feeder's order over the training split, a fresh permutation each epoch
    assert [t.item_id for t in items.train] == [train[item_order(len(train), i, 0)].item_id for i in range(130)]
    assert all(t.n == 8 and t.max_tokens == 32 and t.split == "train" for t in items.train)
    assert [t.task_id for t in items.held] == [f"eval/{it.item_id}/0" for it in held]
    assert all(t.n == 1 and t.seed == 0 and t.split == "eval" for t in items.held)
    assert not {t.item_id for t in items.held} & {t.item_id for t in items.train}


def test_samples_are_numbered_within_their_group():
    assert peer_trl.group_samples(["a", "a", "b", "a", "b"]) == [("a", 0), ("a", 1), ("b", 0), ("a", 2), ("b", 1)]


def test_eval_schedule_is_the_periodic_evals():
    assert [v for v in range(12) if peer_trl.eval_due(v, 5, 11)] == [0, 5, 10, 11]
    assert not any(peer_trl.eval_due(v, 0, 11) for v in range(12))


class ScriptedEngine(peer_trl.ColocatedEngine):
    """The colocated engine with llm.generate scripted: round 1 asks for every slot, round 2 states the
    goal for samples of even seed and says nothing for the others, round 3 states it. Records the batch sizes."""

    def __init__(self, tok, goal: dict[str, str]):
        super().__init__(llm=None)
        self.tok, self.goal, self.batches = tok, goal, []
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def _run(self, requests):
        self.calls += 1
        self.batches.append(len(requests))
        out = []
        for _, kw in requests:
            if self.calls == 1:
                text = " ".join(self.goal) + "?"
            elif self.calls == 2 and kw["seed"] % 2:
                text = "hmm"
            else:
                text = " ".join(self.goal.values())
            ids = self.tok.encode(text, add_special_tokens=False)[: kw["max_tokens"] - 1] + [self.end]
            out.append(GenOut(ids, [-0.5] * len(ids), "stop", text))
        return out


def test_the_rollout_hook_plays_parley_conversations_in_batches_and_returns_parleys_tokens(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = peer_trl.load_recipe(None, ["rollout.max_tokens=64"], steps=1)
    env = cfg.env.load()
    items = peer_trl.build_items(cfg, env)
    task = items.train[0]
    _, goal = parse_hidden(task.reference)
    record = peer_trl.Record(t0=0.0)
    player = peer_trl.Player(cfg, env, items, tok, record)
    engine = ScriptedEngine(tok, goal)
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(global_step=0))

    out = player.rollout([task.task_id] * 8, trainer, engine)

    late = engine.batches[2] if len(engine.batches) > 2 else 0
    assert engine.batches == [8, 8] + ([late] if late else [])  # every round of turns is one engine call
    assert sorted(out["parley_total"]) == sorted([1 - 3 * 0.05] * late + [1 - 2 * 0.05] * (8 - late))
    opening = tok.apply_chat_template(
        [{"role": "system", "content": task.system_prompt}, {"role": "user", "content": task.prefix[0].content}],
        tokenize=False,
        add_generation_prompt=True,
    )
    for prompt, completion, mask, lps in zip(
        out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"]
    ):
        assert prompt == tok.encode(opening, add_special_tokens=False)
        assert len(completion) == len(mask) == len(lps)
        assert [lp != 0.0 for lp in lps] == [bool(m) for m in mask]  # behaviour log-probs exactly on trained tokens
        assert mask[0] == 1 and 0 in mask  # an assistant turn first, then a user turn that is not trained
    ro = record.rollouts[-1]
    assert ro["conversations"] == 8 and ro["trained_tokens"] == sum(map(sum, out["env_mask"]))
    assert ro["goal_match_mean"] == 1.0 and ro["flat_groups"] == (1 if late in (0, 8) else 0)


def _write_runs(out: Path) -> None:
    """A parley run and a TRL run of three steps each, launched 100 s apart on the device clock."""
    out.mkdir()
    (out / "p_clock.json").write_text(
        json.dumps(
            {
                "parley_start": 1000.0,
                "parley_start_local": "2026-12-02 10:00:00.000000000",
                "parley_end": 1060.0,
                "trl_start": 1100.0,
                "trl_end": 1150.0,
            }
        )
    )
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "trained_tokens": 100 * s}) + "\n" for s in (1, 2, 3))
    )
    (out / "parley_steps.log").write_text(
        "2026-12-02 10:00:30,000 learner INFO parley.learner.stepper: step 1: loss 0.1, 1 groups\n"
        "2026-12-02 10:00:30,500 learner INFO parley.evaluation.periodic: eval: version 0 ...\n"
        "2026-12-02 10:00:31,000 learner INFO parley.learner.stepper: step 2: loss 0.1, 1 groups\n"
        "2026-12-02 10:00:32,000 learner INFO parley.learner.stepper: step 3: loss 0.1, 1 groups\n"
    )
    (out / "eval_history.jsonl").write_text(
        json.dumps({"version": 0, "step": 0, "n": 24, "seconds": 20.0, "goal_match": 0.1, "created": 1040.0})
        + "\n"
        + json.dumps({"version": 3, "step": 3, "n": 24, "seconds": 2.0, "goal_match": 0.5, "created": 1050.0})
        + "\n"
    )
    # TRL's step 3 trained one group of equal rewards (flat): its tokens carry no gradient
    steps = [
        {"step": s, "t_end": 1100.0 + t, "trained_tokens": 100 * s, "conversations": 8, "flat_groups": int(s == 3)}
        for s, t in ((1, 20.0), (2, 24.0), (3, 28.0))
    ]
    evals = [
        {"version": 0, "n": 24, "seconds": 1.0, "t_end": 1110.0, "goal_match": 0.1},
        {"version": 2, "n": 24, "seconds": 1.0, "t_end": 1125.0, "goal_match": 0.2},
        {"version": 3, "n": 24, "seconds": 2.0, "t_end": 1130.0, "goal_match": 0.3},
    ]
    (out / "peer_trl.json").write_text(
        json.dumps({"recipe": {"steps": 3, "n": 8}, "settings": [], "steps": steps, "evals": evals, "ended_at": 1131.0})
    )


def test_the_comparison_reads_both_runs_steady_state_and_rewards_at_equal_wall_time(tmp_path):
    _write_runs(tmp_path / "out")
    res = peer_compare.compare(tmp_path / "out")
    p, t = res["parley"], res["trl"]
    # parley: steps end 30, 31, 32 s after launch; steps 2-3 trained 500 tokens in 2 s
    assert (p["first_step_end_s"], p["wall_s_per_step"], p["trained_tokens_per_s"], p["total_s"]) == (
        30.0,
        1.0,
        250.0,
        60.0,
    )
    assert (t["first_step_end_s"], t["wall_s_per_step"], t["trained_tokens_per_s"], t["total_s"]) == (
        20.0,
        4.0,
        62.5,
        31.0,
    )
    assert t["wall_s_per_step_without_eval"] == 3.5  # the v2 eval ran between steps 2 and 3, the v3 one after
    assert res["speedup_trained_tokens_per_s"] == 4.0
    # with signal only: parley's 500 tokens in 2 s against TRL's step 2 alone, 200 tokens in 8 s
    assert (p["signal_tokens_per_s"], t["signal_tokens_per_s"], res["speedup_signal_tokens_per_s"]) == (
        250.0,
        25.0,
        10.0,
    )
    assert res["runs"]["same_call"] is True
    assert [(r["t_s"], r["parley"], r["trl"]) for r in res["at_equal_wall_time"]] == [
        (10.0, None, {"version": 0, "goal_match": 0.1}),
        (25.0, None, {"version": 2, "goal_match": 0.2}),
        (30.0, None, {"version": 3, "goal_match": 0.3}),
        (40.0, {"version": 0, "goal_match": 0.1}, {"version": 3, "goal_match": 0.3}),
        (50.0, {"version": 3, "goal_match": 0.5}, {"version": 3, "goal_match": 0.3}),
    ]
    assert res["at_the_shorter_run_s"]["t_s"] == 31.0
    assert "| trained tokens/s (steps 2..N) | 250 | 62 |" in peer_compare.render(res)
    assert res["parley_startup"] == {} and "roles ready" not in peer_compare.render(res)  # a log from before the lines


def test_the_comparison_reads_when_each_of_parleys_roles_came_ready(tmp_path):
    _write_runs(tmp_path / "out")
    (tmp_path / "out" / "up_peer.log").write_text(
        "GPU memory plan (computed from the config and the models' config.json, not measured): GPU total 79.2 GiB "
        "(the CUDA driver, device 0) [+1.4 s]\n"
        "run directory: /tmp/run-peer [+1.5 s]\n"
        'CUDA MPS (gpu_share = "auto"): daemon started (pipes /tmp/p, logs /tmp/run-peer/mps) [+2.6 s]\n'
        "started actor-0: pid 5526, log /tmp/run-peer/logs/actor-0.log [+2.9 s]\n"
        "waiting for: actor-0, learner, scorer-0\n"
        "ready after 3.1 s: scorer-0\n"
        "waiting for: actor-0, learner\n"
        "ready after 21.0 s: actor-0, learner [+32.5 s]\n"  # stamped since issue 56 (deploy.common.stamped)
        "all roles ready in 21.0 s\n"
    )
    res = peer_compare.compare(tmp_path / "out")
    assert res["parley_startup"] == {
        "roles_ready_s": {"scorer-0": 3.1, "actor-0": 21.0, "learner": 21.0},
        "all_ready_s": 21.0,
        "since_launch_s": {"GPU memory plan": 1.4, "run directory": 1.5, "CUDA MPS": 2.6, "started actor-0": 2.9},
    }
    assert (
        "parley's roles ready, s from their launch: scorer-0 3.1, actor-0 21.0, learner 21.0; all 21.0 "
        "(step 1 ended 30.0 s after parley's launch)"
    ) in peer_compare.render(res)
    assert (
        "parley up's start-up lines, s from its launch: GPU memory plan 1.4, run directory 1.5, CUDA MPS 2.6, "
        "started actor-0 2.9"
    ) in peer_compare.render(res)


def test_trls_side_may_come_from_another_call_of_the_part(tmp_path):
    """--trl-out: parley re-run alone in one call, TRL's run and its launch time read from another."""
    _write_runs(tmp_path / "both")
    import shutil

    shutil.copytree(tmp_path / "both", tmp_path / "parley")
    (tmp_path / "parley" / "peer_trl.json").unlink()
    clock = json.loads((tmp_path / "parley" / "p_clock.json").read_text())
    (tmp_path / "parley" / "p_clock.json").write_text(json.dumps({**clock, "trl_start": None, "trl_end": None}))
    alone, both = peer_compare.compare(tmp_path / "parley", tmp_path / "both"), peer_compare.compare(tmp_path / "both")
    assert alone["trl"] == both["trl"] and alone["parley"] == both["parley"]
    assert alone["runs"]["same_call"] is False
    assert "another device call" in peer_compare.render(alone)


def test_a_steady_state_needs_two_steps():
    with pytest.raises(ValueError, match="1 step"):
        peer_compare.steady([{"step": 1, "t": 3.0, "trained_tokens": 9}])


def test_with_truncated_is_both_train_the_same_capped_weight_and_nothing_is_clipped():
    cfg = peer_trl.load_recipe(
        None,
        [
            'learner.behaviour_correction="truncated_is"',
            "learner.is_cap=2.0",
            "learner.checkpoint_every=30",
            "learner.steps=30",
        ],
    )
    kw = peer_trl.trl_kwargs(cfg, output_dir="-")
    assert kw["vllm_importance_sampling_mode"] == "token_truncate"
    assert kw["vllm_importance_sampling_clip_max"] == 2.0
    rows = {r["setting"]: r for r in peer_trl.settings_rows(cfg)}
    assert rows["behaviour mismatch"]["same"] == "yes"
    assert "min(exp(logp - logp_vllm), 2.0)" in rows["behaviour mismatch"]["parley"]
    assert rows["checkpoints"]["same"].startswith("yes")  # parley's only checkpoint is after the last step


def test_the_comparison_also_reads_rewards_from_each_ones_first_step_end(tmp_path):
    """The clock of each system starts when its own step 1 ended (parley 30 s, TRL 20 s after launch);
    an eval in before that (TRL's v0 at 10 s) is left out."""
    _write_runs(tmp_path / "out")
    res = peer_compare.compare(tmp_path / "out")
    assert [(r["t_s"], r["parley"], r["trl"]) for r in res["at_equal_training_time"]] == [
        (5.0, None, {"version": 2, "goal_match": 0.2}),
        (10.0, {"version": 0, "goal_match": 0.1}, {"version": 3, "goal_match": 0.3}),
        (20.0, {"version": 3, "goal_match": 0.5}, {"version": 3, "goal_match": 0.3}),
    ]


def test_parleys_step_breakdown_is_the_medians_of_steps_2_to_n_and_of_the_actors_task_lines():
    metrics = [
        {"step": 1, "wait_s": 90.0, "train_s": 19.0, "publish_s": 0.5},
        {"step": 2, "wait_s": 0.9, "train_s": 0.3, "publish_s": 0.02},
        {"step": 3, "wait_s": 0.7, "train_s": 0.2, "publish_s": 0.04, "checkpoint_s": 2.0},
        {"step": 4, "wait_s": 0.8, "train_s": 0.4, "publish_s": 0.03, "checkpoint_s": 2.1},
    ]
    lines = [
        "2026-12-02 10:00:31,000 actor-0 INFO parley.actors.actor: task gpu1-t000002: 8 samples stored in 1.20s "
        "(900 assistant tokens generated so far)",
        "2026-12-02 10:00:32,000 actor-0 INFO parley.actors.actor: task gpu1-t000003: 8 samples stored in 0.80s "
        "(1800 assistant tokens generated so far); a sample's mean: play 0.500s, generate 0.300s, simulator "
        "0.100s, rest 0.100s",
        "2026-12-02 10:00:32,100 actor-0 INFO parley.weights.follow: now serving weights version 3 (was 2)",
        "2026-12-02 10:00:32,200 actor-0 INFO parley.rollout.conversation: task gpu1-t000004: stopped after 1 messages: a "
        "trained turn of version 2 lags the announced version 3 by 1 > max_staleness 0",
        "2026-12-02 10:00:32,300 actor-0 INFO parley.rollout.conversation: task gpu1-t000004: stopped after 0 messages: a "
        "trained turn of version 2 lags the announced version 3 by 1 > max_staleness 0",
        "2026-12-02 10:00:32,400 actor-0 INFO parley.rollout.conversation: task gpu1-t000005: turn cut after 3 messages: a "
        "trained turn of version 2 lags the announced version 3 by 1 > max_staleness 0",
        "2026-12-02 10:00:32,500 actor-0 INFO parley.rollout.conversation: task gpu1-t000006: simulator call cut after 2 "
        "messages: a trained turn of version 2 lags the announced version 3 by 1 > max_staleness 0",
    ]
    assert peer_compare.step_breakdown(metrics, lines) == {
        "wait_s": 0.8,
        "train_s": 0.3,
        "publish_s": 0.03,
        "checkpoints_before_the_last_step": 1,
        "task_play_s": 1.0,
        "tasks_played": 2,
        "conversations_stopped": 2,
        "generations_cut": 1,
        "simulator_calls_cut": 1,
        # the second line's split (since 2026-12-05; the first, older line has none)
        "sample_play_s": 0.5,
        "sample_generate_s": 0.3,
        "sample_simulator_s": 0.1,
        "sample_rest_s": 0.1,
    }


def test_where_parleys_training_went_is_read_when_its_steps_recorded_it():
    """The learner's phases of train_s (learner.steplog.PHASES, recorded since 2026-12-05 night): their
    medians over steps 2..N join the breakdown; runs from before carry none and get none."""
    phases = {"forward_s": 0.05, "backward_s": 0.1, "readback_s": 0.01, "optimizer_s": 0.08, "release_s": 0.02}
    metrics = [
        {"step": 1, "train_s": 9.0, **{k: 1.0 for k in phases}},
        *({"step": s, "train_s": 0.3, **{k: v * s / 2 for k, v in phases.items()}} for s in (2, 3, 4)),
    ]
    got = peer_compare.step_breakdown(metrics, [])
    assert {k: got[k] for k in phases} == pytest.approx({k: v * 1.5 for k, v in phases.items()})  # steps 2-4: step 3
    assert "forward_s" not in peer_compare.step_breakdown(
        [{k: v for k, v in m.items() if k not in phases} for m in metrics], []
    )


def test_the_settings_table_names_what_part_p_gave_parley_alone(tmp_path):
    """PARLEY_SETS and ACTORS (recorded in p_clock.json) reach the comparison's settings table: the
    engines row names the actors that ran, and a row lists the parley-only settings."""
    _write_runs(tmp_path / "out")
    peer = json.loads((tmp_path / "out" / "peer_trl.json").read_text())
    peer["settings"] = [
        {"setting": "engines", "parley": "2 actor vLLM engines and an eval engine", "trl": "one", "same": "no"}
    ]
    (tmp_path / "out" / "peer_trl.json").write_text(json.dumps(peer))
    assert peer_compare.compare(tmp_path / "out")["settings"] == peer["settings"]  # older clocks: as it was
    clock = json.loads((tmp_path / "out" / "p_clock.json").read_text())
    (tmp_path / "out" / "p_clock.json").write_text(
        json.dumps({**clock, "parley_sets": "learner.oversample_groups=2", "actors": 1})
    )
    rows = peer_compare.compare(tmp_path / "out")["settings"]
    assert rows[0]["parley"].startswith("1 actor vLLM engines")
    assert rows[1] == {
        "setting": "parley only (PARLEY_SETS, not in TRL's run)",
        "parley": "learner.oversample_groups=2",
        "trl": "-",
        "same": "no",
    }
    (tmp_path / "out" / "p_clock.json").write_text(json.dumps({**clock, "parley_steps": 36, "trl_steps": 30}))
    rows = peer_compare.compare(tmp_path / "out")["settings"]  # PARLEY_STEPS: for equal wall time
    assert rows[-1] == {"setting": "steps (PARLEY_STEPS)", "parley": "36", "trl": "30", "same": "no"}
    (tmp_path / "out" / "p_clock.json").write_text(json.dumps({**clock, "parley_steps": 30, "trl_steps": 30}))
    assert all(r["setting"] != "steps (PARLEY_STEPS)" for r in peer_compare.compare(tmp_path / "out")["settings"])


def _row_under_sets(out: Path, row: dict):
    """`_write_runs` with TRL's settings table cut to `row`; returns compared(PARLEY_SETS) -> the
    compared table's row for that call's p_clock.json with those parley_sets."""
    _write_runs(out)
    peer = json.loads((out / "peer_trl.json").read_text())
    (out / "peer_trl.json").write_text(json.dumps({**peer, "settings": [row]}))
    clock = json.loads((out / "p_clock.json").read_text())

    def compared(sets: str) -> dict:
        (out / "p_clock.json").write_text(json.dumps({**clock, "parley_sets": sets}))
        return peer_compare.compare(out)["settings"][0]

    return compared


def test_a_lag_given_to_parley_alone_is_the_one_its_lag_row_names(tmp_path):
    """PARLEY_SETS with learner.max_staleness=0 (the lag-0 runs of 2026-12-05): the policy-lag row says
    parley ran at lag 0, as TRL does, not the shared recipe's lag of 1."""
    lag_row = {
        "setting": "policy lag",
        "parley": "async: groups up to max_staleness = 1 versions old (older: drop)",
        "trl": "synchronous: every group from the current weights",
        "same": "no",
    }
    compared = _row_under_sets(tmp_path / "out", lag_row)
    row = compared('learner.max_staleness=0 learner.oversample_groups=2 learner.group_order="freshest"')
    assert "max_staleness = 0 (PARLEY_SETS)" in row["parley"] and row["same"] == "yes"
    row = compared("learner.max_staleness=2")
    assert "max_staleness = 2 (PARLEY_SETS)" in row["parley"] and row["same"] == "no"
    assert compared("learner.oversample_groups=2") == lag_row  # no lag given: the recipe's row


def test_engines_without_torch_compile_given_to_parley_alone_are_named_in_the_compilation_row(tmp_path):
    """TORCH_COMPILE=0 (PARLEY_SETS actor.engine.torch_compile=false): TRL's table names the recipe's
    compiled engine on both sides; the compared table says parley's ran without."""
    recipe_row = {r["setting"]: r for r in peer_trl.settings_rows(peer_trl.load_recipe(None, []))}["vLLM compilation"]
    compared = _row_under_sets(tmp_path / "out", recipe_row)
    row = compared('actor.engine.start_method="fork" actor.engine.torch_compile=false')
    assert "decode steps only (PARLEY_SETS)" in row["parley"] and row["same"].startswith("no")
    assert row["trl"] == recipe_row["trl"]
    assert compared('actor.engine.start_method="fork"') == recipe_row  # compiled: the recipe's row


def _seeded_runs(out: Path, seed: int, trl_last: float, **clock_fields) -> None:
    """`_write_runs` at `seed` (p_clock.json), TRL's last held-out goal_match set to `trl_last`."""
    _write_runs(out)
    clock = json.loads((out / "p_clock.json").read_text())
    (out / "p_clock.json").write_text(json.dumps({**clock, "seed": seed, **clock_fields}))
    peer = json.loads((out / "peer_trl.json").read_text())
    peer["evals"][-1]["goal_match"] = trl_last
    (out / "peer_trl.json").write_text(json.dumps(peer))


def test_calls_at_several_seeds_are_summed_up_by_their_means_and_paired_differences(tmp_path, capsys):
    """`peer_compare.py --over A B`: one row per call (its seed from p_clock.json), then the means; the
    goal counts as met by the means only at a mean ratio >= 1.5 and a mean paired difference >= 0."""
    for name, seed, trl_last in (("s0", 0, 0.3), ("s1", 1, 0.7)):
        _seeded_runs(tmp_path / name, seed, trl_last, parley_sets="x=1")
    res = peer_compare.over_seeds([tmp_path / "s0", tmp_path / "s1"])
    assert [r["seed"] for r in res["calls"]] == [0, 1]
    assert [r["difference"] for r in res["calls"]] == [0.2, -0.2]  # parley's last is 0.5 in both
    assert res["means"] == {
        "ratio": 4.0,
        "signal_ratio": 10.0,
        "ratio_without_trls_eval": 3.5,
        "steps_ratio": 4.0,
        "steps_ratio_without_trls_eval": 3.5,
        "parley_last": 0.5,
        "trl_last": 0.5,
        "difference": 0.0,
        # 8 s after each one's step 1 (TRL's step 3): parley's v3 had ended 2 s after its step 1
        "parley_at_trls_end": 0.5,
        "trl_at_trls_end": 0.5,
        "difference_at_trls_end": 0.0,
        "calls_at_trls_end": 2,
    }
    assert (
        res["goal_met_by_the_means"] is True and res["goal_met_at_equal_training_time"] is True
    )  # 4x at an equal mean
    single = peer_compare.ROOT / "bench" / "results" / "raw" / "peer_trl.json"  # --out's default --json
    before = single.stat().st_mtime_ns if single.exists() else None  # raw output is not in git
    assert peer_compare.main(["--over", str(tmp_path / "s0"), str(tmp_path / "s1")]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 4.00x (10.00x; 3.50x) | 1.000 / 4.000 | 4.00x (3.50x) | 250 / 250 |" in out
    assert "goal met by the means: True" in out
    assert (single.stat().st_mtime_ns if single.exists() else None) == before  # without --json, --over writes nothing


def test_with_more_steps_parley_counts_the_version_it_had_trained_when_trls_run_ended(tmp_path, capsys):
    """PARLEY_STEPS > STEPS: the held-out reward at equal training time is each one's latest evaluated
    version whose step had ended by the end of TRL's last evaluated step (8 s after TRL's step 1 here),
    counted from each one's own step 1; parley's v5, ended 12 s after its step 1, comes too late to
    count, though it is parley's last. When an eval result came in does not matter."""
    _seeded_runs(tmp_path / "p", 1, 0.3, parley_steps=5, trl_steps=3)
    ends = {k: 30 + 3 * (k - 1) for k in range(1, 6)}  # parley's steps end 30, 33, ..., 42 s after launch
    (tmp_path / "p" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": k, "trained_tokens": 1000}) + "\n" for k in ends)
    )
    (tmp_path / "p" / "parley_steps.log").write_text(
        "".join(
            f"2026-12-02 10:00:{t:02d},000 learner INFO parley.learner.stepper: step {k}: loss 0.1, 1 groups\n"
            for k, t in ends.items()
        )
    )
    # every result in late (50-60 s after launch, after parley's last step): they count by their versions
    (tmp_path / "p" / "eval_history.jsonl").write_text(
        "".join(
            json.dumps({"version": v, "step": v, "n": 24, "seconds": 1.0, "goal_match": g, "created": 1000.0 + t})
            + "\n"
            for v, g, t in ((0, 0.1, 50.0), (3, 0.5, 55.0), (5, 0.9, 60.0))
        )
    )
    res = peer_compare.compare(tmp_path / "p")
    assert res["at_trls_last_version"] == {
        "t_s": 8.0,
        "parley": {"version": 3, "goal_match": 0.5},
        "trl": {"version": 3, "goal_match": 0.3},
        "difference": 0.2,
    }
    assert (
        "held-out goal_match at equal training time, 8.0 s after each one's step 1 (the end of TRL's last "
        "evaluated step): parley v3 0.500, TRL v3 0.300, parley - TRL +0.200"
    ) in peer_compare.render(res)
    seeds = peer_compare.over_seeds([tmp_path / "p"])
    assert seeds["calls"][0]["difference"] == 0.6  # each one's last: parley's v5 against TRL's v3
    assert seeds["means"]["difference_at_trls_end"] == 0.2 and seeds["goal_met_at_equal_training_time"] is True
    # a call where parley had evaluated no version trained by then counts against the goal
    (tmp_path / "p" / "eval_history.jsonl").write_text(
        json.dumps({"version": 5, "step": 5, "n": 24, "seconds": 1.0, "goal_match": 0.9, "created": 1045.0}) + "\n"
    )
    late = peer_compare.over_seeds([tmp_path / "p"])
    assert late["calls"][0]["at_trls_end"]["parley"] is None and late["means"]["calls_at_trls_end"] == 0
    assert late["goal_met_by_the_means"] is True and late["goal_met_at_equal_training_time"] is False
    assert "0 of 1 calls with a parley version by then): no call" in peer_compare.render_seeds(late)


def test_a_parley_call_run_alone_is_paired_with_another_calls_trl_at_the_same_seed(tmp_path, capsys):
    """`--over OUT=TRL_OUT`: parley's side from OUT (TRL=0), TRL's from TRL_OUT; the row says the two
    came from different calls, and a pair whose seeds differ is refused with both seeds named."""
    for name, seed, trl_last in (("p1", 1, 0.9), ("t1", 1, 0.7), ("t2", 2, 0.1)):
        _seeded_runs(tmp_path / name, seed, trl_last)
    res = peer_compare.over_seeds([(tmp_path / "p1", tmp_path / "t1")])
    row = res["calls"][0]
    assert row["same_call"] is False and row["trl_out"] == str(tmp_path / "t1")
    assert row["trl_last"]["goal_match"] == 0.7 and row["difference"] == -0.2  # TRL's from t1, not p1's own 0.9
    assert peer_compare.main(["--over", f"{tmp_path / 'p1'}={tmp_path / 't1'}"]) == 0
    assert "TRL's side of seed(s) 1 comes from another call" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        peer_compare.main(["--over", f"{tmp_path / 'p1'}={tmp_path / 't2'}"])
    assert "ran seed 1 but its TRL side" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one pair by --out and --trl-out: the same check
        peer_compare.main(
            ["--out", str(tmp_path / "p1"), "--trl-out", str(tmp_path / "t2"), "--json", str(tmp_path / "x.json")]
        )
    assert "ran seed 1 but its TRL side" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_the_tokens_ratio_is_the_steps_ratio_times_what_each_policy_wrote_a_step(tmp_path):
    """Both train one group a step, so parley / TRL trained tokens/s is the steps/s ratio times the
    ratio of trained tokens a step; a parley policy writing half as many tokens halves the first and
    leaves the second (2026-12-05: 313 against 721 a step at seed 2 gave 0.68x at 1.56x the steps/s)."""
    _write_runs(tmp_path / "out")
    (tmp_path / "out" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "trained_tokens": 50 * s}) + "\n" for s in (1, 2, 3))
    )
    res = peer_compare.compare(tmp_path / "out")
    # parley: steps 2-3 trained 250 tokens in 2 s (125 a step); TRL: 500 tokens in 8 s (250 a step)
    assert (res["parley"]["trained_tokens_per_step"], res["trl"]["trained_tokens_per_step"]) == (125.0, 250.0)
    assert res["speedup_trained_tokens_per_s"] == 2.0
    assert (res["speedup_steps_per_s"], res["speedup_steps_per_s_without_trls_eval"]) == (4.0, 3.5)
    # TRL's steps alone (its v2 eval's 1 s out of the 8): 500 tokens in 7 s against parley's 125 a second
    assert res["speedup_trained_tokens_per_s_without_trls_eval"] == 1.75
    text = peer_compare.render(res)
    assert "| trained tokens a step (steps 2..N) | 125 | 250 |" in text
    assert (
        "parley / TRL steps/s, one group a step on both: 4.00x (3.50x against TRL's steps without its inline eval)"
        in text
    )


def test_a_behaviour_correction_given_to_parley_alone_is_the_one_its_rows_name(tmp_path):
    """PARLEY_SETS with learner.behaviour_correction="clip" (the lag-1 runs of 2026-12-05): the clip-range
    and behaviour-mismatch rows name parley's clip against vLLM's log-probs and say "no", where the
    recipe's rows (both at truncated_is) said "yes"; TRL's cells stay those of the loss it ran."""
    _write_runs(tmp_path / "out")
    recipe = peer_trl.settings_rows(peer_trl.load_recipe(None, []))
    peer = json.loads((tmp_path / "out" / "peer_trl.json").read_text())
    peer["settings"], peer["recipe"]["behaviour_correction"] = recipe, "truncated_is"
    (tmp_path / "out" / "peer_trl.json").write_text(json.dumps(peer))
    clock = json.loads((tmp_path / "out" / "p_clock.json").read_text())
    sets = 'learner.oversample_groups=2 learner.behaviour_correction="clip" learner.clip_high=0.3'
    (tmp_path / "out" / "p_clock.json").write_text(json.dumps({**clock, "parley_sets": sets}))
    rows = {r["setting"]: r for r in peer_compare.compare(tmp_path / "out")["settings"]}
    before = {r["setting"]: r for r in recipe}
    assert before["clip range"]["same"] == "yes" and before["clip range"]["parley"].startswith("none")
    assert rows["clip range"]["parley"] == (
        "[1 - 0.2, 1 + 0.3] on exp(logp - logp_behaviour) (PARLEY_SETS: behaviour_correction = clip)"
    )
    assert "dual clip 3.0 for A < 0" in rows["behaviour mismatch"]["parley"]
    assert rows["clip range"]["same"].startswith("no") and rows["behaviour mismatch"]["same"].startswith("no")
    assert rows["behaviour mismatch"]["trl"] == before["behaviour mismatch"]["trl"]
    (tmp_path / "out" / "p_clock.json").write_text(
        json.dumps({**clock, "parley_sets": 'learner.behaviour_correction="truncated_is"'})
    )
    rows = {r["setting"]: r for r in peer_compare.compare(tmp_path / "out")["settings"]}
    assert rows["clip range"] == before["clip range"]  # the recipe's own correction: its rows as they were


def test_the_same_parley_settings_in_another_order_are_one_setting(tmp_path):
    _seeded_runs(tmp_path / "a", 0, 0.3, parley_sets='x=1 learner.behaviour_correction="clip"')
    _seeded_runs(tmp_path / "b", 1, 0.3, parley_sets='learner.behaviour_correction="clip" x=1')
    _seeded_runs(tmp_path / "c", 2, 0.3, parley_sets="x=1")
    assert len(peer_compare.over_seeds([tmp_path / "a", tmp_path / "b"])["parley_sets"]) == 1
    assert len(peer_compare.over_seeds([tmp_path / "a", tmp_path / "c"])["parley_sets"]) == 2


def test_parleys_steps_end_when_its_learner_recorded_them_not_after_the_last_checkpoint(tmp_path):
    """The learner logs a step's line after that step's checkpoint and eval export, and the last step
    always takes both (3-4 s on the H100, 2026-12-05): timed by its log lines, the steady state would
    carry the final checkpoint, which the settings table puts outside the timed steps. A step ends at
    metrics.jsonl's `ended_at` plus its publish, on the device clock that p_clock.json's
    parley_start shares."""
    _write_runs(tmp_path / "out")
    # steps end 30, 31 and 32 s after the launch (+ 0.01 s of publish); the log's step-3 line is at 36 s
    (tmp_path / "out" / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "trained_tokens": 100 * s,
                    "ended_at": 1000.0 + t,
                    "publish_s": 0.01,
                    **({"checkpoint_s": 3.5} if s == 3 else {}),
                }
            )
            + "\n"
            for s, t in ((1, 29.99), (2, 30.99), (3, 31.99))
        )
    )
    (tmp_path / "out" / "parley_steps.log").write_text(
        "2026-12-02 10:00:30,000 learner INFO parley.learner.stepper: step 1: loss 0.1, 1 groups\n"
        "2026-12-02 10:00:31,000 learner INFO parley.learner.stepper: step 2: loss 0.1, 1 groups\n"
        "2026-12-02 10:00:36,000 learner INFO parley.learner.stepper: step 3: loss 0.1, 1 groups\n"
    )
    p = peer_compare.compare(tmp_path / "out")["parley"]
    assert (p["first_step_end_s"], p["last_step_end_s"], p["wall_s_per_step"], p["trained_tokens_per_s"]) == (
        30.0,
        32.0,
        1.0,
        250.0,
    )
    # timed by the log lines, as before 2026-12-05 evening: the final checkpoint's 4 s were in
    old = peer_compare.compare(tmp_path / "out", timed_by="log")["parley"]
    assert (old["last_step_end_s"], old["wall_s_per_step"]) == (36.0, 3.0)
    with pytest.raises(ValueError, match="timed_by 'wall'"):
        peer_compare.compare(tmp_path / "out", timed_by="wall")


def test_trl_runs_at_its_best_bf16_weights_and_sleep_mode_with_its_defaults_else():
    cfg = peer_trl.load_recipe(None, [])
    kw = peer_trl.trl_kwargs(cfg, output_dir="/tmp/x")
    assert kw["model_init_kwargs"] == {"dtype": "bfloat16"} and kw["bf16"] is True
    assert (kw["vllm_enable_sleep_mode"], kw["vllm_gpu_memory_utilization"]) == (True, 0.3)  # 0.3: TRL's default
    plain = peer_trl.trl_kwargs(cfg, output_dir="/tmp/x", dtype="float32", sleep=False)
    assert plain["model_init_kwargs"] == {"dtype": "float32"} and plain["vllm_enable_sleep_mode"] is False
    cpu = peer_trl.trl_kwargs(cfg, output_dir="/tmp/x", gpu=False)
    assert cpu["vllm_enable_sleep_mode"] is False and cpu["model_init_kwargs"] == {"dtype": "float32"}  # CUDA only
    with pytest.raises(ValueError, match="float16"):
        peer_trl.trl_kwargs(cfg, output_dir="/tmp/x", dtype="float16")
    rows = {r["setting"]: r for r in peer_trl.settings_rows(cfg)}
    assert "no fp32 master" in rows["weights, optimizer precision"]["trl"]
    assert "no padding-free option" in rows["attention, kernels"]["trl"]
    assert "vllm_enable_sleep_mode = true" in rows["generation memory"]["trl"]
    assert rows["weights, optimizer precision"]["same"].startswith("no")  # parley's fp32 master by default
    rows = {r["setting"]: r for r in peer_trl.settings_rows(cfg, dtype="float32", sleep=False)}
    assert "float32 (TRL's default)" in rows["weights, optimizer precision"]["trl"]
    assert "vllm_enable_sleep_mode = false" in rows["generation memory"]["trl"]
    bf16 = peer_trl.load_recipe(None, ['learner.master_dtype="bfloat16"'])  # parley's state in bf16 too
    row = {r["setting"]: r for r in peer_trl.settings_rows(bf16)}["weights, optimizer precision"]
    assert 'master_dtype = "bfloat16"' in row["parley"] and row["same"].startswith("yes")


def test_the_vllm_compilation_row_follows_the_actors_engine():
    """TRL 1.16's colocate engine compiles (vLLM's default); parley's engines without torch.compile are a
    difference the table names."""
    row = {r["setting"]: r for r in peer_trl.settings_rows(peer_trl.load_recipe(None, []))}["vLLM compilation"]
    assert row["same"] == "yes" and "torch_compile = true" in row["parley"]
    assert "passes no compilation setting" in row["trl"]
    sets = ["actor.engine.torch_compile=false", "actor.engine.enforce_eager=false"]
    row = {r["setting"]: r for r in peer_trl.settings_rows(peer_trl.load_recipe(None, sets))}["vLLM compilation"]
    assert row["same"].startswith("no") and "decode steps only" in row["parley"]


def test_the_4b_shape_trains_its_step_in_micro_batches_and_a_bad_one_is_refused_in_one_line(capsys):
    # part TT4: the config as written (`parley up --config` lays no preset under it; --env '' here)
    cfg = peer_trl.load_recipe(ROOT / "deploy" / "configs" / "gpu-1-4b.toml", [], env="")
    assert (cfg.env.name, cfg.rollout.max_tokens) == ("random_words", 384)
    kw = peer_trl.trl_kwargs(cfg, output_dir="/tmp/x", micro_batch=4)
    # 4 groups of 8 a step: 4 conversations a forward, 8 forwards accumulated, one generation of all 32
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["num_generations"]) == (4, 8, 8)
    assert kw["gradient_checkpointing"] is True
    assert peer_trl.main(["--dry-run", "--micro-batch", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "peer_trl.py: micro batch 3: must divide the step's 8 conversations (rollout.n x learner.groups_per_step); "
        "try 4"
    )


class RecordingLLM:
    """Test double of vllm.LLM's sleep API: records the calls."""

    def __init__(self):
        self.calls = []

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))


class FakeGeneration:
    """Test double of TRL 1.16's VLLMGeneration: asleep after its start (level 2), sync_weights wakes
    the weights and loads the trainer's."""

    def __init__(self, llm, enable_sleep_mode=True):
        self.llm, self.enable_sleep_mode = llm, enable_sleep_mode
        self._llm_weights_sleeping = enable_sleep_mode

    def sync_weights(self):
        self.llm.calls.append(("sync_weights",))
        self._llm_weights_sleeping = False


def test_in_sleep_mode_the_engine_is_woken_with_the_trainers_weights_and_put_back_after_a_rollout():
    llm = RecordingLLM()
    engine = peer_trl.ColocatedEngine(llm, FakeGeneration(llm))
    engine.wake()  # the v0 eval: weights and KV back
    engine.wake()  # the eval's next round: nothing more
    engine.sleep()  # after a training rollout: everything handed back for the optimizer step
    engine.wake()
    assert llm.calls == [
        ("sync_weights",),
        ("wake_up", ("kv_cache",)),
        ("sleep", 2),
        ("sync_weights",),
        ("wake_up", ("kv_cache",)),
    ]
    quiet = RecordingLLM()
    plain = peer_trl.ColocatedEngine(quiet, FakeGeneration(quiet, enable_sleep_mode=False))
    plain.wake(), plain.sleep()
    assert quiet.calls == []


def test_trls_async_trainer_is_refused_with_its_reasons(capsys, tmp_path, monkeypatch):
    reasons = peer_trl.async_blockers(gpus=1, kernel_cached=False)
    assert len(reasons) == 3 and "kernels-community/flash-attn3" in reasons[0] and "NCCL" in reasons[1]
    assert len(peer_trl.async_blockers(gpus=2, kernel_cached=True)) == 1  # the rollout worker is not written
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert peer_trl.async_kernel_cached() is False
    (tmp_path / "models--kernels-community--flash-attn3").mkdir()
    assert peer_trl.async_kernel_cached() is True
    assert peer_trl.main(["--trainer", "async", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[peer_trl] --trainer async (TRL 1.16 AsyncGRPOTrainer) not run: ") and "NCCL" in out


def test_part_tt4_gives_both_the_4b_configs_recipe_at_the_learnable_rate():
    text = (ROOT / "bench" / "gpu_run.sh").read_text()
    body = (
        re.search(r"\n    RW=\((.*?)\)\n", text, re.S)
        .group(1)
        .replace("$EVAL_EVERY", "5")
        .replace("$MODEL", "/tmp/m4b")
    )
    body = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", body)
    words = shlex.split(body)
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    cfg = peer_trl.load_recipe(ROOT / "deploy" / "configs" / "gpu-1-4b.toml", sets, env="")
    r = peer_trl.recipe_dict(cfg)
    assert (r["env"], r["lr"], r["eval_every"], r["eval_items"], r["groups_per_step"]) == (
        "random_words",
        2.5e-4,
        5,
        24,
        4,
    )
    assert (r["model"], r["behaviour_correction"], r["max_tokens"]) == ("/tmp/m4b", "truncated_is", 384)
