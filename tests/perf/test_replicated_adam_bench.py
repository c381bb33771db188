"""perf/bench_replicated_adam.py on the CPU: it runs every path, counts launches, checks the paths agree."""

import json

import pytest

from tests.perf_scripts import load_perf_script


def _load_bench():
    return load_perf_script("bench_replicated_adam")


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    bench = _load_bench()
    out = tmp_path_factory.mktemp("bench") / "replicated_adam.json"
    paths = ",".join(bench.PATHS)
    argv = ["--device", "cpu", "--sets", "synthetic", "--paths", paths, "--steps", "2", "--warmup", "1"]
    assert bench.main([*argv, "--profile-steps", "1", "--out", str(out)]) == 0
    return bench, json.loads(out.read_text())


def test_bench_writes_one_row_per_path_with_provenance(bench_result):
    bench, payload = bench_result
    for key in ("command", "date", "device", "torch", "triton", "rows"):
        assert key in payload
    assert [r["path"] for r in payload["rows"]] == list(bench.PATHS)
    assert all(r["set"] == "synthetic" and r["tensors"] == 100 for r in payload["rows"])


def test_fused_paths_are_bitwise_equal_to_the_per_parameter_path(bench_result):
    _, payload = bench_result
    rows = {r["path"]: r for r in payload["rows"]}
    assert rows["per_param"]["bitwise"] is True
    assert all(r["bitwise"] is True for name, r in rows.items() if name not in ("per_param", "torch_adam"))
    assert rows["torch_adam"]["bitwise"] is None


def test_fused_launches_are_counted_and_far_fewer_than_per_parameter(bench_result):
    _, payload = bench_result
    rows = {r["path"]: r for r in payload["rows"]}
    # Counted from the profiler (aten ops) plus the Triton launches: a hundred tensors cost the per-parameter
    # path hundreds of ops; the fused path a copy, a table upload and a kernel per dtype.
    assert rows["per_param"]["launches"] >= 100 * 5
    assert 2 <= rows["fused"]["launches"] <= 4 * 2
    # The device mode: one table upload, the table kernel and one Adam kernel for every dtype.
    assert 2 <= rows["device"]["launches"] <= rows["fused"]["launches"]
