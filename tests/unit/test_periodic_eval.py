"""evaluation.periodic with a test-double launcher in place of the `parley eval` child: which versions
are evaluated, the export of their weights, the files `parley select` reads, the best model kept, a failed
eval set aside, and early stop on a planted regression (and not on a planted improvement)."""

import asyncio
import json
from pathlib import Path

import pytest

from parley.config.learner import LearnerConfig
from parley.config.run import RunConfig
from parley.evaluation.evallog import write_parquet
from parley.evaluation.periodic import EvalJob, PeriodicEval, eval_argv, evaluated, model_dir
from parley.learner import checkpoint as ckpt
from tests.factories import safetensors_bytes
from tests.unit.test_select import version_records


def make_run(tmp_path, **learner):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "tokenizer.json").write_text("{}")
    run_dir = tmp_path / "run"
    ckpt.record_base_model(run_dir, base)
    cfg = RunConfig(learner=LearnerConfig(eval_every=2, eval_items=3, **learner))
    cfg.run.dir = str(run_dir)
    return cfg, run_dir


def publish_weights(run_dir, version):
    w = ckpt.weights_dir(run_dir, version)
    w.mkdir(parents=True)
    (w / "model.safetensors").write_bytes(safetensors_bytes(b"weights of v%d" % version))
    (w / "config.json").write_text("{}")


class PlantedEval:
    """Test double of the eval child: writes planted records (means per version) or exits non-zero."""

    def __init__(self, plan, fail=()):
        self.plan, self.fail, self.jobs = plan, set(fail), []

    async def __call__(self, job, out):
        self.jobs.append(job)
        if job.version in self.fail:
            (out / "eval.log").write_text("boom\n")
            return 1
        b, i, t = self.plan[job.version]
        write_parquet(version_records(job.version, b, i, t, noise_seed=job.version + 1), out / "records.parquet")
        return 0


async def play(pe, versions, last):
    halt = asyncio.Event()
    runner = asyncio.create_task(pe.run(halt))
    for v in versions:
        if pe.due(v, last=v == last):
            await pe.submit(v, v)
    await pe.drain(60.0, asyncio.Event())
    halt.set()
    await runner


def test_schedule_export_files_and_best_model(tmp_path):
    cfg, run_dir = make_run(tmp_path)
    plan = {0: (0.45, 0.83, 2.9), 2: (0.48, 0.80, 2.1), 4: (0.47, 0.80, 2.0), 5: (0.46, 0.79, 2.0)}
    for v in range(1, 6):
        publish_weights(run_dir, v)
    double = PlantedEval(plan)
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=double)
    asyncio.run(play(pe, range(0, 6), last=5))

    # version 0, every 2nd, and the last; the base model by name, later versions as exported checkpoints
    assert [j.version for j in double.jobs] == [0, 2, 4, 5]
    assert double.jobs[0].model == cfg.policy.model
    assert double.jobs[1].model == str(model_dir(run_dir, 2))
    assert all(evaluated(run_dir, v) for v in (0, 2, 4, 5))
    assert not any(evaluated(run_dir, v) for v in (1, 3))
    history = [json.loads(x) for x in (run_dir / "eval" / "history.jsonl").read_text().splitlines()]
    assert [h["version"] for h in history] == [0, 2, 4, 5] and history[1]["n"] == 12
    # only the best version's model is kept (v2 has the highest MR of the plan)
    assert sorted(p.name for p in (run_dir / "eval" / "models").iterdir()) == ["v2"]
    assert (model_dir(run_dir, 2) / "model.safetensors").read_bytes() == safetensors_bytes(b"weights of v2")
    assert (model_dir(run_dir, 2) / "tokenizer.json").exists()
    assert pe.counters()["eval.version"] == 5.0 and pe.counters()["eval.failed"] == 0.0
    assert not pe.regression  # early_stop is off
    # already evaluated versions are not queued again (a resumed learner)
    assert not PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=double).due(4)


def test_failed_eval_is_set_aside_and_training_goes_on(tmp_path):
    cfg, run_dir = make_run(tmp_path)
    publish_weights(run_dir, 2)
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=PlantedEval({0: (0.45, 0.83, 2.9)}, fail={2}))
    asyncio.run(play(pe, [0, 2], last=2))
    assert evaluated(run_dir, 0) and not evaluated(run_dir, 2)
    assert (run_dir / "eval" / "v2.failed" / "eval.log").read_text() == "boom\n"
    assert [o.ok for o in pe.outcomes] == [True, False]
    assert pe.counters()["eval.failed"] == 1.0


@pytest.mark.parametrize(
    ("plan", "stops"),
    [
        ({0: (0.45, 0.83, 2.9), 2: (0.48, 0.82, 2.1), 4: (0.40, 0.60, 2.1)}, True),  # v4 falls well below v2
        ({0: (0.45, 0.83, 2.9), 2: (0.48, 0.82, 2.1), 4: (0.49, 0.82, 2.0)}, False),  # keeps improving
    ],
)
def test_early_stop_on_a_significant_regression_only(tmp_path, plan, stops):
    cfg, run_dir = make_run(tmp_path, early_stop=True, early_stop_alpha=0.05)
    for v in (2, 4):
        publish_weights(run_dir, v)
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=PlantedEval(plan))
    asyncio.run(play(pe, [0, 2, 4], last=4))
    assert bool(pe.regression) is stops
    if stops:
        assert pe.regression.startswith("mr of version 4 is below version 2's")
        saved = json.loads((run_dir / "eval" / "early_stop.json").read_text())
        assert saved["version"] == 4 and saved["metric"] == "mr"
    else:
        assert not (run_dir / "eval" / "early_stop.json").exists()


def test_config_refuses_reward_metric_and_early_stop_without_eval():
    with pytest.raises(ValueError, match="training reward is not a selection metric"):
        LearnerConfig(eval_every=1, eval_metric="reward")
    with pytest.raises(ValueError, match="early_stop = true needs eval_every > 0"):
        LearnerConfig(early_stop=True)
    with pytest.raises(ValueError, match="eval_every=3 must be a multiple of publish_every=2"):
        LearnerConfig(eval_every=3, publish_every=2)


def test_eval_argv_is_the_benchmark_command_following_versions(tmp_path):
    cfg, run_dir = make_run(tmp_path)
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version)
    from parley.evaluation.periodic import EvalJob, job_line

    argv = eval_argv(cfg, pe.config_path, tmp_path / "eval")
    assert argv[1:4] == ["-m", "parley.deploy.cli", "eval"]
    joined = " ".join(argv)
    assert "--services nats --follow" in joined and "-C" not in argv
    assert "--n-items 3" in joined and f"--max-new-turns {cfg.rollout.max_new_turns}" in joined
    assert json.loads(job_line(EvalJob(3, 3, "/m/v3"), tmp_path / "out")) == {
        "version": 3,
        "model": "/m/v3",
        "out": str(tmp_path / "out"),
    }
    # the child reads the same configuration the learner runs with
    assert "eval_every = 2" in pe.config_path.read_text()


# A test double of `parley eval --follow`: answers each job line with the done mark; "die" in a model
# name makes it exit 7 in the middle of that job (after a line of output).
FOLLOW_DOUBLE = r"""
import json, sys
from parley.evaluation.commands import DONE_MARK
print("child up", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    print(f"playing v{job['version']}", flush=True)
    if "die" in job["model"]:
        sys.exit(7)
    print(DONE_MARK + json.dumps({"version": job["version"], "code": 3 if "none" in job["model"] else 0}), flush=True)
print("end of input", flush=True)
"""


async def test_the_following_child_serves_versions_restarts_after_a_death_and_ends(tmp_path):
    import os
    import sys

    from parley.evaluation.periodic import EvalJob, FollowingChild

    script = tmp_path / "double.py"
    script.write_text(FOLLOW_DOUBLE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = FollowingChild([sys.executable, str(script)], env, tmp_path / "follow.log")
    outs = [tmp_path / f"o{i}" for i in range(4)]
    for o in outs:
        o.mkdir()
    assert await child.run(EvalJob(0, 0, "base"), outs[0]) == 0
    first = child.proc.pid
    assert await child.run(EvalJob(1, 1, "/m/none"), outs[1]) == 3  # the job's own code
    assert child.proc.pid == first and child.starts == 1  # one child for both versions
    assert await child.run(EvalJob(2, 2, "/m/die"), outs[2]) == 7  # died on it: its exit code
    assert await child.run(EvalJob(3, 3, "/m/v3"), outs[3]) == 0  # started again
    assert child.starts == 2
    assert (outs[0] / "eval.log").read_text() == "child up\nplaying v0\n"
    assert (outs[2] / "eval.log").read_text() == "playing v2\n"
    await child.close()
    assert child.proc is None and "end of input" in (tmp_path / "follow.log").read_text()


def test_up_summary_of_the_evaluated_versions(tmp_path):
    """`parley up`'s closing text: the versions side by side, the selection, a failed eval named and
    left out (even with records in it), the early-stop reason."""
    from parley.deploy.up import eval_text

    for v, (b, i, t) in {0: (0.40, 0.80, 2.0), 3: (0.45, 0.80, 2.0)}.items():
        write_parquet(version_records(v, b, i, t, noise_seed=v + 1), tmp_path / "eval" / f"v{v}" / "records.parquet")
    write_parquet(version_records(5, 0.1, 0.1, 2.0, noise_seed=9), tmp_path / "eval" / "v5.failed" / "records.parquet")
    (tmp_path / "eval" / "early_stop.json").write_text(json.dumps({"reason": "mr of version 5 is below"}))
    text = eval_text(RunConfig(learner=LearnerConfig(eval_every=3)), tmp_path)
    assert "| v0 | 12 |" in text and "| v3 | 12 |" in text and "| v5 |" not in text
    assert "failed evals (see their eval.log): v5.failed" in text
    assert "best by mr: v3" in text and "stopped early: mr of version 5 is below" in text
    assert (tmp_path / "eval" / "table.md").exists()
    assert "periodic eval is off" in eval_text(RunConfig(), tmp_path)


async def wait_for_text(path: Path, text: str, timeout_s: float = 20.0) -> str:
    """The file's text once it holds `text` (the test double's output reaches it through the reader)."""
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.is_file() and text in (seen := path.read_text()):
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout_s}s")


async def test_the_child_starts_at_start_and_not_at_the_first_job(tmp_path, monkeypatch):
    """PeriodicEval.start() starts the real launcher's child (FOLLOW_DOUBLE in place of `parley eval
    --follow`, through eval_argv) before any version is queued; the first job then goes to that child,
    and run's end closes it."""
    import sys

    from parley.evaluation import periodic

    script = tmp_path / "double.py"
    script.write_text(FOLLOW_DOUBLE)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    monkeypatch.setattr(periodic, "eval_argv", lambda cfg, config_path, out: [sys.executable, str(script)])
    cfg, run_dir = make_run(tmp_path)
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version)
    await pe.start()
    follow_log = run_dir / "eval" / "follow.log"
    await wait_for_text(follow_log, "child up\n")  # up with no job queued
    assert pe.child.starts == 1 and pe.child.running
    await pe.start()  # started once
    assert pe.child.starts == 1

    halt = asyncio.Event()
    runner = asyncio.create_task(pe.run(halt))
    await pe.submit(0, 0)
    await pe.drain(30.0, asyncio.Event())
    halt.set()
    await runner
    # the double writes no records, so v0 is set aside as failed: what matters is who played it
    assert [o.version for o in pe.outcomes] == [0]
    assert (run_dir / "eval" / "v0.failed" / "eval.log").read_text() == "playing v0\n"
    assert pe.child.starts == 1 and pe.child.proc is None  # the job went to the child started early; run closed it
    assert follow_log.read_text() == "child up\nend of input\n"


async def test_a_test_double_launcher_starts_no_child(tmp_path):
    cfg, run_dir = make_run(tmp_path)
    double = PlantedEval({0: (0.45, 0.83, 2.9)})
    pe = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=double)
    await pe.start()
    assert pe.child is None and not (run_dir / "eval" / "follow.log").exists()
    await pe.close()


async def test_a_child_started_early_that_exits_is_reported_and_started_again_at_the_first_job(tmp_path, caplog):
    import os
    import sys

    from parley.evaluation.periodic import EvalJob, FollowingChild

    broken = tmp_path / "broken.py"
    broken.write_text('import sys\nprint("engine did not open", flush=True)\nsys.exit(5)\n')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = FollowingChild([sys.executable, str(broken)], env, tmp_path / "follow.log")
    with caplog.at_level("ERROR", logger="parley.evaluation.periodic"):
        await child.start()
        await asyncio.wait_for(asyncio.shield(child.reader), 20.0)
    assert not child.running
    assert [r.getMessage() for r in caplog.records] == [
        f"eval: its child exited with 5 between versions (its output: {tmp_path / 'follow.log'})"
    ]
    script = tmp_path / "double.py"
    script.write_text(FOLLOW_DOUBLE)
    child.argv = [sys.executable, str(script)]
    out = tmp_path / "o0"
    out.mkdir()
    assert await child.run(EvalJob(0, 0, "base"), out) == 0 and child.starts == 2
    await child.close()


def test_evals_an_earlier_learner_left_unfinished_are_played_by_the_next(tmp_path):
    """A learner that stops (killed, or its drain timed out) leaves queued versions with their exported
    models and no records; the learner started again with --resume plays them first. Versions past the
    step it resumes from are steps it trains again (their models are deleted), an export cut short is
    deleted, and a version whose eval failed is not played again."""
    cfg, run_dir = make_run(tmp_path)
    for v in (2, 4, 6, 8):
        publish_weights(run_dir, v)
    first = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=PlantedEval({0: (0.45, 0.83, 2.9)}, fail={4}))

    async def queue_then_stop():
        for v in (0, 2, 4, 6, 8):
            await first.submit(v, v)
        await first.evaluate(EvalJob(version=0, step=0, model=cfg.policy.model))  # played
        await first.evaluate(EvalJob(version=4, step=4, model=str(model_dir(run_dir, 4))))  # failed

    asyncio.run(queue_then_stop())  # the learner dies here: v2, v6 and v8 queued, not played
    assert evaluated(run_dir, 0) and not any(evaluated(run_dir, v) for v in (2, 4, 6, 8))
    (run_dir / "eval" / "models" / ".v7.export").mkdir()  # an export cut short by the kill

    plan = {v: (0.45 + v / 100, 0.8, 2.0) for v in (2, 6)}
    double = PlantedEval(plan)
    again = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=double)
    assert again.requeue_unfinished(6) == [2, 6]  # resumed from step 6: v8 is trained again
    asyncio.run(play(again, [], last=None))
    assert [(j.version, j.model) for j in double.jobs] == [
        (2, str(model_dir(run_dir, 2))),
        (6, str(model_dir(run_dir, 6))),
    ]
    assert evaluated(run_dir, 2) and evaluated(run_dir, 6)
    assert not model_dir(run_dir, 8).exists() and not (run_dir / "eval" / "models" / ".v7.export").exists()
    assert again.requeue_unfinished(6) == []  # nothing left over a second time


def test_version_0_cut_short_is_played_again_from_the_policy_model(tmp_path):
    cfg, run_dir = make_run(tmp_path)
    first = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=PlantedEval({}))
    asyncio.run(first.submit(0, 0))  # queued, then the learner died
    double = PlantedEval({0: (0.45, 0.83, 2.9)})
    again = PeriodicEval(cfg, run_dir, export=ckpt.export_version, launch=double)
    assert again.requeue_unfinished(3) == [0]
    asyncio.run(play(again, [], last=None))
    assert [(j.version, j.model) for j in double.jobs] == [(0, cfg.policy.model)] and evaluated(run_dir, 0)


def test_an_export_is_renamed_into_place_whole(tmp_path):
    """submit writes a version's model aside and renames it: an export that fails leaves no models/v<N>."""
    cfg, run_dir = make_run(tmp_path)
    publish_weights(run_dir, 2)

    def export_that_dies_midway(run_dir, version, out):
        """Test double for an export that wrote one file, then failed (disk full)."""
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        raise OSError("test double: no space left on device")

    pe = PeriodicEval(cfg, run_dir, export=export_that_dies_midway, launch=PlantedEval({}))
    asyncio.run(pe.submit(2, 2))
    assert not model_dir(run_dir, 2).exists() and list((run_dir / "eval" / "models").iterdir()) == []
    assert pe.outcomes[0].error == "export: test double: no space left on device"
    pe.export = ckpt.export_version
    asyncio.run(pe.submit(2, 2))
    assert (model_dir(run_dir, 2) / "model.safetensors").read_bytes() == safetensors_bytes(b"weights of v2")
