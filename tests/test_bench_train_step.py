"""The parts of perf/bench_train_step.py that decide its figures: shapes, data, timing, kernel classes."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from tests.perf_scripts import load_perf_script


def load_bench():
    return load_perf_script("bench_train_step")


bench = load_bench()


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


def test_the_timed_batches_count_as_one_batch_of_all_their_documents():
    seen = []
    batches = iter([torch.tensor([0, 5, 9], dtype=torch.int32), torch.tensor([0, 2, 9], dtype=torch.int32)])
    record = bench.recording_boundaries(lambda: SimpleNamespace(cu_seqlens=next(batches)), seen)
    record(), record()
    joined = bench.joined_boundaries(seen)
    assert joined.tolist() == [0, 5, 9, 11, 18]  # lengths 5, 4, 2, 7
    # The FLOPs of the joined batch weigh each of the four documents by its own length.
    fpt = bench.batch_flops_per_token(lambda cfg, n, w: 100.0 + n, None, joined, (1, 3))
    assert fpt == pytest.approx((105 * 5 + 104 * 4 + 102 * 2 + 107 * 7) / 18)


def test_step_times_run_from_each_start_to_the_next_and_add_up_microbatches():
    # step 1: one microbatch; step 2: two (forward, backward, forward, backward); then the closing start.
    labels = ["start", "forward", "backward", "start", "forward", "backward", "forward", "backward", "start"]
    marks = [0.0, 2.0, 5.0, 7.0, 8.0, 11.0, 12.0, 14.0, 15.0]
    assert bench.step_times(labels, marks, 2) == [(2.0, 3.0, 2.0), (1.0 + 1.0, 3.0 + 2.0, 1.0)]
    with pytest.raises(ValueError, match="expected 2 steps of labelled marks"):
        bench.step_times(labels[:-1], marks[:-1], 2)
    with pytest.raises(ValueError, match="must end with its last backward"):
        bench.step_times(["start", "backward", "forward", "start"], [0.0, 1.0, 2.0, 3.0], 1)


def test_cycle_mean_weighs_per_kind_medians_by_the_cadence():
    adam = [False, True] * 3 + [False]
    per_step = [10.0, 30.0, 11.0, 31.0, 100.0, 29.0, 12.0]  # one outlier among the steps without Adam
    assert bench.cycle_mean(per_step, adam, 2) == (30.0 + 11.5) / 2
    assert bench.cycle_mean([5.0, 7.0, 6.0], [True] * 3, 1) == 6.0
    with pytest.raises(ValueError, match="both kinds of step"):
        bench.cycle_mean([1.0, 2.0], [True, True], 2)


def test_cpu_timer_marks_are_ordered_and_start_at_zero():
    with bench.Timer(torch.device("cpu")) as timer:
        for label in ("start", "forward", "backward"):
            timer.mark(label)
            torch.ones(64, 64) @ torch.ones(64, 64)
    marks = timer.elapsed_ms()
    assert marks[0] == 0.0 and marks == sorted(marks) and len(marks) == 3
    assert timer.labels == ["start", "forward", "backward"]


def test_matmul_rate_is_positive_and_finite_on_cpu():
    rate = bench.matmul_tflops(64, torch.device("cpu"), warmup=1, reps=3)
    assert rate > 0 and math.isfinite(rate)


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
        (["--warmup", "2", "--steps", "200"], "must fit in it"),
    ],
)
def test_bad_flags_are_refused_before_any_work(flags, message, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(ValueError, match=message):
        bench.main(["perf/bench_train_step.py", "--device", "cpu", "--tiny", *flags, "--out", str(out)])
    assert not out.exists()


def test_the_bench_composes_the_training_config_with_its_preset_first():
    args = bench.parse_args(["--device", "cpu", "--tiny", "seed=3"])
    assert args.overrides == [f"experiment={bench.TINY_EXPERIMENT}", "seed=3"]
    assert bench.parse_args(["--device", "cpu", "experiment=default"]).overrides == ["experiment=default"]
    cfg = bench.compose(args.overrides, "cpu", "/tmp/runs")
    assert (cfg.seed, cfg.device, cfg.progress_bar, cfg.model.num_layers) == (3, "cpu", False, 8)


def test_parse_refuses_too_few_timed_steps(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--steps", "1"])
    assert "--steps >= 2" in capsys.readouterr().err


def test_a_row_restated_at_a_higher_rate_has_lower_mfu_and_floors_and_nothing_else_moves():
    row = {"mfu_pct": 50.0, "matmul_tflops": 750.0, "ms_per_step": 600.0, "ms_per_step_floor": 300.0,
           "forward_ms_floor": 100.0, "backward_ms_floor": 200.0, "tokens_per_s": 6e5}  # fmt: skip
    out = bench.at_rate(row, 800.0)
    assert out["matmul_tflops"] == 800.0
    assert out["mfu_pct"] == 50.0 * 750.0 / 800.0  # MFU is inversely proportional to the rate
    assert (out["ms_per_step_floor"], out["forward_ms_floor"], out["backward_ms_floor"]) == (
        300.0 * 750.0 / 800.0,
        100.0 * 750.0 / 800.0,
        200.0 * 750.0 / 800.0,
    )
    assert out["ms_per_step"] == 600.0 and out["tokens_per_s"] == 6e5
    assert row["mfu_pct"] == 50.0  # the input row is left as it was


@pytest.mark.parametrize(
    ("arm", "message"),
    [
        (
            "optim.replicated_impl=reference",
            "write NAME=",
        ),  # no name: a name has no dots, so this is not "name=overrides"
        ("mlp=", "write NAME="),
        ("a b=optim.replicated_impl=reference", "write NAME="),
        ("baseline=seed=3", "must differ"),
    ],
)
def test_parse_refuses_a_malformed_or_clashing_arm(arm, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--tiny", "--arm", arm])
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # two arms of one name
        bench.parse_args(["--device", "cpu", "--tiny", "--arm", "x=seed=1", "--arm", "x=seed=2"])


def test_an_arm_adds_its_overrides_after_the_baselines():
    args = bench.parse_args(
        ["--device", "cpu", "--tiny", "seed=3", "--arm", "ref=optim.replicated_impl=reference seed=4"]
    )
    assert args.arms == [("ref", ["optim.replicated_impl=reference", "seed=4"])]


def test_a_bad_arm_fails_before_anything_is_measured(tmp_path, capsys):
    from hydra.errors import ConfigCompositionException

    out = tmp_path / "r.json"
    argv = ["perf/bench_train_step.py", "--device", "cpu", "--tiny", "--out", str(out)]
    with pytest.raises(ConfigCompositionException, match="model.no_such_field"):
        bench.main([*argv, "--arm", "bad=model.no_such_field=1"])
    with pytest.raises(ValueError, match=r"optim.adam_every=4 \(arm slow\)"):
        bench.main([*argv, "--warmup", "2", "--arm", "slow=optim.adam_every=4"])
    assert not out.exists() and "bf16 matmul" not in capsys.readouterr().out  # nothing was timed


def test_vs_baseline_is_each_arms_tokens_per_s_over_the_baselines_at_its_stage():
    rows = [
        {"arm": "baseline", "stage": 0, "tokens_per_s": 100.0},
        {"arm": "baseline", "stage": 2, "tokens_per_s": 50.0},
        {"arm": "mlp", "stage": 0, "tokens_per_s": 110.0},
        {"arm": "mlp", "stage": 2, "tokens_per_s": 40.0},
    ]
    bench.add_vs_baseline(rows)
    assert [r.get("vs_baseline") for r in rows] == [None, None, 1.1, 0.8]


def test_arms_run_one_after_another_and_name_their_rows(tmp_path):
    out = tmp_path / "arms.json"
    argv = ["perf/bench_train_step.py", "--device", "cpu", "--tiny", "--no-profile", "--out", str(out)]
    payload = bench.main([*argv, "--arm", "ref=optim.replicated_impl=reference"])
    saved = json.loads(out.read_text())
    assert [(r["arm"], r["stage"]) for r in saved["rows"]] == [("baseline", 0), ("ref", 0)]
    base, ref = saved["rows"]
    assert "vs_baseline" not in base
    assert ref["vs_baseline"] == pytest.approx(ref["tokens_per_s"] / base["tokens_per_s"], rel=1e-12)
    assert saved["arms"] == {"ref": ["optim.replicated_impl=reference"]}
    assert "arm ref: optim.replicated_impl=reference" in saved["title"]
    assert payload["notes"][1].startswith("ref: stage 0")


def test_kernel_tables_are_titled_by_arm_and_stage():
    assert bench.table_title({"stage": 2}).startswith("stage 2: the costliest kernels")
    assert bench.table_title({"arm": "mlp", "stage": 2}).startswith("mlp, stage 2: the costliest kernels")
    assert bench.table_title({"arm": "mlp", "stage": 2}, idle=True).startswith(
        "mlp, stage 2: where the device idled"
    )


def test_a_failing_arm_becomes_a_row_with_its_error_and_the_next_arm_still_runs(tmp_path, monkeypatch):
    measure_arm = bench.measure_arm

    def failing(trainer, args, rate, arm):
        if arm == "boom":
            raise RuntimeError("the kernel did not launch")
        return measure_arm(trainer, args, rate, arm)

    monkeypatch.setattr(bench, "measure_arm", failing)
    out = tmp_path / "arms.json"
    argv = ["perf/bench_train_step.py", "--device", "cpu", "--tiny", "--no-profile", "--out", str(out)]
    bench.main([*argv, "--arm", "boom=seed=5", "--arm", "ok=seed=6"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["arm"] for r in rows] == ["baseline", "boom", "ok"]
    assert rows[1] == {"arm": "boom", "error": "RuntimeError: the kernel did not launch"}
    assert rows[2]["vs_baseline"] > 0
    with pytest.raises(RuntimeError, match="did not launch"):  # a failing baseline stops the bench
        monkeypatch.setattr(bench, "measure_arm", lambda *a: failing(*a[:3], "boom"))
        bench.main([*argv, "--arm", "ok=seed=6"])


def test_a_device_broken_by_a_failing_arm_still_leaves_the_rows_measured_before(tmp_path, monkeypatch):
    measure_arm, probe = bench.measure_arm, bench.matmul_tflops
    probes = []

    def failing(trainer, args, rate, arm):
        if arm == "boom":
            raise RuntimeError("an illegal memory access was encountered")
        return measure_arm(trainer, args, rate, arm)

    def flaky_probe(*a, **k):  # the second probe runs on the device the arm broke
        probes.append(1)
        if len(probes) > 1:
            raise RuntimeError("an illegal memory access was encountered")
        return probe(*a, **k)

    monkeypatch.setattr(bench, "measure_arm", failing)
    monkeypatch.setattr(bench, "matmul_tflops", flaky_probe)
    out = tmp_path / "arms.json"
    argv = ["perf/bench_train_step.py", "--device", "cpu", "--tiny", "--no-profile", "--out", str(out)]
    bench.main([*argv, "--arm", "boom=seed=5"])
    saved = json.loads(out.read_text())
    assert [r["arm"] for r in saved["rows"]] == ["baseline", "boom"]
    assert saved["matmul_tflops_probes"][0] == saved["matmul_tflops_probes"][1]  # the first, twice


def test_the_timed_batches_are_the_timed_steps_own_though_the_table_reads_them_ahead(tmp_path):
    """With the n-gram table a cycle's batches are read at the previous cycle's last step, so a step may use
    batches read before its timing began: the figures still count exactly the timed steps' documents."""
    from omegaconf import OmegaConf

    from track_1_short import distributed
    from track_1_short.config import to_object
    from track_1_short.trainer import Trainer

    cfg = bench.compose(["experiment=smoke_record"], "cpu", str(tmp_path))
    tcfg = to_object(cfg)
    assert tcfg.model.ngram.enabled
    trainer = Trainer(tcfg, OmegaConf.to_container(cfg, resolve=True), distributed.init("cpu"))
    used: dict[int, list] = {}
    real = trainer.ngram.batches

    def batches(step):
        got = real(step)
        used[step] = [b.cu_seqlens for b, _ in got]
        return got

    trainer.ngram.batches = batches
    try:
        row = bench.measure_stage(trainer, 0, warmup=2, steps=2, matmul_rate=1.0, profile=False)
        trainer.train_step(4)  # the step after the timed ones, for the check below
    finally:
        trainer.loader.close()
        trainer.log.close()
    docs = [sum(len(cu) - 1 for cu in used[s]) for s in range(5)]
    assert docs[2] + docs[3] != docs[3] + docs[4]  # a batch off by a step would show
    assert row["docs_per_step"] == (docs[2] + docs[3]) / 2
