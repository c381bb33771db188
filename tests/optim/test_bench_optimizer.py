"""perf/bench_optimizer.py runs on the CPU (small banks) and writes a result perf/results.py can render."""

from __future__ import annotations

from tests.perf_scripts import load_perf_script, run_perf_script
from track_1_short.optim.polar_express import cascade_flops


def load_bench():
    return load_perf_script("bench_optimizer")


def run_small(bench, tmp_path, *flags) -> dict:
    """bench_optimizer on the CPU, one timed step per arm and no warmup; its JSON, read back and checked."""
    args = ["--device", "cpu", "--steps", "1", "--warmup", "0", "--matmul-size", "128", *flags]
    return run_perf_script("bench_optimizer", tmp_path / "optimizer.json", *args)


def test_bench_runs_small_on_the_cpu_and_writes_rows_with_floors(tmp_path, capsys):
    bench = load_bench()
    rows = run_small(bench, tmp_path, "--shapes", "small")["rows"]
    assert [r["bank"] for r in rows[:-1]] == list(bench.SMALL_BANKS)
    for row in rows:
        for key in ("step_ms", "cascade_ms", "cascade_ms_floor", "rest_ms_floor"):
            assert row[key] > 0, (row["bank"], key)
        assert abs(row["rest_ms"] - (row["step_ms"] - row["cascade_ms"])) < 1e-9
    # The FLOP count is the cascade's on each bank's whole reshape (world size 1: one chunk).
    expected = sum(cascade_flops(*reshape) for _, reshape, _ in bench.SMALL_BANKS.values())
    assert abs(rows[-1]["cascade_gflop"] - expected / 1e9) < 1e-9
    assert "cascade" in capsys.readouterr().out


def test_both_cascade_gram_arms_are_measured_in_one_run(tmp_path):
    # Each arm builds the optimizer with its optim.cascade_gram, so its banks' updates take that route; only
    # the structure is checked here.
    import torch

    bench = load_bench()
    _, opt, _ = bench.build(bench.SMALL_BANKS, torch.device("cpu"), "eager", "squared")
    assert all(b.constants["gram"] == "squared" for b in opt.banks.values())
    payload = run_small(bench, tmp_path, "--cascade-gram", "bmm", "squared")
    assert payload["cascade_gram"] == ["bmm", "squared"]
    rows = payload["rows"]
    per_arm = len(bench.SMALL_BANKS) + 1
    assert [r["cascade_gram"] for r in rows] == ["bmm"] * per_arm + ["squared"] * per_arm
    for bmm, squared in zip(rows[:per_arm], rows[per_arm:], strict=True):
        assert bmm["bank"] == squared["bank"] and bmm["vs_bmm"] == 1.0
        assert abs(squared["vs_bmm"] - bmm["step_ms"] / squared["step_ms"]) < 1e-12
        assert squared["vs_eager"] == 1.0  # the eager arm of its own Gram route
        assert squared["cascade_ms"] > 0
    # Both arms render as one table (a triton arm's compile_s column: tests/test_perf_results.py).
    from tests.perf_scripts import load_perf_script as load

    text = "\n".join(load("results").render_section("perf/results/optimizer.json", payload))
    assert "| bank | bank_update |" in text and "vs_bmm" in text and text.count("| squared |") == per_arm


def test_the_bank_graphs_arm_is_refused_on_the_cpu_and_paired_with_the_ungraphed_one(tmp_path, capsys):
    import pytest

    bench = load_bench()
    with pytest.raises(SystemExit):
        run_small(bench, tmp_path, "--bank-graphs", "off", "on")
    assert "--bank-graphs on needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "optimizer.json").exists()
    # vs_ungraphed pairs each graphed row with the ungraphed row of the same bank, update and Gram route.
    rows = [
        {"bank": b, "bank_update": u, "cascade_gram": "bmm", "bank_graphs": g, "step_ms": ms}
        for b, u, g, ms in [
            ("qk", "eager", False, 4.0),
            ("qk", "triton", False, 3.0),
            ("qk", "eager", True, 2.0),
            ("qk", "triton", True, 1.0),
        ]
    ]
    bench.add_vs_eager(rows)
    assert [r["vs_ungraphed"] for r in rows] == [1.0, 1.0, 2.0, 3.0]
    assert [r["vs_eager"] for r in rows] == [1.0, 4.0 / 3.0, 1.0, 2.0]
    assert all("vs_bmm" not in r for r in rows)


def test_top_kernels_is_refused_on_the_cpu_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    import pytest

    bench = load_bench()
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("measured before the check"))
    with pytest.raises(SystemExit):
        run_small(bench, tmp_path, "--top-kernels", "5")
    assert "--top-kernels profiles CUDA kernels" in capsys.readouterr().err


def test_the_bank_streams_arm_is_refused_on_the_cpu_and_paired_with_the_serial_one(tmp_path, capsys):
    import pytest

    bench = load_bench()
    with pytest.raises(SystemExit):
        run_small(bench, tmp_path, "--bank-streams", "off", "on")
    assert "--bank-streams on needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "optimizer.json").exists()
    # vs_serial pairs each streamed row with the serial row of the same bank, update, Gram route and graphs.
    rows = [
        {
            "bank": "all",
            "bank_update": "triton",
            "cascade_gram": "squared",
            "bank_graphs": g,
            "bank_streams": s,
            "step_ms": ms,
        }
        for g, s, ms in [(False, False, 4.0), (False, True, 2.0), (True, False, 3.0), (True, True, 1.0)]
    ]
    bench.add_vs_eager(rows)
    assert [r["vs_serial"] for r in rows] == [1.0, 2.0, 1.0, 3.0]
    assert [r["vs_ungraphed"] for r in rows] == [1.0, 1.0, 4.0 / 3.0, 2.0]
