"""The learner's start leaves its event loop free: `parley learner`'s rank-0 entry (learner.service.main)
builds the Learner (the ledger's resume, the environment and its train split, the tracker, ...) off the
loop, so the loop's other work (the NATS client's pings and reads, the lease's watch, a SIGTERM) goes on
during a long start. The real main() on a real nats-server, with test doubles for the trainer, for one
slow construction step and for the Learner's run."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.test_learner_fates import TrainerDouble, base_model, make_cfg

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SLOW_S = 1.5


def start_with_doubles(nats_server, tmp_path, monkeypatch, run: str):
    """The run's config for main() with the model, the trainer and the Driver replaced by test doubles."""
    from parley.engines import models
    from parley.learner import ranks, trainer

    cfg = make_cfg(run, tmp_path / "run", steps=1)
    cfg.nats.url = nats_server.url
    monkeypatch.setattr(models, "ensure_model", lambda name: base_model(tmp_path))
    monkeypatch.setattr(trainer, "Trainer", lambda *a, **k: TrainerDouble())
    monkeypatch.setattr(ranks, "Driver", lambda t: t)  # the double answers the Driver's calls itself
    return cfg


async def test_the_loop_keeps_running_while_the_learner_is_built(nats_server, tmp_path, monkeypatch):
    from parley.learner import resume as start
    from parley.learner import service

    cfg = start_with_doubles(nats_server, tmp_path, monkeypatch, "slowstart")

    fresh, building = start.fresh, []

    def slow_fresh_double(*args, **kwargs):
        """Test double for a slow step of the Learner's construction (a large ledger or split to read)."""
        building.append(time.monotonic())
        time.sleep(SLOW_S)
        building.append(time.monotonic())
        return fresh(*args, **kwargs)

    async def run_double(self, stop) -> int:
        """Test double for Learner.run: the start is what is measured here."""
        return 0

    monkeypatch.setattr(start, "fresh", slow_fresh_double)
    monkeypatch.setattr(service.Learner, "run", run_double)

    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    ticking = asyncio.create_task(tick())
    try:
        code = await service.main(asyncio.Event(), cfg, resume=False)
    finally:
        ticking.cancel()
    assert code == 0
    assert len(building) == 2, building  # the slow step ran, once
    during = [t for t in ticks if building[0] < t < building[1]]
    # 0.05 s ticks over 1.5 s: about 30 while the loop is free, none while the construction holds it
    assert len(during) >= 10, f"{len(during)} ticks of the loop while the Learner was built for {SLOW_S} s"


async def test_a_refusal_while_the_learner_is_built_is_still_one_line(nats_server, tmp_path, monkeypatch, caplog):
    from parley.learner import resume as start
    from parley.learner import service

    cfg = start_with_doubles(nats_server, tmp_path, monkeypatch, "refused")

    def refusing_fresh_double(*args, **kwargs):
        """Test double for a construction step that refuses the run (as a mismatched ledger does)."""
        raise start.LearnerStateError("test double: run dir holds another run's ledger; use a new run.dir")

    monkeypatch.setattr(start, "fresh", refusing_fresh_double)
    with caplog.at_level("ERROR", logger="parley.learner.service"):
        code = await service.main(asyncio.Event(), cfg, resume=False)
    assert code == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "parley.learner.service"]
    assert lines == ["test double: run dir holds another run's ledger; use a new run.dir"]


# A test double of `parley eval --follow`: says it is up (with its pid) and what ended it.
EVAL_CHILD_DOUBLE = r"""
import os, sys
print(f"child up {os.getpid()}", flush=True)
for line in sys.stdin:
    pass
print("end of input", flush=True)
"""


def trainer_raises_double(*args, **kwargs):
    """Test double for a Trainer build that fails (out of GPU memory at start)."""
    raise RuntimeError("test double: CUDA out of memory while the model was built")


def learner_refused_double(*args, **kwargs):
    """Test double for a construction step that refuses the run (as a mismatched ledger does)."""
    from parley.learner.resume import LearnerStateError

    raise LearnerStateError("test double: run dir holds another run's ledger; use a new run.dir")


@pytest.mark.parametrize("failure", ["trainer", "refused"])
async def test_an_eval_child_started_early_ends_with_a_learner_that_fails_to_start(
    nats_server, tmp_path, monkeypatch, failure
):
    """The eval child starts before the model is built (learner.service.early_evals); a learner whose
    Trainer build raises, or that refuses the run (exit 2), ends it (end of input) before it returns."""
    import os
    import sys
    from pathlib import Path

    from parley.evaluation import periodic
    from parley.learner import resume as start
    from parley.learner import service, trainer

    cfg = start_with_doubles(nats_server, tmp_path, monkeypatch, f"evalchild{failure}")
    cfg.learner.eval_every = 1
    script = tmp_path / "eval_child_double.py"
    script.write_text(EVAL_CHILD_DOUBLE)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    monkeypatch.setattr(periodic, "eval_argv", lambda cfg, config_path, out: [sys.executable, str(script)])
    if failure == "trainer":
        monkeypatch.setattr(trainer, "Trainer", trainer_raises_double)
        with pytest.raises(RuntimeError, match="test double: CUDA out of memory"):
            await service.main(asyncio.Event(), cfg, resume=False)
    else:
        monkeypatch.setattr(start, "fresh", learner_refused_double)
        assert await service.main(asyncio.Event(), cfg, resume=False) == 2
    seen = (tmp_path / "run" / "eval" / "follow.log").read_text().splitlines()
    assert seen[0].startswith("child up ") and seen[1:] == ["end of input"]  # started, then ended by the learner
    pid = int(seen[0].split()[-1])
    with pytest.raises(ProcessLookupError):  # gone, and reaped
        os.kill(pid, 0)


async def test_a_resumed_learner_or_a_refused_run_dir_starts_no_eval_child_early(tmp_path):
    from parley.learner import checkpoint as ckpt
    from parley.learner import service
    from tests.integration.test_learner_fates import make_cfg

    cfg = make_cfg("early", tmp_path / "run", steps=1, eval_every=1)
    assert await service.early_evals(cfg, resume=True) is None
    ckpt.learner_dir(cfg.run_dir).mkdir(parents=True)
    (ckpt.learner_dir(cfg.run_dir) / ckpt.STATE_FILE).write_bytes(b"")  # a learner state: the Learner refuses
    assert await service.early_evals(cfg, resume=False) is None
    assert not (cfg.run_dir / "eval").exists()  # nothing of that run touched


# Run in a fresh interpreter (this one has torch imported already): the real main() up to the eval
# child's start, with a test double for early_evals that says whether torch was imported by then.
TORCH_AT_EVAL_START = r"""
import asyncio, sys
from pathlib import Path

from parley.engines import models
from parley.learner import service
from tests.integration.test_learner_fates import base_model, make_cfg


class Stop(Exception):
    pass


async def early_evals_double(cfg, resume):
    print("torch imported when the eval child starts:", "torch" in sys.modules, flush=True)
    raise Stop


tmp = Path(sys.argv[2])
cfg = make_cfg("evalfirst", tmp / "run", steps=1, eval_every=1)
cfg.nats.url = sys.argv[1]
models.ensure_model = lambda name: base_model(tmp)
service.early_evals = early_evals_double
try:
    asyncio.run(service.main(asyncio.Event(), cfg, resume=False))
except Stop:
    pass
"""


def test_the_eval_child_starts_before_the_learner_imports_torch(nats_server, tmp_path):
    """The eval child imports vLLM and opens its engine (tens of seconds on a GPU machine); the learner
    starts it before importing torch and the trainer (2026-12-07, H100: the child started 7.7 s after the
    actor, and v0's result came 8 s after step 1, with later versions queued behind it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "torch_at_eval_start.py"
    script.write_text(TORCH_AT_EVAL_START)
    res = subprocess.run(
        [sys.executable, str(script), nats_server.url, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert "torch imported when the eval child starts: False" in res.stdout, res.stdout + res.stderr[-2000:]
