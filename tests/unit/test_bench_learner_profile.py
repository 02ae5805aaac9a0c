"""bench/learner_gpu.py's profile summary (--profile DIR) and the options of part LP (issue 56: where
the learner's step goes): kernel kinds from real CUDA kernel names, the GPU's idle time from its busy
intervals, a real torch.profiler run of a tiny model on CPU summarised, the random_words-shaped step and
the FLOPs basis of a LoRA row."""

from __future__ import annotations

import pytest
import torch

from bench import learner_gpu as lg

# kernel names as CUDA profiles of the learner's step show them (H100/H200, torch 2.9-2.10)
NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off": "matmul",
    "nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNN": "matmul",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "matmul",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>": (
        "attention"
    ),
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>": "softmax_ce",
    "void at::native::_scatter_gather_elementwise_kernel<128, 4>": "softmax_ce",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled_fused",
    "Memcpy HtoD (Pageable -> Device)": "memcpy",
    "Memset (Device)": "memcpy",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
    "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#11}::operator()() const::{lambda(c10"
    "::BFloat16)#1}>>": "cast_copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)>": (
        "elementwise"
    ),
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>>>>": "reduction",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_kernel_kind_of_real_kernel_names(name):
    assert lg.kernel_kind(name) == NAMES[name]


def test_busy_time_is_the_union_of_overlapping_intervals():
    # two streams overlap 10-20 us; 40-50 alone; a kernel inside another adds nothing
    assert lg.busy_seconds([(0.0, 20.0), (10.0, 30.0), (40.0, 50.0), (12.0, 14.0)]) == pytest.approx(40e-6)
    assert lg.busy_seconds([]) == 0.0


def test_summary_counts_launches_ranks_kernels_and_says_the_idle_share():
    records = [("gemm_a", 0.4), ("gemm_a", 0.4), ("flash_fwd", 0.2), ("exp_kernel", 0.1)]
    intervals = [(0.0, 400_000.0), (400_000.0, 800_000.0), (900_000.0, 1_100_000.0), (1_100_000.0, 1_200_000.0)]
    runtime = [("cudaLaunchKernel", 1e-5)] * 4 + [("cudaStreamSynchronize", 0.2), ("cudaDeviceSynchronize", 0.1)]
    s = lg.summarize_profile(records, intervals, wall_s=1.5, runtime=runtime, top=2)
    assert s["launches"] == 4 and s["busy_s"] == pytest.approx(1.1)
    assert s["idle_s"] == pytest.approx(0.4) and s["idle_share"] == pytest.approx(0.4 / 1.5)
    assert [t["kernel"] for t in s["top"]] == ["gemm_a", "flash_fwd"] and s["top"][0]["count"] == 2
    assert s["kinds_s"] == pytest.approx({"matmul": 0.8, "attention": 0.2, "elementwise": 0.1})
    assert s["kinds_launches"] == {"matmul": 2, "attention": 1, "elementwise": 1}
    assert s["kinds_share"]["matmul"] == pytest.approx(0.8 / 1.5)
    # the host waited twice on the GPU; the runtime calls ranked by time
    assert s["host_syncs"] == 2 and list(s["host_runtime"])[0] == "cudaStreamSynchronize"
    assert s["host_runtime"]["cudaLaunchKernel"] == {"count": 4, "s": pytest.approx(4e-5)}


def test_a_real_cpu_profile_of_a_tiny_lm_step_is_summarised(tmp_path):
    """torch.profiler on CPU over a forward and backward of a tiny LM head with log_softmax and SDPA:
    what the summary says about the operators it recorded, and the files --profile DIR leaves."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 4000)
    q = torch.randn(1, 2, 64, 16, requires_grad=True)
    x = torch.randn(64, 32)
    targets = torch.randint(0, 4000, (64,))

    def step():
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        logp = torch.log_softmax(head(x + a.sum()).float(), -1).gather(1, targets[:, None])
        logp.sum().backward()

    step()  # warm-up
    summary = lg.profile_step(step, torch.device("cpu"), str(tmp_path), "tiny")
    kinds = summary["kinds_s"]
    assert {"matmul", "softmax_ce", "attention"} <= set(kinds)
    assert summary["wall_s"] > 0 and 0.0 <= summary["idle_share"] <= 1.0
    assert 0 < len(summary["top"]) <= 25
    assert [t["s"] for t in summary["top"]] == sorted((t["s"] for t in summary["top"]), reverse=True)
    assert sum(summary["kinds_launches"].values()) == summary["launches"]
    assert (tmp_path / "profile_tiny.json").is_file()
    trace = tmp_path / "trace_tiny.json.gz"
    assert summary["trace"] == trace.name and 0 < trace.stat().st_size < lg.TRACE_MAX_BYTES
    # one trace per directory: a second phase writes its summary alone
    lg.profile_step(step, torch.device("cpu"), str(tmp_path), "second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile_second.json", "profile_tiny.json", trace.name]


def test_the_random_words_step_shape():
    """gpu-1-4b-lora.toml's conversation: 4 turns, 1,816 tokens, 1,536 trained (384 a turn)."""
    mask = lg.fixed_mask(1816, 1536, 4)
    assert len(mask) == 1816 and sum(mask) == 1536 and mask[0] == 0
    turns = "".join(map(str, mask)).replace("01", "0|1").replace("10", "1|0").split("|")
    assert [len(t) for t in turns] == [70, 384] * 4
    args = lg.parse_args(["--tiny", "--sequences", "5", "--seq-tokens", "100", "--seq-trained", "60"])
    samples = lg.draw_samples(args, 4096)
    assert len(samples) == 5 and all(len(s.token_ids) == 100 and s.n_trained == 60 for s in samples)


def test_sweep_options_parse_and_bad_values_name_the_fix(capsys):
    a = lg.parse_args(["--micro-batch-tokens", "4096,8192", "--gradient-checkpointing", "--profile"])
    assert a.mbt_list == [4096, 8192] and a.gc_list == ["on"] and a.profile == ""
    b = lg.parse_args(["--gradient-checkpointing", "off,on", "--profile", "/tmp/p"])
    assert b.gc_list == ["off", "on"] and b.profile == "/tmp/p" and b.mbt_list == [b.budget_tokens]
    assert lg.parse_args([]).gc_list == ["off"] and lg.parse_args([]).profile is None
    for bad, said in (
        (["--micro-batch-tokens", "4k"], "--micro-batch-tokens='4k'"),
        (["--gradient-checkpointing", "maybe"], "--gradient-checkpointing='maybe'"),
        (["--sequences", "4", "--seq-trained", "1816"], "--seq-trained=1816"),
    ):
        with pytest.raises(SystemExit):
            lg.parse_args(bad)
        assert said in capsys.readouterr().err


def test_a_lora_row_counts_4n_a_token_and_one_denominator():
    shape = lg.shape_of(lg.parse_args([]))
    n = lg.count_params(shape)
    lengths = [1816] * 64
    rows = [
        {"phase": "learner", "attention": "varlen", "world": 1, "lengths": lengths, "step_s": [10.0], "kl_coef": 0.0}
        for _ in range(2)
    ]
    rows[1]["lora_rank"] = 16
    lg.compute(rows, shape, n, peak_tflops=800.0)
    full, lora = rows
    assert full["flops_basis"] == "6N" and lora["flops_basis"] == "4N (LoRA)"
    assert full["flops"] - lora["flops"] == pytest.approx(2 * n * sum(lengths))
    assert lora["mfu_6n_datasheet"] == pytest.approx(full["mfu_datasheet"])
    assert lora["mfu_datasheet"] == pytest.approx(lora["flops"] / 10.0 / 989.4e12)


def test_a_micro_batch_projected_past_the_gpu_is_not_tried():
    """Activations scale with the tokens: from 4,096 tokens peaking at 30 GiB over 8 GiB held before any
    step, 8,192 would take 52 and 32,768 184 (skipped on an 80 GB card); nothing measured, no projection."""
    assert lg.projected_peak((4096, 30.0), 8.0, 8192) == pytest.approx(52.0)
    assert lg.projected_peak((4096, 30.0), 8.0, 32768) == pytest.approx(184.0)
    assert lg.projected_peak(None, 8.0, 8192) is None and lg.projected_peak((4096, 30.0), None, 8192) is None
    assert lg.projected_peak((8192, 50.0), 8.0, 4096) is None  # smaller than one that ran
