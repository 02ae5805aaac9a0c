"""The vLLM engines the e2e modules share: one per (model, settings), started the first time a test
asks for it and shut down after the last test of the session that uses it, all on one private event
loop that the tests drive with `engines.run(coro)`. Each engine start-up costs 30-90 s on CPU; the
modules used to start one each. A test that loads other weights leaves with the model's own restored.

vLLM's AsyncLLM belongs to the event loop it was started on, and pytest-asyncio (asyncio_default_fixture_
loop_scope = "function") gives each async test a loop of its own: so tests that use a shared engine are
plain `def` tests that run their coroutines with `engines.run`, never `async def` tests.
"""

from __future__ import annotations

import asyncio

import pytest

# No chunked prefill: vLLM's CPU runner crashes when it drops the sample of a seeded request whose
# prompt was only partly prefilled ("CPU Generator does not use offset").
NO_CHUNKS = {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}

# engine name -> the fixtures that ask for it (the last test using one shuts it down)
ENGINE_FIXTURES = {"raw": ("tiny_engine",), "sampled": ("tiny_policy_engine",)}


class Engines:
    """The shared engines and the event loop they live on, which is also the loop of whatever a test
    runs through them (its NATS connections, actors, services)."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self.open: dict[str, object] = {}

    def run(self, coro, timeout: float | None = None):
        if timeout is not None:
            coro = asyncio.wait_for(coro, timeout)
        return self.loop.run_until_complete(coro)

    def settings(self, name: str):
        from parley.engines.engine import EngineSettings

        model = str(self.model_dir)
        if name == "raw":  # the judge's, simulator's and in-process actor's: raw log-probs
            return EngineSettings(model=model, max_model_len=2048, kv_cache_bytes=256 << 20, extra=NO_CHUNKS)
        if name == "sampled":  # as the actor opens its policy: log-probs of the sampling distribution
            return EngineSettings(model=model, max_model_len=2048, kv_cache_bytes=128 << 20, sampled_logprobs=True)
        raise KeyError(f"no shared engine {name!r}; known: raw, sampled")

    def get(self, name: str):
        """The engine `name`, started on first use (from outside the loop)."""
        return self.open[name] if name in self.open else self.run(self.aget(name))

    async def aget(self, name: str):
        """The same from a coroutine running on the loop."""
        if name not in self.open:
            from parley.engines.engine import PolicyEngine

            self.open[name] = PolicyEngine(self.settings(name))
        return self.open[name]

    def restore(self, name: str) -> None:
        """Put the model's own weights back (version 0) where a test loaded others."""
        engine = self.open.get(name)
        if engine is not None and engine.version != 0:
            self.run(engine.reload_weights(self.model_dir, version=0))

    def shutdown(self, name: str) -> None:
        engine = self.open.pop(name, None)
        if engine is None:
            return

        async def stop():
            engine.shutdown()
            await asyncio.sleep(0)

        self.run(stop())

    def close(self) -> None:
        for name in list(self.open):
            self.shutdown(name)

        async def cancel_rest():
            # let vLLM's output tasks see their cancellation before the loop goes away
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_rest())
        self.loop.close()


_engines: Engines | None = None


@pytest.fixture(scope="session")
def engines(tiny_model):
    global _engines
    _engines = Engines(tiny_model)
    yield _engines
    _engines.close()
    _engines = None


@pytest.fixture(scope="session")
def tiny_engine(engines):
    """The toy model's shared engine: raw log-probs, no chunked prefill (the judge's, the simulator's,
    the eval's and the in-process actor's)."""
    return engines.get("raw")


@pytest.fixture(scope="session")
def tiny_policy_engine(engines):
    """The toy model's shared engine that reports sampled log-probs (the actor's policy convention)."""
    return engines.get("sampled")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shared_engine(name): the test uses that shared engine without its fixture (engines.get(name))"
    )


def pytest_collection_modifyitems(config, items):
    """Every test that uses the shared engines lives in a module that tests/conftest.py lists, which is
    how `make test` (pytest-xdist) knows to run them all on one worker."""
    from tests.conftest import SHARED_ENGINE_MODULES

    for item in items:
        module = item.nodeid.split("::", 1)[0]
        uses = "engines" in getattr(item, "fixturenames", ()) or item.get_closest_marker("shared_engine")
        if uses and module not in SHARED_ENGINE_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the shared engines but {module} is not in SHARED_ENGINE_MODULES "
                "(tests/conftest.py): add it there, so that pytest-xdist runs it on the engines' worker"
            )


def _uses(item, name: str) -> bool:
    if any(f in getattr(item, "fixturenames", ()) for f in ENGINE_FIXTURES[name]):
        return True
    return any(name in m.args for m in item.iter_markers("shared_engine"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test that used a shared engine: the model's own weights back where the test loaded
    others, so no test sees another's; after the last test of the session that uses an engine, shut it
    down, so its memory and engine-core process are not held through later modules' own engines."""
    yield
    if _engines is None:
        return
    items = item.session.items
    later = items[items.index(item) + 1 :] if nextitem is not None else []
    for name in list(_engines.open):
        if not _uses(item, name):
            continue
        if any(_uses(it, name) for it in later):
            _engines.restore(name)
        else:
            _engines.shutdown(name)
