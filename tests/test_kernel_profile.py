"""perf/kernel_profile.py: kernels classed by name, device time from made-up chrome traces."""

import pytest

from perf import kernel_profile


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention"),
        ("triton_tem_fused_flex_attention_0", "attention"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "gemm"),
        ("triton_tem_fused_mm_3", "gemm"),
        ("triton_poi_fused_add_mul_7", "other"),
        ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_div_pow_relu_select_t_34", "other"),
        ("triton_red_fused__to_copy_add_bmm_index_mul_sum_3", "other"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
    ],
)
def test_kernel_names_fall_into_their_class(name, kind):
    assert kernel_profile.kernel_class(name) == kind


def trace(*events):
    return [{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur} for cat, name, ts, dur in events]


def test_breakdown_counts_overlap_once_and_shares_kernel_time_by_class():
    events = trace(
        ("kernel", "sm90_xmma_gemm", 0.0, 60.0),
        ("kernel", "flash_fwd", 50.0, 20.0),  # overlaps the GEMM by 10 us (another stream)
        ("gpu_memcpy", "Memcpy DtoD", 100.0, 20.0),  # idle 70..100
        ("cpu_op", "aten::mm", 0.0, 500.0),  # host events are not device work
    )
    out = kernel_profile.kernel_breakdown(events)
    assert out["gpu_busy_pct"] == pytest.approx(100 * 90 / 120)
    assert out["gemm_pct"] == pytest.approx(100 * 60 / 100)
    assert out["attention_pct"] == pytest.approx(100 * 20 / 100)
    assert out["other_kernel_pct"] == pytest.approx(100 * 20 / 100)


def test_breakdown_of_a_trace_without_device_work_is_empty():
    assert set(kernel_profile.kernel_breakdown(trace(("cpu_op", "aten::mm", 0.0, 5.0))).values()) == {None}


def test_top_kernels_ranks_names_by_summed_device_time_per_step():
    long_name = "triton_poi_fused_" + "x" * 120
    events = trace(
        ("kernel", "sm90_xmma_gemm", 0.0, 30.0),
        ("kernel", long_name, 30.0, 25.0),
        ("kernel", "sm90_xmma_gemm", 60.0, 30.0),  # a second call of the same kernel adds up: 60 us
        ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 90.0, 5.0),  # copies are listed by category
        ("gpu_memcpy", "Memcpy DtoD", 95.0, 5.0),
        ("cpu_op", "aten::mm", 0.0, 500.0),  # host events are not device work
    )
    # The trace holds two steps: per-step figures halve it.
    top = kernel_profile.top_kernels(events, n=2, steps=2)
    assert [k["kernel"] for k in top] == ["sm90_xmma_gemm", long_name[:90]]
    assert [k["class"] for k in top] == ["gemm", "other"]
    assert [k["calls_per_step"] for k in top] == [1.0, 0.5]
    assert [k["ms_per_step"] for k in top] == pytest.approx([0.030, 0.0125])
    assert [k["pct"] for k in top] == pytest.approx([100 * 60 / 95, 100 * 25 / 95])  # of all 95 us
    # The printed line both benches use: per-step ms, share, calls, class, name.
    assert kernel_profile.kernel_table_line(top[0]).split() == [
        "0.030",
        "ms",
        "63.2%",
        "x1",
        "gemm",
        "sm90_xmma_gemm",
    ]
    rest = kernel_profile.top_kernels(events, n=5, steps=1)
    assert rest[-1] == {"kernel": "gpu_memcpy", "class": "other", "calls_per_step": 2.0, "ms_per_step": 0.010,
                        "pct": pytest.approx(100 * 10 / 95)}  # fmt: skip


def test_idle_gaps_group_the_device_waits_by_their_neighbours_per_step():
    events = trace(
        ("kernel", "gemm_a", 0.0, 100.0),
        ("kernel", "small", 20.0, 10.0),  # inside gemm_a's span (another stream): gemm_a ends the work at 100
        ("kernel", "unique_sort", 300.0, 50.0),  # 200 us idle after gemm_a
        ("kernel", "hash", 355.0, 5.0),  # 5 us: under the 10 us threshold, not a stretch
        ("gpu_memcpy", "Memcpy DtoH", 400.0, 10.0),  # 40 us idle after hash
        ("kernel", "gemm_a", 1000.0, 100.0),  # second step: the device waited 590 us for the host
        ("kernel", "unique_sort", 1300.0, 50.0),  # 200 us again after gemm_a
        ("cpu_op", "aten::item", 410.0, 590.0),  # host events are not device work
    )
    gaps = kernel_profile.idle_gaps(events, n=2, steps=2)
    assert [(g["after"], g["before"]) for g in gaps] == [("gpu_memcpy", "gemm_a"), ("gemm_a", "unique_sort")]
    assert gaps[0]["idle_ms_per_step"] == pytest.approx(0.590 / 2)
    assert gaps[1]["idle_ms_per_step"] == pytest.approx(0.400 / 2)
    assert [g["stretches_per_step"] for g in gaps] == [0.5, 1.0]
    assert [g["longest_ms"] for g in gaps] == pytest.approx([0.590, 0.200])
    assert kernel_profile.idle_gaps(events, n=5, steps=1)[-1] == {
        "after": "hash",
        "before": "gpu_memcpy",
        "stretches_per_step": 1.0,
        "idle_ms_per_step": pytest.approx(0.040),
        "longest_ms": pytest.approx(0.040),
    }
