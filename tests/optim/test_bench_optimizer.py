"""perf/bench_optimizer.py runs on the CPU (small banks) and writes a result perf/results.py can render."""

from __future__ import annotations

import json

from tests.perf_scripts import load_perf_script
from track_1_short.optim.polar_express import cascade_flops
from track_1_short.perf.bench_meta import check_bench_payload


def load_bench():
    return load_perf_script("bench_optimizer")


def test_bench_runs_small_on_the_cpu_and_writes_rows_with_floors(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "optimizer.json"
    args = ["--device", "cpu", "--shapes", "small", "--steps", "1", "--warmup", "0", "--matmul-size", "128"]
    assert bench.main([*args, "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    check_bench_payload(payload, str(out))
    rows = payload["rows"]
    assert [r["bank"] for r in rows[:-1]] == list(bench.SMALL_BANKS)
    for row in rows:
        for key in ("step_ms", "cascade_ms", "cascade_ms_floor", "rest_ms_floor"):
            assert row[key] > 0, (row["bank"], key)
        assert abs(row["rest_ms"] - (row["step_ms"] - row["cascade_ms"])) < 1e-9
    # The FLOP count is the cascade's on each bank's whole reshape (world size 1: one chunk).
    expected = sum(cascade_flops(*reshape) for _, reshape, _ in bench.SMALL_BANKS.values())
    assert abs(rows[-1]["cascade_gflop"] - expected / 1e9) < 1e-9
    assert "cascade" in capsys.readouterr().out
