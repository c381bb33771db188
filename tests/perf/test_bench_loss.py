"""perf/bench_loss.py on the CPU at a small shape: one row per impl, each compared with the reference."""

import json

import pytest

from perf.bench_meta import check_bench_payload
from tests.perf_scripts import load_perf_script

bench_loss = load_perf_script("bench_loss")


def test_bench_loss_writes_a_row_per_impl_compared_with_the_reference(tmp_path):
    out = tmp_path / "loss.json"
    argv = ["--out", str(out), "--device", "cpu", "--tokens", "40", "--dim", "16", "--vocab", "200"]
    assert bench_loss.main([*argv, "--chunk-rows", "16", "--warmup", "0", "--steps", "2"]) == 0
    payload = json.loads(out.read_text())
    check_bench_payload(payload, str(out))
    rows = {r["impl"]: r for r in payload["rows"]}
    assert list(rows) == ["reference", "fused"]
    ref, fused = rows["reference"], rows["fused"]
    assert ref["vs_reference"] == 1.0 and ref["loss_rel_diff"] == ref["grad_w_rel_diff"] == 0.0
    assert fused["vs_reference"] == pytest.approx(ref["ms"] / fused["ms"], rel=1e-12)
    # bf16 inputs, fp32 sums in another order: the loss agrees to a few fp32 ulps, the gradients (bf16 g
    # from the kernel, fp32 buffers in the reference) to a fraction of a bf16 ulp on average.
    assert fused["loss_rel_diff"] < 1e-5
    assert fused["grad_x_rel_diff"] < 4e-3 and fused["grad_w_rel_diff"] < 4e-3
    for r in rows.values():
        assert r["ms_min"] <= r["ms"] <= r["ms_max"] and r["ms_floor"] > 0
    assert payload["chunk_rows"] == 16 and payload["matmul_tflops_measured"] > 0


def test_bench_loss_times_the_sampled_softmax_at_each_count_against_the_full_one(tmp_path):
    out = tmp_path / "loss.json"
    argv = ["--out", str(out), "--device", "cpu", "--tokens", "40", "--dim", "16", "--vocab", "200"]
    argv += ["--chunk-rows", "16", "--warmup", "0", "--steps", "2", "--distinct", "30"]
    assert bench_loss.main([*argv, "--candidates", "0", "64", "--prefix-weight", "0.25"]) == 0
    payload = json.loads(out.read_text())
    rows = {(r["impl"], r["candidates"]): r for r in payload["rows"]}
    assert list(rows) == [("reference", 0), ("fused", 0), ("reference", 64), ("fused", 64)]
    assert payload["distinct_targets"] == 30 and payload["prefix_weight"] == 0.25
    for impl in ("reference", "fused"):
        full, sampled = rows[(impl, 0)], rows[(impl, 64)]
        assert sampled["vs_full"] == pytest.approx(full["ms"] / sampled["ms"], rel=1e-12)
        assert sampled["ms_floor"] == pytest.approx(full["ms_floor"] * 64 / 200, rel=1e-12)  # width P, not V
    # Each P against the reference at the same P (the same candidate set): the bounds of the full loss's row.
    assert rows[("reference", 64)]["loss_rel_diff"] == 0.0
    assert rows[("fused", 64)]["loss_rel_diff"] < 1e-5 and rows[("fused", 64)]["grad_w_rel_diff"] < 4e-3


def test_bench_loss_refuses_a_candidate_count_below_the_distinct_targets():
    with pytest.raises(SystemExit):
        bench_loss.parse_args(["--out", "x.json", "--distinct", "100", "--candidates", "0", "64"])
