"""perf/bench_cascade_products.py: runs on the CPU (small banks), times the routes' own functions, and
writes a result perf/results.py can render."""

from __future__ import annotations

import pytest

from tests.perf_scripts import load_perf_script, run_perf_script
from track_1_short.optim import polar_express


def run_small(tmp_path, *flags) -> dict:
    args = ["--device", "cpu", "--steps", "1", "--warmup", "0", "--matmul-size", "64", *flags]
    return run_perf_script("bench_cascade_products", tmp_path / "products.json", *args)


def test_every_bank_gets_every_product_of_a_round_with_a_floor(tmp_path):
    run = run_small(tmp_path)
    rows = run["rows"]
    banks = list(load_perf_script("bench_optimizer").SMALL_BANKS)
    # On the CPU: torch's implementations only (bf16_div is the GPU's).
    expected = [
        ("gram", "bmm"),
        ("poly", "baddbmm"),
        ("poly", "square"),
        ("apply", "baddbmm"),
        ("apply", "bmm"),
        ("normalise", "torch.div"),
        *(("cascade", route) for route in ("bmm", "squared", "gram_space")),
    ]
    assert [(r["bank"], r["product"], r["impl"]) for r in rows] == [
        (b, p, i) for b in banks for p, i in expected
    ]
    seen = set()
    for row in rows:
        assert row["us"] > 0 and row["us_floor"] > 0
        assert (row["tflops"] is None) == (row["product"] == "normalise")
        if row["product"] == "cascade":  # the route's own matmuls: fewer for gram_space on a long matrix
            batch, r, c = (int(v) for v in row["matrices"].split(" x "))
            assert row["us_floor"] * run["matmul_tflops"] * 1e6 == pytest.approx(
                polar_express.cascade_flops(batch, r, c, row["impl"])
            )
        group = (row["bank"], row["product"])
        if group not in seen:  # a product's first implementation is its own reference
            assert row["bitwise_first"] is True and row["vs_first"] == 1.0
            seen.add(group)
        if row["impl"] == "square" or (row["product"] == "cascade" and row["impl"] != "bmm"):
            assert row["bitwise_first"] is None  # another matrix, or a cascade that rounds differently


def test_the_rows_time_the_functions_the_routes_call(tmp_path, monkeypatch):
    # One code path: the bench calls polar_express's own helpers, so a route's change is what it measures.
    seen = []
    for name in ("_gram", "_poly", "_squared_poly", "_apply", "_apply_linear", "_gram_space"):
        real = getattr(polar_express, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(polar_express, name, spy)
    run_small(tmp_path, "--shapes", "small")
    assert {"_gram", "_poly", "_squared_poly", "_apply", "_apply_linear", "_gram_space"} <= set(seen)
