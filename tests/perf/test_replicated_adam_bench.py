"""perf/bench_replicated_adam.py on the CPU: the record's set from the param table, both paths, agreement."""

import json

import numpy as np
import pytest
import torch

from tests.perf_scripts import load_perf_script
from track_1_short.model.config import ParamTableConfig

bench = load_perf_script("bench_replicated_adam")


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "replicated_adam.json"
    assert bench.main(["--device", "cpu", "--reps", "2", "--warmup", "0", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_tensor_set_is_the_record_models_replicated_parameters_with_its_table_entries():
    spec = bench.record_set()
    labels = [label for label, *_ in spec]
    assert "mudd_w1" in labels and "scalars" in labels and "lm_head" not in labels and "qk_bank" not in labels
    table = ParamTableConfig()
    for label, _, _, entry in spec:
        hyper = getattr(table, label.lstrip("_"))
        assert entry["adam_betas"] == list(hyper.betas) and entry["lr_mul"] == hyper.lr_mul, label
        assert entry["wd_mul"] == hyper.wd_mul, label
    dtypes = {label: dtype for label, _, dtype, _ in spec}
    assert dtypes["scalars"] == torch.float32 and dtypes["mudd_w1"] == torch.bfloat16


def test_bench_writes_one_row_per_path_with_provenance(bench_result):
    for key in ("command", "date", "device", "torch", "triton", "rows"):
        assert key in bench_result
    assert [r["path"] for r in bench_result["rows"]] == list(bench.PATHS)
    assert len({r["tensors"] for r in bench_result["rows"]}) == 1


def test_the_fused_path_ends_bitwise_equal_to_the_per_parameter_path(bench_result):
    assert all(r["bitwise"] is True for r in bench_result["rows"])


def test_every_median_lies_in_its_interval_and_the_cpu_has_no_device_time(bench_result):
    for row in bench_result["rows"]:
        low, high = row["host_us_ci"]
        assert 0 < low <= row["host_us"] <= high, row
        assert row["device_us"] is None and row["device_us_ci"] is None


def test_median_ci_brackets_the_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(0)
    few = list(np.random.default_rng(1).normal(100.0, 10.0, 8))
    many = list(np.random.default_rng(1).normal(100.0, 10.0, 800))
    m_few, ci_few = bench.median_ci(few, rng)
    m_many, ci_many = bench.median_ci(many, rng)
    assert ci_few[0] <= m_few <= ci_few[1] and ci_many[0] <= m_many <= ci_many[1]
    assert ci_many[1] - ci_many[0] < ci_few[1] - ci_few[0]


def test_a_path_that_differs_is_reported_not_bitwise_and_fails_the_run(monkeypatch, tmp_path):
    # The check can fail: a fused path whose step moves one parameter once more is caught.
    original = bench.Fused.step

    def off_by_one(self):
        original(self)
        with torch.no_grad():
            self.params[0].add_(1.0)

    monkeypatch.setattr(bench.Fused, "step", off_by_one)
    out = tmp_path / "ra.json"
    assert bench.main(["--device", "cpu", "--reps", "2", "--warmup", "0", "--out", str(out)]) == 1
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["per_param"]["bitwise"] is True and rows["fused"]["bitwise"] is False
