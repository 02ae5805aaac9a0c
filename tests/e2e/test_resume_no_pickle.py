"""`--resume` never unpickles code (issue 57): the learner's own resume (learner.resume.restore ->
Trainer.load_checkpoint -> DeepSpeed's engine.load_checkpoint) reads every checkpoint file with
weights_only=True and DeepSpeed's few records allowed, as `parley export` does. A real checkpoint of
the toy model (DeepSpeed ZeRO-2 on CPU, one process) with a planted pickle payload (an object whose
__reduce__ names pathlib.Path.touch: loaded by DeepSpeed's own engine, torch.load(weights_only=False),
it creates the marker file) is refused with an error naming the file; an honest one still resumes, and
every file it reads goes through torch.load with weights_only=True (never DeepSpeed's universal-checkpoint
loader, which unpickles on its own)."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch

from parley.config.learner import LearnerConfig
from parley.learner import checkpoint as ckpt
from parley.learner import resume
from parley.learner.groups import Grouper
from parley.learner.packing import Sample
from parley.learner.runstate import RunState
from parley.learner.steplog import StepLog

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TAG = ckpt.step_tag(1)


class _Payload:
    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _restore(run_dir, model, trainer):
    from parley.learner.ranks import Driver

    state = RunState(steps=2)
    resume.restore(
        run_dir,
        model,
        {"name": "resume-no-pickle"},
        ledger=ckpt.Ledger(run_dir),
        driver=Driver(trainer),
        state=state,
        grouper=Grouper(2, max_staleness=1, stale_policy="drop", timeout_s=60.0),
        steplog=StepLog(run_dir, tensorboard=False),
    )
    return state


@pytest.fixture(scope="module")
def trained_run(tiny_model, tmp_path_factory):
    """A run directory whose ledger names step 1's real DeepSpeed checkpoint, and the weights it holds."""
    from parley.learner.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("run") / "run"
    resume.fresh(run_dir, tiny_model, {"name": "resume-no-pickle"})
    trainer = Trainer(LearnerConfig(zero_stage=2, lr=1e-2, kl_coef=0.0, micro_batch_tokens=64), tiny_model)
    batch = [Sample(f"s{i}", [5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1], [-1.0] * 6, a) for i, a in enumerate((1.0, -1.0))]
    trainer.train_step(batch)
    trainer.save_checkpoint(ckpt.ckpt_dir(run_dir), TAG)
    ckpt.write_state(run_dir, ckpt.LearnerState(step=1, tag=TAG))
    weights = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    trainer.close()
    return run_dir, weights


def _fresh_trainer(model):
    from parley.learner.trainer import Trainer

    return Trainer(LearnerConfig(zero_stage=2, lr=1e-2, kl_coef=0.0, micro_batch_tokens=64), model)


def test_an_honest_checkpoint_resumes(trained_run, tiny_model, monkeypatch):
    run_dir, weights = trained_run
    trainer = _fresh_trainer(tiny_model)
    # DeepSpeed's universal-checkpoint loader (deepspeed.checkpoint.universal_checkpoint) calls
    # torch.load(weights_only=False) itself, past checkpoint_engine.load; the resume must never get there.
    loads, real_load = [], torch.load

    def recording_load(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    try:
        assert not trainer.engine.load_universal_checkpoint()
        state = _restore(run_dir, tiny_model, trainer)
        assert loads and all(w is True for w in loads), loads  # every file through safe_load
        assert state.step == 1 and state.tag == TAG
        loaded = trainer.hf_state_dict()
        assert set(loaded) == set(weights) and all(torch.equal(loaded[k], weights[k]) for k in weights)
    finally:
        trainer.close()


@pytest.mark.parametrize("planted", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_resume_refuses_a_checkpoint_pickle_that_carries_code(trained_run, tiny_model, tmp_path, planted):
    source, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    marker = tmp_path / "ran"
    target = ckpt.ckpt_dir(run_dir) / TAG / planted
    honest = torch.load(target, map_location="cpu", weights_only=False)  # our own file: trusted here
    honest["planted"] = _Payload(marker)  # the honest records stay: only the payload is foreign
    torch.save(honest, target)
    trainer = _fresh_trainer(tiny_model)
    try:
        with pytest.raises(ckpt.UnsafeCheckpoint, match="refused without loading it") as e:
            _restore(run_dir, tiny_model, trainer)
    finally:
        trainer.close()
    assert str(target) in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists(), "the planted pickle ran while resuming"
