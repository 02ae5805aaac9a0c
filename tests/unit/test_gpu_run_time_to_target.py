"""bench/gpu_run.sh parts TT and TT4 (issue 56: one paired seed, or one side of the 4B shape, a device
call) with test doubles for python3 and nvidia-smi: what each run is given, and the packed seed file
bench/peer_compare.py reads (the card it ran on, TRL's options)."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

from tests.factories import run_gpu_part


def _run_part(tmp_path: Path, part: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    # test doubles: python3 records its arguments and does nothing; nvidia-smi names one card
    return run_gpu_part(
        tmp_path,
        part,
        '#!/bin/bash\nprintf "%s|" "$@" >>"$STUB_LOG"; echo >>"$STUB_LOG"\n',
        "NVIDIA H100 80GB HBM3, GPU-1234",
        RUN_DIR=str(tmp_path / "run"),
        TRL_WORK=str(tmp_path / "trl"),
        **env,
    )


def _clock(tgz: Path) -> dict:
    with tarfile.open(tgz) as tar:
        return json.load(tar.extractfile("./p_clock.json"))


def test_part_tt_runs_one_seed_of_parley_then_trl_at_its_best_and_packs_it(tmp_path):
    res, calls, out = _run_part(tmp_path, "TT", SEED="3")
    assert res.returncode == 0, res.stderr
    up = next(c.split("|") for c in calls if "parley.deploy.cli|up|" in c)
    trl = next(c.split("|") for c in calls if "bench/peer_trl.py" in c)
    assert up[up.index("--steps") + 1] == "120" and "learner.seed=3" in up and "learner.eval_every=5" in up
    assert 'learner.group_order="freshest"' in up and 'learner.behaviour_correction="clip"' in up
    assert trl[trl.index("--steps") + 1] == "80" and trl[trl.index("--env") + 1] == "hidden_goal"
    assert trl[trl.index("--trl-dtype") + 1] == "bfloat16" and "--no-sleep" not in trl
    assert 'learner.group_order="freshest"' not in trl  # parley's own settings are parley's alone
    assert any("bench/peer_compare.py|--target|--over|" in c for c in calls)
    clock = _clock(out / "p_s3.tgz")
    assert (clock["seed"], clock["gpu_name"], clock["gpu_uuid"], clock["gpus"]) == (
        3,
        "NVIDIA H100 80GB HBM3",
        "GPU-1234",
        1,
    )
    assert (clock["env"], clock["trl_options"], clock["parley_steps"], clock["trl_steps"]) == (
        "hidden_goal",
        "--trl-dtype bfloat16",
        120,
        80,
    )
    # the checkout is byte-compiled before either clock, and whether the site had its bytecode is recorded
    # (the python3 double answers nothing: false)
    compiled = next(i for i, c in enumerate(calls) if c.startswith("-m|compileall|"))
    assert compiled < min(i for i, c in enumerate(calls) if "parley.deploy.cli|up|" in c or "bench/peer_trl.py" in c)
    assert clock["bytecode"] is False
    # and which code parley ran: a digest of the package's sources (the device's copy has no .git)
    assert len(clock["code"]) == 12 and int(clock["code"], 16) >= 0


def test_part_tt_alternates_which_side_runs_first_by_seed(tmp_path):
    """A machine's first vLLM start meets cold caches: even seeds run parley first, odd seeds TRL first
    (ORDER overrides), and the seed's clock file says which; each side keeps its own time limit."""
    runs = {}
    for seed, order in (("4", None), ("5", None), ("6", "trl")):
        (tmp_path / seed).mkdir()
        env = {"SEED": seed} | ({"ORDER": order} if order else {})
        res, calls, out = _run_part(tmp_path / seed, "TT", **env)
        assert res.returncode == 0, res.stderr
        first = next(i for i, c in enumerate(calls) if "parley.deploy.cli|up|" in c or "bench/peer_trl.py" in c)
        runs[seed] = ("parley" if "parley.deploy.cli|up|" in calls[first] else "trl", _clock(out / f"p_s{seed}.tgz"))
    assert {s: (first, clock["order"]) for s, (first, clock) in runs.items()} == {
        "4": ("parley", "parley"),
        "5": ("trl", "trl"),
        "6": ("trl", "trl"),
    }
    clock = runs["5"][1]  # TRL first: its launch before parley's, both recorded
    assert clock["trl_start"] <= clock["parley_start"] <= clock["parley_end"]


def test_part_p_refuses_an_unknown_order(tmp_path):
    res, calls, _ = _run_part(tmp_path, "P", ORDER="both")
    assert res.returncode == 2 and "ORDER=both: expected parley or trl" in res.stderr
    assert calls == []  # before any work: no model built, nothing imported


def test_part_tt4_runs_one_side_of_the_4b_shape(tmp_path):
    res, calls, out = _run_part(tmp_path, "TT4", SEED="1", SIDE="trl", TRL_DTYPE="float32", TRL_SLEEP="0")
    assert res.returncode == 0, res.stderr
    assert not any("parley.deploy.cli|up|" in c for c in calls)  # TRL's side alone
    trl = next(c.split("|") for c in calls if "bench/peer_trl.py" in c)
    assert trl[trl.index("--config") + 1] == "deploy/configs/gpu-1-4b.toml" and trl[trl.index("--env") + 1] == ""
    assert "learner.lr=2.5e-4" in trl and 'policy.model="/tmp/m4b"' in trl
    assert trl[trl.index("--micro-batch") + 1] == "4" and "--no-sleep" in trl
    assert _clock(out / "p4_trl_s1.tgz")["trl_options"] == "--trl-dtype float32 --no-sleep --micro-batch 4"


def test_start_method_sets_the_actors_engine_core_start_for_parley_alone(tmp_path):
    """START_METHOD (issue 56; part TT's default fork): parley's actors fork their engine core
    (actor.engine.start_method), recorded with parley's settings; TRL's run is not given it. Set empty:
    the environment's start method, nothing added."""
    (tmp_path / "fork").mkdir()
    (tmp_path / "env").mkdir()
    res, calls, out = _run_part(tmp_path / "fork", "TT", SEED="3")
    assert res.returncode == 0, res.stderr
    up = next(c.split("|") for c in calls if "parley.deploy.cli|up|" in c)
    trl = next(c.split("|") for c in calls if "bench/peer_trl.py" in c)
    assert up[up.index('actor.engine.start_method="fork"') - 1] == "--set"
    assert 'learner.group_order="freshest"' in up  # beside the part's own settings, not instead of them
    assert not any("actor.engine.start_method" in a for a in trl)
    assert 'actor.engine.start_method="fork"' in _clock(out / "p_s3.tgz")["parley_sets"]
    res, calls, _ = _run_part(tmp_path / "env", "TT", SEED="3", START_METHOD="")
    assert res.returncode == 0 and not any("actor.engine.start_method" in c for c in calls)


def test_start_stacks_reach_parleys_engines_and_bring_back_the_actors_whole_log(tmp_path):
    """START_STACKS_S=5 (issue 56): parley's roles start their engines with PARLEY_START_STACKS_S=5 (every
    thread's stack in the role's log every 5 s while vLLM makes the engine), and the seed's file carries
    the actor's whole log and the eval child's first one. Unset: neither."""
    # test double for python3: records its arguments and the variable; as `parley up` it leaves the logs
    python = (
        "#!/bin/bash\n"
        'printf "%s|" "$@" >>"$STUB_LOG"; printf "stacks=%s" "${PARLEY_START_STACKS_S:-}" >>"$STUB_LOG"; echo >>"$STUB_LOG"\n'
        'if [ "$3" = up ]; then mkdir -p "$RUN_DIR/logs" "$RUN_DIR/eval/v0"\n'
        '  echo "actor log" >"$RUN_DIR/logs/actor-0.log"; echo "eval log" >"$RUN_DIR/eval/v0/eval.log"; fi\n'
    )
    outs = {}
    for name, env in (("on", {"START_STACKS_S": "5"}), ("off", {})):
        (tmp_path / name).mkdir()
        res, calls, out = run_gpu_part(
            tmp_path / name,
            "TT",
            python,
            "NVIDIA H100 80GB HBM3, GPU-1234",
            RUN_DIR=str(tmp_path / name / "run"),
            TRL_WORK=str(tmp_path / name / "trl"),
            SEED="2",
            **env,
        )
        assert res.returncode == 0, res.stderr
        up = next(c for c in calls if "parley.deploy.cli|up|" in c)
        with tarfile.open(out / "p_s2.tgz") as tar:
            outs[name] = (up.rsplit("|", 1)[1], sorted(n for n in tar.getnames() if n.endswith(".log")))
    assert outs["on"][0] == "stacks=5" and outs["off"][0] == "stacks="
    assert {"./actor_full.log", "./eval_v0.log"} <= set(outs["on"][1])
    assert not {"./actor_full.log", "./eval_v0.log"} & set(outs["off"][1])


def test_import_times_profile_parleys_roles_only_and_bring_back_their_logs(tmp_path):
    """IMPORT_TIMES=1 (issue 56): `parley up` (and so every role) runs under PYTHONPROFILEIMPORTTIME=1,
    TRL's run does not, and the seed's file carries the actor's, the learner's and the eval child's logs."""
    python = (
        "#!/bin/bash\n"
        'printf "%s|" "$@" >>"$STUB_LOG"; printf "importtime=%s" "${PYTHONPROFILEIMPORTTIME:-}" >>"$STUB_LOG"; echo >>"$STUB_LOG"\n'
        'if [ "$3" = up ]; then mkdir -p "$RUN_DIR/logs" "$RUN_DIR/eval/v0"\n'
        '  for f in logs/actor-0.log logs/learner.log eval/v0/eval.log eval/follow.log; do echo x >"$RUN_DIR/$f"; done; fi\n'
    )
    res, calls, out = run_gpu_part(
        tmp_path,
        "TT",
        python,
        "NVIDIA H100 80GB HBM3, GPU-1234",
        RUN_DIR=str(tmp_path / "run"),
        TRL_WORK=str(tmp_path / "trl"),
        SEED="2",
        IMPORT_TIMES="1",
    )
    assert res.returncode == 0, res.stderr
    up = next(c for c in calls if "parley.deploy.cli|up|" in c)
    trl = next(c for c in calls if "bench/peer_trl.py" in c)
    assert up.endswith("importtime=1") and trl.endswith("importtime=")
    with tarfile.open(out / "p_s2.tgz") as tar:
        logs = {n for n in tar.getnames() if n.endswith(".log")}
    assert {"./actor_full.log", "./learner_full.log", "./eval_v0.log", "./eval_follow.log"} <= logs
