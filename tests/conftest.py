"""Fixtures chained as in nats.py's own tests: store dir -> real nats-server on a free port -> client -> JetStream."""

from __future__ import annotations

import os

import pytest

# One OpenMP thread for this process's torch and for every process the tests start (vLLM engines and
# their engine cores, learners, `parley up`'s roles): the tests run several of those at once on two
# cores (and `make test` two workers), and with torch's default of one thread per core each one's
# threads spin at every barrier waiting for a thread another process has descheduled; a vLLM CPU
# engine's test took about twice the CPU time so. Set before anything imports torch, for every run
# (one file alone computes as under `make test`); a caller's OMP_NUM_THREADS stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from parley.deploy.natsserver import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats", port=0)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def nc(nats_server):
    from parley.protocol.connect import connect

    client = await connect(nats_server.url, name="pytest")
    yield client
    if not client.is_closed:
        await client.close()


@pytest.fixture
async def js(nc):
    return nc.jetstream()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The toy Qwen3 + BPE tokenizer + ChatML template (seconds to build), shared by the session."""
    from parley.engines.models import build_tiny

    return build_tiny(tmp_path_factory.mktemp("models") / "tiny")


# The modules whose tests use the session's shared vLLM engines (tests/e2e/conftest.py, which refuses a
# test that uses them from a module not listed here).
SHARED_ENGINE_MODULES = frozenset(
    {
        "tests/e2e/test_actor.py",
        "tests/e2e/test_engine.py",
        "tests/e2e/test_eval.py",
        "tests/e2e/test_eval_env_e2e.py",
        "tests/e2e/test_logprob_agreement.py",
    }
)
# Under pytest-xdist the slow directories are handed out first and the unit tests fill in at the end.
TIERS = ("tests/e2e/", "tests/integration/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs `pytest -n 2 --dist loadscope`: each worker takes whole modules, so a module's
    module-scoped fixtures (a server, an engine, a trained learner) start once, and the modules that
    share the session's engines go to one worker together, in collection order, so that each engine
    starts once per run and the e2e teardown's "no later test uses it" holds on that worker. (xdist's
    own `loadgroup` cannot do this under pytest 9.2: it renames items through a field pytest no longer
    reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    def tier(scope: str) -> int:
        return next((i for i, prefix in enumerate(TIERS) if scope.startswith(prefix)), len(TIERS))

    class ModulesAndSharedEngines(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/e2e/(shared engines)" if module in SHARED_ENGINE_MODULES else module

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # xdist queued the scopes largest first; keep that within a tier
                self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda kv: tier(kv[0])))
                self.ordered = True
            super()._assign_work_unit(node)

    return ModulesAndSharedEngines(config, log)


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests run only where torch sees a CUDA device (docs/gpu.md says how to run them)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in gpu:
        item.add_marker(skip)
