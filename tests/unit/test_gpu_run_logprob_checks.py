"""bench/gpu_run.sh part LC (issue 56: is [*.engine] torch_compile = false right?) with test doubles for
python3 and nvidia-smi: it runs bench/logprob_gpu.py for a next turn over cached context and after an
in-place weight swap, on the compiled engine and on the one torch_compile = false starts (decode-only CUDA
graphs), then full graphs of mixed steps as the control, each under its own limit with its own JSON, packs
the runs' logs in one file (the device brings back 8 a call) and names the card."""

from __future__ import annotations

import tarfile

from parley.engines.engine import NO_COMPILE
from tests.unit.test_gpu_run_time_to_target import _run_part


def test_part_lc_runs_each_log_prob_check_with_its_json_and_names_the_card(tmp_path):
    res, calls, out = _run_part(tmp_path, "LC")
    assert res.returncode == 0, res.stderr
    assert "import vllm" in calls[0]
    runs = [c.split("|") for c in calls[1:]]
    assert all(r[0] == "bench/logprob_gpu.py" and r[r.index("--model") + 1] == "smol" for r in runs)
    named = {r[r.index("--json") + 1].rsplit("/", 1)[1]: r for r in runs}
    assert set(named) == {
        "lc_nocompile_prefix.json",
        "lc_nocompile_reload.json",
        "lc_compiled_prefix.json",
        "lc_compiled_reload.json",
        "lc_full_graphs_prefix.json",
    }
    for name, r in named.items():
        assert ("--no-torch-compile" in r) == (not name.startswith("lc_compiled")), r
        assert ("--prefix" in r) != ("--reload" in r), r  # one of the two a run
        if "--no-torch-compile" in r:  # the knob's graphs (engines.engine.NO_COMPILE), or FULL as the control
            mode = r[r.index("--cudagraph-mode") + 1]
            assert mode == ("FULL" if name == "lc_full_graphs_prefix.json" else NO_COMPILE["cudagraph_mode"]), r
    assert "H100" in (out / "gpu.log").read_text()
    assert res.stdout.count("rc=0 in") == 5 and "[gpu_run] lc_nocompile_prefix: rc=0" in res.stdout
    with tarfile.open(out / "lc_logs.tgz") as tar:
        logs = {m.name.rsplit("/", 1)[-1] for m in tar.getmembers() if m.isfile()}
    assert logs == {n.replace(".json", ".log") for n in named}
    assert not (out / "lc_logs").exists() and not list(out.glob("lc_*.log"))
