"""bench/gpu_run.sh part LC (issue 56: is an engine without vLLM's torch.compile right?) with test doubles for
python3 and nvidia-smi: it runs bench/logprob_gpu.py for a next turn over cached context and after an
in-place weight swap, each with and without torch.compile, then the decode-only graphs, each under its own
limit with its own JSON, and names the card."""

from __future__ import annotations

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
        "lc_nocompile_decode_only_prefix.json",
    }
    for name, r in named.items():
        assert ("--no-torch-compile" in r) == name.startswith("lc_nocompile"), r
        assert ("--prefix" in r) != ("--reload" in r), r  # one of the two a run
    decode_only = named["lc_nocompile_decode_only_prefix.json"]
    assert decode_only[decode_only.index("--cudagraph-mode") + 1] == "FULL_DECODE_ONLY"
    assert "H100" in (out / "gpu.log").read_text()
    assert res.stdout.count("rc=0 in") == 5 and "[gpu_run] lc_nocompile_prefix: rc=0" in res.stdout
