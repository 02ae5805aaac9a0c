"""`parley export` never unpickles code (issue 57): a DeepSpeed checkpoint file whose pickle would run
a callable as it loads is refused with a clear error, and the callable never runs. The payload is a
real pickle (torch.save of an object whose __reduce__ names pathlib.Path.touch): loaded the old way
(torch.load(weights_only=False)) it creates the marker file."""

from __future__ import annotations

import json
import pathlib

import pytest

from parley.learner import checkpoint


class _Payload:
    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _run_with_checkpoint(tmp_path, files: dict[str, object]) -> pathlib.Path:
    import torch

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    run_dir = tmp_path / "run"
    checkpoint.record_base_model(run_dir, base)
    tag_dir = checkpoint.ckpt_dir(run_dir) / checkpoint.step_tag(1)
    tag_dir.mkdir(parents=True)
    for name, obj in files.items():
        torch.save(obj, tag_dir / name)
    return run_dir


@pytest.mark.parametrize("zero", ["stage0", "zero2"])
def test_export_refuses_a_checkpoint_pickle_that_carries_code(tmp_path, zero):
    marker = tmp_path / "ran"
    evil = {"module": _Payload(marker)}
    files = (
        {"mp_rank_00_model_states.pt": evil}
        if zero == "stage0"
        else {"zero_pp_rank_0_mp_rank_00_optim_states.pt": evil, "mp_rank_00_model_states.pt": evil}
    )
    run_dir = _run_with_checkpoint(tmp_path, files)
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="refused without loading it"):
        checkpoint.export_version(run_dir, 1, tmp_path / "out")
    assert not marker.exists()


def test_safe_load_reads_tensors(tmp_path):
    import torch

    torch.save({"module": {"w": torch.ones(2, 3)}}, tmp_path / "m.pt")
    assert torch.equal(checkpoint.safe_load(tmp_path / "m.pt")["module"]["w"], torch.ones(2, 3))
