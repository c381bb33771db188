"""perf/bench_mlp.py on the CPU at a small shape (the kernels interpreted): a row per impl and pass, each
compared with the reference."""

import json

import pytest

from perf.bench_meta import check_bench_payload
from tests.call_counts import count_calls
from tests.perf_scripts import load_perf_script

bench_mlp = load_perf_script("bench_mlp")


def test_bench_mlp_writes_a_row_per_impl_and_pass_compared_with_the_reference(tmp_path, monkeypatch):
    from track_1_short.perf.kernels import relu2_mlp as kernels

    calls = count_calls(monkeypatch, kernels, ("relu2_up", "relu2_up_grad"))
    out = tmp_path / "mlp.json"
    argv = ["--out", str(out), "--device", "cpu", "--tokens", "160", "--dim", "80", "--hidden", "272"]
    assert bench_mlp.main([*argv, "--warmup", "0", "--steps", "1"]) == 0
    payload = json.loads(out.read_text())
    check_bench_payload(payload, str(out))
    assert calls["relu2_up"] >= 4 and calls["relu2_up_grad"] >= 2  # the triton rows ran the kernels
    rows = {(r["impl"], r["pass"]): r for r in payload["rows"]}
    passes = ["train", "forward", "up", "up_grad"]
    bf16_rows = [(impl, p) for impl in ("reference", "triton") for p in passes]
    assert list(rows) == [*bf16_rows, ("fp8_scaled_mm", "train"), ("fp8_triton", "train")]
    flops = payload["matmul_tflops_measured"] * 1e12
    for (_, p), r in rows.items():
        assert r["vs_reference"] == pytest.approx(rows[("reference", p)]["ms"] / r["ms"], rel=1e-12)
        gemms = {"train": 6, "forward": 2}.get(p, 1)  # GEMMs of 2 T D hidden FLOPs each in the pass
        assert r["ms_floor"] == pytest.approx(gemms * 2 * 160 * 80 * 272 / flops * 1e3, rel=1e-12)
    ref, fused = rows[("reference", "train")], rows[("triton", "train")]
    assert ref["out_rel_diff"] == ref["grad_x_rel_diff"] == 0.0
    # random bf16 operands: the GEMMs' bf16 outputs differ by an ulp at most where the summation order
    # decides a rounding, which carries through a GEMM to about bf16's 2^-9 relative in norm
    for key in ("out", "grad_x", "grad_c_fc", "grad_c_proj"):
        assert fused[f"{key}_rel_diff"] < 4e-3, key
    # the FP8 rows: within FP8's error of the bf16 MLP (tests/model/test_fp8.py: under 2^-3 forward, 2^-2
    # backward in norm), and the two FP8 impls within each other's (their GEMMs' sums agree here)
    fp8_rows = rows[("fp8_scaled_mm", "train")], rows[("fp8_triton", "train")]
    for r in fp8_rows:
        assert 0 < r["out_rel_diff"] < 2.0**-3 and 0 < r["grad_x_rel_diff"] < 2.0**-2
    assert fp8_rows[0]["grad_c_fc_rel_diff"] == fp8_rows[1]["grad_c_fc_rel_diff"]
    assert payload["dim"] == 80 and payload["hidden"] == 272
