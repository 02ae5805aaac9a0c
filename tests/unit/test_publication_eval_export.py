"""weights.publish.Weights.publish under a GPU transport (cuda_ipc, nccl): a version an eval
needs (write_now, learner.stepper's eval_due) is also written to the learner's weights directory, so
evaluation.periodic's export (learner.checkpoint.export_version) finds it; before, such versions were
only packed into GPU buffers and the export's FileNotFoundError left them unevaluated. A test double
plays the trainer's driver (its pack_weights and weights_snapshot) and the publisher; no GPU, no bus."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parley.learner import checkpoint as ckpt
from parley.learner.service import weights_publication
from parley.weights.config import CudaIpcWeights, NcclWeights
from tests.driver_double import DriverDouble
from tests.factories import safetensors_bytes


class SnapshotDouble:
    """Stands in for weights.snapshot.WeightSnapshot: writes the version's two files."""

    def __init__(self, data: bytes):
        self.data = data

    def write(self, out):
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_bytes(safetensors_bytes(self.data))
        (out / "config.json").write_text("{}")
        return out


class TrainerDriverDouble(DriverDouble):
    """learner.ranks.Driver's calls that publish makes: pack_weights (the GPU transport's pack: a
    source to announce, or None when every buffer is held) and weights_snapshot."""

    def __init__(self, held: bool = False):
        self.held, self.calls = held, []

    def __call__(self, op, *args):
        self.calls.append((op, *args))
        if op == "pack_weights":
            return None if self.held else SimpleNamespace(version=args[0])
        if op == "weights_snapshot":
            return SnapshotDouble(b"weights of the step")
        raise AssertionError(op)


class PublisherDouble:
    def __init__(self):
        self.submitted, self.counters = [], {"skipped_held": 0}

    def submit(self, pub):
        self.submitted.append(pub.version)


def run_dir_with_base(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    (ckpt.learner_dir(tmp_path / "run")).mkdir(parents=True)
    (ckpt.learner_dir(tmp_path / "run") / "base_model").write_text(str(base))
    return tmp_path / "run"


@pytest.mark.parametrize(
    "settings", [CudaIpcWeights(), NcclWeights(address="127.0.0.1:29600")], ids=["cuda_ipc", "nccl"]
)
@pytest.mark.parametrize("held", [False, True], ids=["packed", "every-buffer-held"])
async def test_a_gpu_transport_writes_the_versions_an_eval_needs(tmp_path, settings, held):
    run_dir = run_dir_with_base(tmp_path)
    driver, publisher = TrainerDriverDouble(held), PublisherDouble()
    w = weights_publication(
        SimpleNamespace(keep_versions=3), settings, None, None, "r", run_dir, driver, publisher, feeder=None
    )

    assert await w.publish(1) is not held  # no eval due: packed only, nothing on disk
    assert not ckpt.weights_dir(run_dir, 1).exists() and ("weights_snapshot",) not in driver.calls

    assert await w.publish(2, write_now=True) is not held  # an eval is due: packed and written
    assert publisher.submitted == ([] if held else [1, 2])
    out = ckpt.export_version(run_dir, 2, tmp_path / "eval" / "v2")  # what evaluation.periodic's export does
    assert (out / "model.safetensors").read_bytes() == safetensors_bytes(b"weights of the step") and (
        out / "tokenizer.json"
    ).is_file()


@pytest.mark.parametrize(
    "settings", [CudaIpcWeights(), NcclWeights(address="127.0.0.1:29600")], ids=["cuda_ipc", "nccl"]
)
async def test_a_gpu_transport_copies_an_evals_version_now_and_writes_it_behind(tmp_path, settings):
    """learner.stepper on an eval's step: the copy is taken on the step's path (before the next step
    changes the weights), the file written later by the call it returns (evaluation.periodic runs it
    behind training); publish then writes nothing itself."""
    run_dir = run_dir_with_base(tmp_path)
    driver, publisher = TrainerDriverDouble(), PublisherDouble()
    w = weights_publication(
        SimpleNamespace(keep_versions=3), settings, None, None, "r", run_dir, driver, publisher, feeder=None
    )
    write = await w.eval_copy(2)
    assert ("weights_snapshot",) in driver.calls and not ckpt.weights_dir(run_dir, 2).exists()
    assert await w.publish(2, write_now=False) is True
    assert not ckpt.weights_dir(run_dir, 2).exists()
    write()
    out = ckpt.export_version(run_dir, 2, tmp_path / "eval" / "v2")
    assert (out / "model.safetensors").read_bytes() == safetensors_bytes(b"weights of the step")


async def test_a_file_transport_writes_an_evals_version_on_the_path_as_its_upload_needs_it(tmp_path):
    from parley.weights.config import ObjstoreWeights

    run_dir = run_dir_with_base(tmp_path)
    w = weights_publication(
        SimpleNamespace(keep_versions=3),
        ObjstoreWeights(),
        None,
        None,
        "r",
        run_dir,
        TrainerDriverDouble(),
        PublisherDouble(),
        feeder=None,
    )
    assert await w.eval_copy(2) is None  # the stepper then publishes with write_now
