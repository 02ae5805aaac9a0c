"""deploy/gpu_share.py: the one rule of which GPU sharing a `parley up` run gets (decide), by hand for
each case; "auto" taking phased where only the phased memory plan fits or where it measured faster on
the same GPU model; the workload's fingerprint; the evidence a finished run keeps and a corrupt
evidence file. The GPU's name is a test double (no nvidia-smi here); no GPU, no network, no model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from parley.config.run import load_config, phased_refusal
from parley.deploy import gpu_share
from parley.deploy.cli import app
from parley.deploy.gpu_share import Facts, Fit, Measured, decide, fingerprint, read_evidence, record, record_run, steady
from parley.deploy.mps import BINARY, MISSING
from tests.unit.test_phased_plan import PHASED

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "deploy" / "configs" / "tiny.toml"
GPU = "NVIDIA H100 80GB HBM3"  # the name this test's GPU double answers
MPS = "/usr/bin/nvidia-cuda-mps-control"

# tiny, one actor and the learner on a 10 GiB GPU, allowed phased sharing (tests/unit/test_phased_plan.py's
# PHASED, gpu_share left "auto"); with a 5.6 GiB KV cache only the phased plan fits (9.58 GiB overlapped
# against 9.5 usable, 8.61 phased).
PHASED_OK = [kv for kv in PHASED if not kv.startswith("up.gpu_share=")]
FITS_ONLY_PHASED = [*PHASED_OK, "actor.engine.kv_cache_bytes=6012954214"]


def measured(mode: str, tokens_per_s: float, gpu: str = GPU) -> Measured:
    return Measured(
        mode=mode, tokens_per_s=tokens_per_s, steps=20, gpu=gpu, run_dir=f"runs/{mode}", measured="2026-12-06 12:00 UTC"
    )


def auto(**kw) -> Facts:
    return Facts(share="auto", uses_gpu=True, sleep_level=2, **kw)


# -- the table by hand ----------------------------------------------------------------------------


def test_a_share_named_is_taken_and_refused_where_it_cannot_be():
    assert decide(Facts(share="plain", uses_gpu=True)) == gpu_share.Decision("plain", "")
    assert decide(Facts(share="plain", uses_gpu=False)).mode == "none"
    assert decide(Facts(share="auto", uses_gpu=False)) == gpu_share.Decision("none", "")  # nothing to share
    for share in ("mps", "phased"):
        d = decide(Facts(share=share, uses_gpu=False))
        assert d.mode == "none" and "puts nothing on a GPU" in d.refusal and not d.here
    d = decide(Facts(share="mps", uses_gpu=True))  # no binary: refused at start, a note in a dry run
    assert d.mode == "mps" and d.refusal == MISSING and d.here and "would refuse" in d.line
    d = decide(Facts(share="mps", uses_gpu=True, mps_binary=MPS))
    assert d.mode == "mps" and not d.refusal and not d.fallback and f"({MPS} -d)" in d.line
    d = decide(Facts(share="phased", uses_gpu=True, sleep_level=1))
    assert d.mode == "phased" and "sleep level 1" in d.line and "no MPS daemon" in d.line


def test_auto_without_evidence_takes_mps_where_the_binary_is_and_plain_otherwise():
    d = decide(auto(mps_binary=MPS))
    assert d.mode == "mps" and d.fallback and 'MPS (gpu_share = "auto"; plain if' in d.line
    d = decide(auto())
    assert d.mode == "plain" and f"{BINARY} is not on this machine's PATH" in d.line
    assert "measured" not in d.line  # no GPU name here: nothing to look up, nothing said
    d = decide(auto(gpu=GPU))
    assert (
        d.mode == "plain" and f'nothing measured for this config on {GPU}: run once with gpu_share = "phased"' in d.line
    )


@pytest.mark.parametrize(
    "sets, words",
    [
        (["learner.max_staleness=1"], "learner.max_staleness=1"),
        (["learner.oversample_groups=2"], "learner.oversample_groups=2"),
        (["up.actors=2"], "with 2 actors"),
        (["actor.sleep_level=2", "actor.engine.max_lora_rank=16"], "actor.sleep_level = 2 with"),
    ],
)
def test_auto_never_takes_phased_where_the_config_refuses_it(sets, words):
    why = phased_refusal(load_config(None, [*PHASED_OK, *sets]))
    assert why is not None and words in why  # config.run's own reasons, not repeated here
    faster = (measured("phased", 9000.0), measured("mps", 4000.0))
    d = decide(auto(mps_binary=MPS, gpu=GPU, phased_refusal=why, evidence=faster))
    assert (
        d.mode == "mps" and "not phased, though measured at phased 9,000 trained tokens/s" in d.line and words in d.line
    )
    fits_only_phased = Fit(usable=9.5, overlapped=9.6, phased=8.6)
    d = decide(auto(mps_binary=MPS, gpu=GPU, phased_refusal=why, fit=fits_only_phased))
    assert d.mode == "mps" and "not phased" not in d.line  # no evidence of phased: its refusal is not said
    assert phased_refusal(load_config(None, PHASED_OK)) is None


@pytest.mark.parametrize(
    "evidence, mode, words",
    [
        (
            (measured("phased", 6100.0), measured("mps", 5200.0)),
            "phased",
            f'gpu_share = "auto", faster measured on {GPU}: phased 6,100 trained tokens/s (runs/phased, steps 2..20, '
            "2026-12-06 12:00 UTC) against mps 5,200 trained tokens/s (runs/mps",
        ),
        (
            (measured("phased", 4100.0), measured("mps", 5200.0)),
            "mps",
            f"not phased, slower measured on {GPU}: phased 4,100 trained tokens/s",
        ),
        ((measured("phased", 6100.0), measured("plain", 3000.0)), "phased", "against plain 3,000"),  # MPS failed then
        ((measured("phased", 6100.0),), "mps", 'run once with gpu_share = "mps" to compare'),
        (
            (measured("mps", 5200.0),),
            "mps",
            'mps 5,200 trained tokens/s (runs/mps, steps 2..20, 2026-12-06 12:00 UTC); run once with gpu_share = "phased" to compare',
        ),
        (
            (measured("phased", 9000.0, gpu="NVIDIA H200"), measured("mps", 5200.0)),
            "mps",
            'run once with gpu_share = "phased"',
        ),
    ],
)
def test_auto_takes_the_faster_of_what_was_measured_on_this_gpu(evidence, mode, words):
    d = decide(auto(mps_binary=MPS, gpu=GPU, evidence=evidence))
    assert d.mode == mode and words in d.line, d.line
    if mode == "mps":
        assert d.fallback  # still plain where the daemon cannot serve


def test_measurements_of_another_gpu_are_ignored():
    other = (measured("phased", 9000.0, gpu="NVIDIA H200"), measured("mps", 100.0, gpu="NVIDIA H200"))
    assert decide(auto(mps_binary=MPS, gpu=GPU, evidence=other)) == decide(auto(mps_binary=MPS, gpu=GPU))
    assert decide(auto(mps_binary=MPS, evidence=other)).mode == "mps"  # no name here: none applies


def test_auto_takes_phased_where_only_the_phased_plan_fits():
    d = decide(auto(fit=Fit(usable=9.5, overlapped=9.58, phased=8.61)))
    assert d.mode == "phased"
    assert "overlapped, the memory plan needs 9.6 GiB of 9.5 usable; phased, 8.6" in d.line
    assert (
        decide(auto(fit=Fit(usable=9.5, overlapped=11.0, phased=10.0))).mode == "plain"
    )  # neither fits: refused later


# -- through `parley up --dry-run` ----------------------------------------------------------------


def dry(sets: list[str]):
    return CliRunner().invoke(app, ["up", "--dry-run", *(a for s in sets for a in ("--set", s))])


def test_auto_runs_a_config_that_fits_only_phased(monkeypatch, tmp_path):
    """Fails on the code before deploy/gpu_share.py: "auto" never took phased, so the overlapped plan
    (9.58 GiB of 9.5 usable) refused the run."""
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    out = dry(FITS_ONLY_PHASED)
    assert out.exit_code == 0, out.output
    assert '# GPU sharing: phased (gpu_share = "auto": overlapped, the memory plan needs' in out.output
    assert 'gpu_share = "phased"' in out.output  # the config every child is given
    assert "GENERATE" in out.output  # the plan shown is the phased one


def test_the_dry_run_takes_the_faster_sharing_measured_here(monkeypatch, tmp_path):
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    monkeypatch.setattr(gpu_share, "gpu_name", lambda: GPU)  # test double of nvidia-smi's answer
    monkeypatch.setattr(gpu_share.shutil, "which", lambda name: None)  # no MPS binary: overlapped is plain
    key = fingerprint(load_config(None, PHASED_OK))
    record(key, "plain", GPU, Path("runs/a"), steps_rows([(0, 0), (10.0, 30_000), (20.0, 30_000)]))
    out = dry(PHASED_OK)
    assert out.exit_code == 0 and 'run once with gpu_share = "phased" to compare' in out.output, out.output
    assert 'gpu_share = "auto"' in out.output
    record(key, "phased", GPU, Path("runs/b"), steps_rows([(0, 0), (10.0, 40_000), (20.0, 40_000)]))
    out = dry(PHASED_OK)
    assert out.exit_code == 0, out.output
    assert '# GPU sharing: phased (gpu_share = "auto", faster measured on' in out.output
    assert "phased 4,000 trained tokens/s (runs/b" in out.output and "against plain 3,000" in out.output
    assert 'gpu_share = "phased"' in out.output


# -- the fingerprint -------------------------------------------------------------------------------


def test_the_fingerprint_leaves_out_the_sharing_the_length_and_the_directory():
    base = fingerprint(load_config(None, PHASED_OK))
    same = ['up.gpu_share="phased"', "learner.steps=7", 'run.dir="/elsewhere"', 'run.name="other"', "up.live=false"]
    assert fingerprint(load_config(None, [*PHASED_OK, *same])) == base
    assert fingerprint(load_config(None, [*PHASED_OK, "learner.groups_per_step=3"])) != base
    assert fingerprint(load_config(None, [*PHASED_OK, 'policy.model="smol"', 'actor.engine.model="smol"'])) != base


# -- the evidence ----------------------------------------------------------------------------------


def steps_rows(steps: list[tuple[float, int]]) -> list[dict]:
    """metrics.jsonl rows: (seconds after the first step's end, trained tokens) per step, 0.5 s publish."""
    return [
        {"step": i + 1, "ended_at": 1000.0 + t, "publish_s": 0.5, "trained_tokens": n, "loss": 0.1}
        for i, (t, n) in enumerate(steps)
    ]


def test_the_steady_window_starts_at_the_first_steps_end():
    rows = steps_rows([(0.0, 99_999), (10.0, 2000), (21.0, 3000)])  # step 1's tokens and start-up left out
    assert steady(rows) == (pytest.approx(5000 / 21), 3)
    assert steady(rows[:1]) is None and steady([{"step": 1, "loss": 0.1}]) is None


def test_a_finished_run_keeps_its_measurement_the_way_up_records_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_share, "gpu_name", lambda: GPU)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = steps_rows([(0.0, 1000), (10.0, 2000), (21.0, 3000)])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = record_run("k1", "phased", run_dir)
    assert line.startswith(f"GPU sharing measured: phased 238 trained tokens/s ({run_dir}, steps 2..3")
    assert str(tmp_path / "cache" / "gpu_share.json") in line
    [kept], note = read_evidence("k1")
    assert note == "" and (kept.mode, kept.tokens_per_s, kept.steps, kept.gpu) == ("phased", 238.1, 3, GPU)
    assert read_evidence("k2") == ((), "")
    record_run("k1", "phased", run_dir)  # the latest of a sharing on a GPU replaces the one before
    record_run("k1", "mps", run_dir)
    assert sorted(m.mode for m in read_evidence("k1")[0]) == ["mps", "phased"]
    (run_dir / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert "not recorded (fewer than two timed steps" in record_run("k1", "plain", run_dir)
    monkeypatch.setattr(gpu_share, "gpu_name", lambda: None)
    assert record_run("k1", "plain", run_dir) == ""  # no GPU name to key it by


def test_a_corrupt_evidence_file_warns_and_auto_decides_as_without_it(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    path = tmp_path / "gpu_share.json"
    path.write_text('{"version": 1, "runs": {"k1": [{"mode": "phased", "tokens')
    with caplog.at_level(logging.WARNING, logger="parley.deploy.gpu_share"):
        evidence, note = read_evidence("k1")
    assert evidence == () and f"{path} cannot be read" in note and "cannot be read" in caplog.text
    d = decide(auto(mps_binary=MPS, gpu=GPU, evidence=evidence, evidence_note=note))
    assert d.mode == "mps" and note in d.line
    path.write_text('{"version": 1, "runs": {"k1": [{"mode": "streams"}]}}')  # valid JSON, wrong shape
    assert read_evidence("k1")[0] == ()
    # the next run's record sets the bad file aside and begins a new one
    assert record("k1", "mps", GPU, tmp_path, steps_rows([(0, 0), (10.0, 1000)])) is not None
    assert (tmp_path / "gpu_share.json.bad").exists() and [m.mode for m in read_evidence("k1")[0]] == ["mps"]


@pytest.mark.parametrize(("code", "kept"), [(0, True), (130, True), (1, False), (2, False), (3, False)])
def test_a_run_stopped_by_its_operator_is_a_measurement_and_a_failed_one_is_not(code, kept):
    # a benchmark's wall budget stops `parley up` with SIGINT (exit 130): its steps up to the stop are
    # as steady as a finished run's, and the H100 runs of bench/gpu_run.sh T were all stopped this way
    assert gpu_share.measured_end(code) is kept


def test_the_gpus_name_is_asked_beside_the_plans_question_to_the_driver(monkeypatch):
    """Under "auto" on a GPU, nvidia-smi's name and the memory plan's GPU total (deploy/cuda_driver) are two
    child processes before any work starts: asked side by side, the check waits for the slower only."""
    import time

    from parley.deploy import memory

    spans = {}

    def slow_name():  # test double of nvidia-smi's answer, as slow as one on a machine without persistence
        t = time.monotonic()
        time.sleep(1.0)
        spans["name"] = (t, time.monotonic())
        return GPU

    def slow_total():  # test double of the driver's answer
        t = time.monotonic()
        time.sleep(1.0)
        spans["total"] = (t, time.monotonic())
        return 10.0

    monkeypatch.setattr(gpu_share, "gpu_name", slow_name)
    monkeypatch.setattr(memory, "detect_gpu_gib", slow_total)
    cfg = load_config(None, [kv for kv in FITS_ONLY_PHASED if not kv.startswith("up.gpu_memory_gib=")])
    facts = gpu_share.facts_of(cfg)
    assert facts.gpu == GPU and facts.fit is not None  # both answers were used
    (a0, a1), (b0, b1) = spans["name"], spans["total"]
    assert a0 < b1 and b0 < a1  # each asked while the other was waiting: side by side, not one after the other


def test_runs_at_different_stages_of_learning_are_not_compared():
    """A run whose groups stopped carrying signal (the policy has its task: equal rewards, skipped) steps
    slower whatever the sharing: SmolLM2 on an H100, 2026-12-07, recorded mps at 314 trained tokens/s
    in such a run against 891-1,394 in the others. Two runs whose signal shares differ more than twice
    are not compared; "auto" keeps the usual sharing and says why."""

    def share(mode: str, tokens: float, signal: float | None) -> Measured:
        return Measured(
            mode=mode, tokens_per_s=tokens, steps=120, gpu=GPU, run_dir=f"runs/{mode}", measured="2026-12-07 14:24 UTC",
            signal_share=signal,
        )  # fmt: skip

    saturated_mps = share("mps", 314.0, 0.07)
    d = decide(auto(mps_binary=MPS, gpu=GPU, evidence=(share("phased", 900.0, 0.40), saturated_mps)))
    assert d.mode == "mps" and "not compared: the phased run trained 40% of its groups" in d.line, d.line
    assert "the mps run 7%" in d.line and 'set gpu_share = "phased"' in d.line
    # within a factor of two they are compared as before: 0.40 against 0.80 is the limit
    d = decide(auto(mps_binary=MPS, gpu=GPU, evidence=(share("phased", 900.0, 0.40), share("mps", 800.0, 0.80))))
    assert d.mode == "phased"
    d = decide(auto(mps_binary=MPS, gpu=GPU, evidence=(share("phased", 900.0, 0.39), share("mps", 800.0, 0.80))))
    assert d.mode == "mps" and "not compared" in d.line
    # a record from before the share was kept says nothing against comparing
    assert (
        decide(auto(mps_binary=MPS, gpu=GPU, evidence=(share("phased", 900.0, None), saturated_mps))).mode == "phased"
    )


def test_the_signal_share_is_read_from_the_learners_group_counts_over_the_window():
    rows = [
        {"step": 1, "groups": {"trained": 1, "stale": 0, "zero_advantage": 0}},
        {"step": 50, "groups": {"trained": 50, "stale": 30, "zero_advantage": 40}},
        {"step": 112, "groups": {"trained": 112, "stale": 43, "zero_advantage": 1404}},
    ]
    # from step 1's counts to the last: 111 trained, 1404 equal rewards (stale ones came back too late to count)
    assert gpu_share.signal_share(rows) == round(111 / 1515, 3) == 0.073
    assert gpu_share.signal_share(rows[:1]) is None and gpu_share.signal_share([{"step": 1}, {"step": 2}]) is None
