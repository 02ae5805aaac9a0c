"""Kill points named, not random: one learner run is SIGKILLed at each named point of the resume
table (docs/learner.md, "What a kill at each point leaves"; runtime.killpoints), one point per life,
each life resumed with `--resume`, and the books are checked after every kill and at the end: every
task the feeder issued ends trained once, dropped with its reason, or waiting; none lost, none
trained twice, in trained.jsonl, the ledger and the archive alike.

Sized for the default test command (not marked faults): real nats-server, the real `parley learner`
command line on the toy model (fp32, CPU), its feeder issuing the tasks and a stand-in actor
answering them; every life is forked from one process that imported the learner's modules once
(tests.faults.lives), so a life costs its model load and steps, not the imports.

The server checks users as `parley up`'s does: each life logs in as the learner's user with the
learner's permissions (deploy/credentials.py, passed as deploy.up.child_env passes them), so a
resume that needs a grant the learner lacks fails here (one did: reading back TASKS). The stand-in
actor and the books use the admin user. Every server refusal in a life's log fails the chain.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from parley.learner import checkpoint as ckpt
from parley.learner.checkpoint import read_state
from parley.protocol import dead, topology
from tests.faults.chaos import (
    load_final_state,
    owed_ids,
    read_channel,
    refusals,
    settle,
    trained_lines,
    up_credentials,
    up_env,
)
from tests.faults.lives import Lives
from tests.integration.test_learner_resume import N, toy  # noqa: F401 (toy: a fixture)
from tests.integration.test_learner_resume_every import StandInActor

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "kills"
GROUPS_PER_STEP, STEPS = 2, 2
ACK_WAIT_S = 2.0
BUS = topology.BusSettings(max_bytes=64 * 1024**2, ack_wait_s=ACK_WAIT_S)

# One life per point, in this order (the six rows of docs/learner.md's resume table); the last life
# runs to the end. "held:2": the second sample buffered. "step" and later die inside step 1 (its
# groups retrained each time), "ledger" right after step 1's ledger write. The points that split two
# of the table's rows further (checkpoint_write, archive) and the upload run in `make faults`
# (tests/faults/test_kill_power.py), with a power loss after each.
KILLS = ["held:2", "acks", "step", "published", "checkpoint", "ledger"]
# trained.jsonl lines beyond the ledger's step at the kill (written before the ledger names them;
# the resume cuts them)
LINES_AHEAD = {"archive": 1}
LIFE_S = 90  # a life takes 2-25 s on two busy cores; one that stalls fails the test with the books


def argv(url: str, run_dir: Path, model: Path, resume: bool) -> list[str]:
    sets = [
        f'run.dir="{run_dir}"',
        f'policy.model="{model}"',
        f"rollout.n={N}",
        f"learner.groups_per_step={GROUPS_PER_STEP}",
        "learner.max_staleness=1",
        'learner.stale_policy="correct"',
        "learner.micro_batch_tokens=256",
        'learner.dtype="float32"',
        "learner.ledger_flush_s=0.3",
        "learner.eval_every=0",
        # every life of this run but the last dies inside step 1 or 2, and a kill after the step's
        # attempt is recorded counts as one: the default (3) would reject the groups as step_failed
        "learner.max_step_attempts=20",
        f"bus.ack_wait_s={ACK_WAIT_S}",
        f"bus.max_bytes={BUS.max_bytes}",
    ]
    out = ["learner", "--nats", url, "--run", RUN, "--steps", str(STEPS)]
    for s in sets:
        out += ["--set", s]
    return out + (["--resume"] if resume else [])


def archived(run_dir: Path) -> Counter:
    """traj id -> times in the archive's step files (trained samples)."""
    from parley.evaluation.evallog import read_log

    count: Counter = Counter()
    for p in sorted(ckpt.archive_dir(run_dir).glob("step*-trained.parquet")):
        count.update(s.traj_id for s in read_log(p))
    return count


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_model):
    """Run the whole chain once for the module: {point: what its kill left and its resume did}, the
    final books and the timing."""
    from parley.deploy.natsserver import NatsServer  # as tests/conftest.py's nats_server

    root = tmp_path_factory.mktemp("kills")
    creds, conf = up_credentials(root, RUN)
    server = NatsServer(root / "nats", port=0, extra_conf=conf)
    server.start()
    try:
        return asyncio.run(run_chain(root, tiny_model, server.url, creds, KILLS))
    finally:
        server.stop()


async def run_chain(
    root: Path, model: Path, url: str, creds: dict, kills: list[str], after_kill=None, env=None
) -> dict:
    """One run, one learner life per point of `kills` (PARLEY_KILL_AT), each resumed, then a last
    life to the end, each as the learner's user of `creds` (up_credentials), the test as the admin;
    `after_kill(run_dir, point)` runs after each kill, before the next life; `env` is added to every
    life's. {"lives": {point: ...}, "books": settle(...), "refused": {point: lines}, ...}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parley.protocol.connect import connect

    t0 = time.monotonic()
    lives = Lives()  # its imports overlap the loading below (a stray one ends with the test's stdin)
    toy_parts = (
        model,
        AutoTokenizer.from_pretrained(model),
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(),
    )
    out: dict = {"lives": {}, "refused": {}}
    nc = await connect(url, name="kill-points", user=creds["admin"][0], password=creds["admin"][1])
    js = nc.jetstream()
    await topology.ensure_topology(js, RUN, BUS)
    actor = await StandInActor(nc, js, toy_parts, RUN).start()
    run_dir, log = root / "run", root / "learner.log"
    try:
        for i, point in enumerate([*kills, None]):
            life_env = {"PARLEY_LOG": "INFO", "PARLEY_KILL_AT": point or "", **up_env("learner", creds), **(env or {})}
            mark = len(log.read_text()) if log.exists() else 0
            started = time.monotonic()
            pid = lives.start(argv(url, run_dir, model, resume=i > 0), life_env, log)
            wait = asyncio.create_task(asyncio.to_thread(lives.wait))
            done, _ = await asyncio.wait({wait, actor.worker}, timeout=LIFE_S, return_when=asyncio.FIRST_COMPLETED)
            actor.check()
            if wait not in done:  # stalled (a lost group is given up only at task_deadline_s): the books say why
                os.kill(pid, signal.SIGKILL)
                await wait
            text = log.read_text()[mark:]
            if refused := refusals(text):
                out["refused"][point or "end"] = refused
            if wait not in done:
                out["stalled"] = f"life {i} ({point or 'to the end'}) took over {LIFE_S} s:\n{text[-3000:]}"
                break
            state = read_state(run_dir)
            out["lives"][point or "end"] = {
                "code": wait.result(),
                "log": text,
                "ledger_step": state.step if state else None,
                "ledger_tag": state.tag if state else None,
                "tag_on_disk": bool(state and state.tag) and (ckpt.ckpt_dir(run_dir) / state.tag).is_dir(),
                "lines": len(trained_lines(run_dir)),
                "archived": archived(run_dir),
                "s": round(time.monotonic() - started, 1),
            }
            if point and after_kill is not None:
                out["lives"][point]["after_kill"] = after_kill(run_dir, point)
    finally:
        lives.close()
        await actor.stop()
    owed = await owed_ids(js, RUN, settle_s=3 * ACK_WAIT_S)
    tasks = await read_channel(js, RUN, "tasks")
    letters, _ = await dead.read_since(js, RUN, 1)
    state, buffered = load_final_state(run_dir)
    out["books"] = settle(tasks, letters, trained_lines(run_dir), state, buffered, owed)
    out["state"] = state
    out["archived"] = archived(run_dir)
    out["lines"] = trained_lines(run_dir)
    await nc.close()
    out["total_s"] = round(time.monotonic() - t0, 1)
    print(f"\nkill points: {[(p, life['s']) for p, life in out['lives'].items()]}, {out['total_s']} s in all")
    return out


def test_the_server_refused_no_life_anything(chain):
    assert chain["refused"] == {}, f"the learner's user lacks a grant (deploy/permissions.py): {chain['refused']}"


@pytest.mark.parametrize("kill", KILLS)
def test_a_learner_killed_at_a_named_point_resumes_with_its_books_whole(chain, kill):
    point = kill.split(":")[0]
    assert "stalled" not in chain, (
        f"{chain['stalled']}\nbooks: {chain['books'].summary()}, lost {chain['books'].lost[:10]}"
    )
    names = [*KILLS, None]
    at = chain["lives"][kill]
    after = chain["lives"][names[names.index(kill) + 1] or "end"]
    # it died there, by SIGKILL, and nowhere else
    assert at["code"] == -9, f"life killed at {kill} ended with {at['code']}:\n{at['log'][-3000:]}"
    assert f"PARLEY_KILL_AT: killed at {point} (" in at["log"], at["log"][-3000:]
    # what the kill left: the ledger vouches for a checkpoint that exists, trained.jsonl holds no line
    # the ledger does not name but those written just before it, the archive no step twice
    assert at["tag_on_disk"] or not at["ledger_tag"], f"the ledger names checkpoint {at['ledger_tag']}, not on disk"
    assert at["lines"] == (at["ledger_step"] or 0) + LINES_AHEAD.get(point, 0), (kill, at)
    assert max(at["archived"].values(), default=1) == 1, f"archived twice at the kill: {at['archived']}"
    # the next life resumed from that ledger
    assert f"resumed at step {at['ledger_step'] or 0} " in after["log"] or (
        at["ledger_step"] is None and "no learner state" in after["log"]
    ), after["log"][-3000:]
    # and the run's books at the end: every issued task trained once, dropped with its reason, or waiting
    books = chain["books"]
    assert books.lost == [], f"lost samples: {books.lost[:20]}"
    assert books.trained_twice == [], f"trained twice: {books.trained_twice[:20]}"
    assert books.inconsistent == [], f"inconsistent ledger: {books.inconsistent[:20]}"


def test_the_chain_ends_with_every_step_trained_once_in_all_three_books(chain):
    assert "stalled" not in chain, (
        f"{chain['stalled']}\nbooks: {chain['books'].summary()}, lost {chain['books'].lost[:10]}"
    )
    assert chain["lives"]["end"]["code"] == 0, chain["lives"]["end"]["log"][-3000:]
    lines, state, archive = chain["lines"], chain["state"], chain["archived"]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1)) and state.step == STEPS
    trained = Counter(t for line in lines for t in line["traj_ids"])
    assert len(trained) == STEPS * GROUPS_PER_STEP * N and max(trained.values()) == 1
    assert archive == trained, "the archive's trained samples differ from trained.jsonl"
    tasks = {t.rsplit("/", 1)[0] for t in trained}
    assert all(t in state.done and state.done.get(t) in (None, "trained") for t in tasks), "the ledger disagrees"
    assert chain["books"].trained == STEPS * GROUPS_PER_STEP * N
