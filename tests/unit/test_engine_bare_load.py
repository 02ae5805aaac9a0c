"""Which path a GPU-transport version takes into a vLLM worker (weights.worker.WorkerExtension.
parley_load_gpu): the model's bare load_weights when vLLM's per-layer metadata says no layer
processes its weights after loading on this platform, else vLLM's layer-wise reload. The layers are
real vLLM quantization methods on plain modules; the worker, its model runner and the transport's
receive are test doubles (no engine)."""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.platforms import current_platform

from parley.protocol import codec
from parley.protocol.messages import IpcTensor, NcclSource
from parley.weights import registry
from parley.weights.worker import WorkerExtension, bare_load_refusal


class ProcessesAfterLoading(QuantizeMethodBase):
    """A quantization method of the kind fp8 or int4 layers carry (test double)."""

    def create_weights(self, *a, **kw):
        pass

    def apply(self, *a, **kw):
        pass

    def process_weights_after_loading(self, layer):
        pass


class Layer(torch.nn.Module):
    def __init__(self, method, n=4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n), requires_grad=False)
        self.quant_method = method


class Model(torch.nn.Module):
    """Two layers, loaded by name as a vLLM model's load_weights does (records each call)."""

    def __init__(self, second=None, loads=("embed.weight", "proj.weight")):
        super().__init__()
        self.embed = Layer(UnquantizedEmbeddingMethod())
        self.proj = Layer(second or UnquantizedLinearMethod())
        self.loads, self.calls = loads, []

    def load_weights(self, weights):
        self.calls.append("load_weights")
        got = dict(weights)
        for name in self.loads:
            self.get_parameter(name).data.copy_(got[name])
        return set(self.loads)


@pytest.fixture
def on_gpu(monkeypatch):
    """The platform checks of vLLM answer as on a GPU (this CPU build answers is_cpu True)."""
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)


def test_plain_layers_off_the_cpu_take_a_bare_load(on_gpu):
    assert bare_load_refusal(Model()) is None


def test_the_cpu_build_and_a_layer_that_processes_its_weights_need_the_layer_wise_reload(monkeypatch):
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    assert "CPU build repacks" in bare_load_refusal(Model())
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert bare_load_refusal(Model(second=ProcessesAfterLoading())) == (
        "proj processes its weights after loading (ProcessesAfterLoading)"
    )


class Runner:
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


class Worker(WorkerExtension):
    """vLLM's worker side that parley_load_gpu uses (test double): its model runner and reload_weights."""

    def __init__(self, model):
        self.model_runner = Runner(model)

    def reload_weights(self, weights_iterator):
        self.model_runner.model.calls.append("reload_weights")
        for name, t in weights_iterator:
            self.model_runner.model.get_parameter(name).data.copy_(t)


def announcement() -> bytes:
    src = NcclSource(
        address="learner:29600",
        backend="gloo",
        nbytes=256,
        hold_s=5.0,
        tensors=[IpcTensor(name="w", dtype="float32", shape=[4], offset=0, checksum=[1, 1, 1])],
    )
    return codec.encode(
        registry.TRANSPORTS["nccl"].announcement(
            src, version=2, step=2, sha256="0" * 64, bytes=256, created=0.0, run="r", files=[]
        )
    )


@pytest.fixture
def received(monkeypatch):
    nccl = type(registry.TRANSPORTS["nccl"])
    named = [("embed.weight", torch.full((4,), 2.0)), ("proj.weight", torch.full((4,), 3.0))]
    monkeypatch.setattr(nccl, "receive", lambda self, wv, state: (list(named), None))
    monkeypatch.setattr(nccl, "loaded", lambda self, wv, state: None)


def test_a_plain_model_on_a_gpu_is_loaded_by_its_own_load_weights(on_gpu, received):
    model = Model()
    assert Worker(model).parley_load_gpu(announcement()) is None
    assert model.calls == ["load_weights"]
    assert model.embed.weight.tolist() == [2.0] * 4 and model.proj.weight.tolist() == [3.0] * 4


def test_a_model_with_a_processing_layer_is_reloaded_layer_by_layer(on_gpu, received):
    model = Model(second=ProcessesAfterLoading())
    assert Worker(model).parley_load_gpu(announcement()) is None
    assert model.calls == ["reload_weights"]
    assert model.proj.weight.tolist() == [3.0] * 4


def test_a_bare_load_that_leaves_a_parameter_untouched_is_redone_layer_by_layer_from_then_on(on_gpu, received):
    model = Model(loads=("embed.weight",))
    worker = Worker(model)
    assert worker.parley_load_gpu(announcement()) is None
    assert model.calls == ["load_weights", "reload_weights"]
    assert model.proj.weight.tolist() == [3.0] * 4
    assert worker.parley_load_gpu(announcement()) is None
    assert model.calls == ["load_weights", "reload_weights", "reload_weights"]
