"""The parts of perf/bench_train_step.py that decide its figures: shapes, data, timing, kernel classes."""

import math

import pytest
import torch
from omegaconf.errors import ValidationError

from tests.perf_scripts import load_perf_script
from track_1_short.perf.bench_meta import REPO_ROOT
from track_1_short.schedule import ScheduleConfig, StageConfig


def load_bench():
    return load_perf_script("bench_train_step")


bench = load_bench()


def track1_schedule() -> ScheduleConfig:
    return bench.load_structured(ScheduleConfig, REPO_ROOT / "configs" / "schedule" / "track1.yaml")


def test_stage_shapes_are_the_records_per_rank_microbatches():
    stage0, stage2 = bench.stage_shapes(track1_schedule(), [0, 2], tiny=False)
    assert (stage0.tokens, stage0.windows, stage0.max_doc_len, stage0.first_step) == (16384, (1, 3), 896, 0)
    assert stage0.mtp_weights == [1.0, 0.5, 0.25]
    assert (stage2.tokens, stage2.windows, stage2.max_doc_len, stage2.first_step) == (
        49152,
        (5, 11),
        3072,
        681,
    )
    assert stage2.mtp_weights == [1.0]


def test_tiny_shapes_keep_the_stage_windows_at_a_small_size():
    (shape,) = bench.stage_shapes(track1_schedule(), [2], tiny=True)
    assert (shape.tokens, shape.max_doc_len, shape.windows) == (
        bench.TINY_TOKENS,
        bench.TINY_MAX_DOC_LEN,
        (5, 11),
    )


def test_a_stage_outside_the_schedule_is_refused():
    schedule = ScheduleConfig(stages=[StageConfig()])
    with pytest.raises(ValueError, match="stage 3 does not exist; the schedule has 1 stages"):
        bench.stage_shapes(schedule, [3], tiny=False)


def test_overrides_reach_their_group_and_are_type_checked():
    sets = bench.group_overrides(["schedule.lr_floor=0.25", "model.check_inputs=false"])
    assert sets == {"model": ["check_inputs=false"], "optim": [], "schedule": ["lr_floor=0.25"]}
    path = REPO_ROOT / "configs" / "schedule" / "track1.yaml"
    assert bench.load_structured(ScheduleConfig, path, sets["schedule"]).lr_floor == 0.25
    with pytest.raises(ValidationError, match="lr_floor"):
        bench.load_structured(ScheduleConfig, path, ["lr_floor=fast"])


@pytest.mark.parametrize("item", ["lr_floor=0.2", "data.x=1", "schedule.lr_floor"])
def test_an_override_without_group_or_value_is_refused(item):
    with pytest.raises(ValueError, match=f"--set {item}: write GROUP.KEY=VALUE"):
        bench.group_overrides([item])


def test_batch_flops_weigh_each_document_by_its_tokens():
    # A stand-in whose per-token FLOPs grow with document length, as attention's do.
    calls = []

    def flops_per_token(cfg, length, windows):
        calls.append((length, windows))
        return 100.0 + length

    cu = torch.tensor([0, 10, 40, 40, 100], dtype=torch.int32)  # lengths 10, 30, (empty), 60
    fpt = bench.batch_flops_per_token(flops_per_token, None, cu, (1, 3))
    assert fpt == pytest.approx((110 * 10 + 130 * 30 + 160 * 60) / 100)
    assert calls == [(10, [1, 3]), (30, [1, 3]), (60, [1, 3])]


def test_a_missing_config_file_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml does not exist"):
        bench.load_structured(ScheduleConfig, tmp_path / "nope.yaml")


@pytest.mark.parametrize(("tokens", "cap"), [(16384, 896), (49152, 3072), (512, 160), (7, 3)])
def test_documents_fill_the_batch_exactly_within_the_cap(tokens, cap):
    lengths = bench.document_lengths(tokens, cap, torch.Generator().manual_seed(1))
    assert sum(lengths) == tokens
    assert min(lengths) >= 1 and max(lengths) <= cap


def test_document_lengths_follow_the_capped_log_normal():
    # Log-normal, median 400, sigma 1, capped at 3072: mean 624.6 and sd 644 (numerical integration), so ~2500
    # documents give the mean to +-39 and the median to +-31 at 3 standard errors; another law falls outside.
    lengths = bench.document_lengths(49152 * 32, 3072, torch.Generator().manual_seed(0))
    mean = sum(lengths) / len(lengths)
    median = sorted(lengths)[len(lengths) // 2]
    assert abs(mean - 624.6) < 39, mean
    assert abs(median - 400) < 31, median


def test_synthetic_batch_is_shifted_whole_documents_starting_with_bos():
    (shape,) = bench.stage_shapes(track1_schedule(), [0], tiny=True)
    batches = bench.synthetic_batches(shape, vocab_size=100, bos_id=99, device="cpu", seed=3)
    assert len(batches) == bench.BATCHES_PER_STAGE
    for b in batches:
        assert (
            b.inputs.dtype == torch.int32
            and b.targets.dtype == torch.int64
            and b.cu_seqlens.dtype == torch.int32
        )
        assert b.inputs.shape == b.targets.shape == (shape.tokens,)
        assert torch.equal(b.inputs[1:].long(), b.targets[:-1])
        assert b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == shape.tokens
        assert bool((b.cu_seqlens.diff() > 0).all())
        assert bool((b.inputs[b.cu_seqlens[:-1].long()] == 99).all())
        assert int(b.inputs.max()) < 100 and int(b.inputs.min()) >= 0
        assert torch.equal(b.cu_seqlens, batches[0].cu_seqlens)  # one boundary set: one compiled graph
    assert not torch.equal(batches[0].inputs, batches[1].inputs)


def test_step_times_run_from_each_start_to_the_next():
    # marks: start, after forward, after backward per step, then a closing mark
    marks = [0.0, 2.0, 5.0, 7.0, 8.0, 11.0, 15.0]
    assert bench.step_times(marks, 2) == [(2.0, 3.0, 2.0), (1.0, 3.0, 4.0)]
    with pytest.raises(ValueError, match="expected 7 marks for 2 steps, got 6"):
        bench.step_times(marks[:-1], 2)


def test_cycle_mean_weighs_per_kind_medians_by_the_cadence():
    adam = [False, True] * 3 + [False]
    per_step = [10.0, 30.0, 11.0, 31.0, 100.0, 29.0, 12.0]  # one outlier among the steps without Adam
    assert bench.cycle_mean(per_step, adam, 2) == (30.0 + 11.5) / 2
    assert bench.cycle_mean([5.0, 7.0, 6.0], [True] * 3, 1) == 6.0
    with pytest.raises(ValueError, match="both kinds of step"):
        bench.cycle_mean([1.0, 2.0], [True, True], 2)


def test_cpu_timer_marks_are_ordered_and_start_at_zero():
    with bench.Timer(torch.device("cpu")) as timer:
        for _ in range(3):
            timer.mark()
            torch.ones(64, 64) @ torch.ones(64, 64)
    marks = timer.elapsed_ms()
    assert marks[0] == 0.0 and marks == sorted(marks) and len(marks) == 3


def test_matmul_rate_is_positive_and_finite_on_cpu():
    rate = bench.matmul_tflops(64, torch.device("cpu"), warmup=1, reps=3)
    assert rate > 0 and math.isfinite(rate)


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
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
    ],
)
def test_kernel_names_fall_into_their_class(name, kind):
    assert bench.kernel_class(name) == kind


def trace(*events):
    return [{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur} for cat, name, ts, dur in events]


def test_breakdown_counts_overlap_once_and_shares_kernel_time_by_class():
    events = trace(
        ("kernel", "sm90_xmma_gemm", 0.0, 60.0),
        ("kernel", "flash_fwd", 50.0, 20.0),  # overlaps the GEMM by 10 us (another stream)
        ("gpu_memcpy", "Memcpy DtoD", 100.0, 20.0),  # idle 70..100
        ("cpu_op", "aten::mm", 0.0, 500.0),  # host events are not device work
    )
    out = bench.kernel_breakdown(events)
    assert out["gpu_busy_pct"] == pytest.approx(100 * 90 / 120)
    assert out["gemm_pct"] == pytest.approx(100 * 60 / 100)
    assert out["attention_pct"] == pytest.approx(100 * 20 / 100)
    assert out["other_kernel_pct"] == pytest.approx(100 * 20 / 100)


def test_breakdown_of_a_trace_without_device_work_is_empty():
    assert set(bench.kernel_breakdown(trace(("cpu_op", "aten::mm", 0.0, 5.0))).values()) == {None}


def full_row(**extra) -> dict:
    row = {"stage": 2, "tokens": 49152, "ms_per_step": 80.0, "ms_per_step_floor": 40.0, "mfu_pct": 50.0,
           "tokens_per_s": 614400.0, "forward_ms": 25.0, "forward_ms_floor": 40.0 / 3, "backward_ms": 45.0,
           "backward_ms_floor": 80.0 / 3, "optimizer_ms": 10.0, "peak_memory_gib": None,
           "attention_flops_pct": 2.9}  # fmt: skip
    return {**row, **extra}


def test_stage_note_states_the_gaps_to_the_floors():
    note = bench.stage_note(full_row())
    assert note.startswith("stage 2 (49,152 tokens): 80.00 ms/step, 2.00x its floor (50.0% MFU)")
    assert "forward 25.00 ms (1.88x its floor), backward 45.00 ms (1.69x)" in note
    assert "optimizer 10.00 ms (12% of the step" in note
    assert "kernels run" not in note  # no profile, no claim about it


def test_stage_note_adds_the_kernel_breakdown_of_a_profiled_cycle():
    note = bench.stage_note(
        full_row(gpu_busy_pct=91.0, gemm_pct=70.0, attention_pct=8.0, other_kernel_pct=22.0)
    )
    assert "kernels run 91% of a profiled Adam cycle; of device time GEMMs take 70%, attention 8%" in note
    assert "(attention is 3% of the FLOPs), the rest 22%" in note


def test_printed_table_has_a_header_and_one_line_per_row(capsys):
    bench.print_table([full_row(), full_row(stage=0, tokens=16384)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == list(bench.PRINTED)
    assert len(lines) == 3 and lines[2].split()[:2] == ["0", "16384"] and lines[1].split()[-1] == "-"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--warmup", "1"], "--warmup 1 must cover an Adam cycle"),
        (["--stages", "9"], "--stages: stage 9 does not exist"),
        (["--set", "model"], "--set model: write GROUP.KEY=VALUE"),
    ],
)
def test_bad_flags_are_refused_before_any_work(flags, message, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(ValueError, match=message):
        bench.main(["perf/bench_train_step.py", "--device", "cpu", "--tiny", *flags, "--out", str(out)])
    assert not out.exists()


def test_parse_refuses_too_few_timed_steps(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--steps", "1"])
    assert "--steps >= 2" in capsys.readouterr().err
