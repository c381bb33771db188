"""perf/run_summary.py: a run directory's per-stage figures, from events written by hand."""

import json

import pytest
from omegaconf import OmegaConf

from tests.perf_scripts import load_perf_script
from track_1_short.model.config import ModelConfig
from track_1_short.schedule import ScheduleConfig, StageConfig

summary = load_perf_script("run_summary")


def write_run(tmp_path, train_events):
    sched = ScheduleConfig(
        stages=[StageConfig(steps=4, batch_tokens=100), StageConfig(steps=4, batch_tokens=300)],
        rail_warmup_steps=1,
        rail_cooldown_steps=1,
    )
    (tmp_path / "config.yaml").write_text(
        OmegaConf.to_yaml({"schedule": OmegaConf.structured(sched), "model": {}})
    )
    (tmp_path / "env.json").write_text(
        json.dumps({"torch": "t", "triton": "r", "devices": [{"name": "gpu"}]})
    )
    events = [{"event": "start", "total_steps": 8}]
    events += [{"event": "train", **e} for e in train_events]
    events += [{"event": "end", "status": "finished", "val_loss": 1.5, "train_time_ms": 999.0, "graphs": 3}]
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")


def test_stage_throughput_uses_only_intervals_inside_the_stage(tmp_path):
    # Logged every 2 steps: 0-2 and 2-4 lie in stage 0 (100 tokens a step), 4-6 and 6-8 in stage 1 (300).
    # Stage 0 steps take 10 ms, stage 1 steps 20 ms, except the 2-4 interval, which is slowed to 40 ms.
    steps = [(2, 200, 20.0), (4, 400, 60.0), (6, 1000, 100.0), (8, 1600, 140.0)]
    write_run(
        tmp_path, [{"step": s, "tokens_seen": t, "train_time_ms": ms, "loss": 1.0} for s, t, ms in steps]
    )
    out = summary.summarize(tmp_path, "cmd", "2026-01-01", 100.0, None)
    rows = {r["stage"]: r for r in out["rows"]}
    # Only intervals between two logged steps count (0-2 has no earlier event): 2-4 for stage 0.
    assert rows[0]["tokens_per_s"] == pytest.approx(200 / 0.040)
    assert rows[0]["ms_per_step"] == pytest.approx(20.0)
    # Stage 1: 4-6 and 6-8, 1200 tokens in 80 ms; the interval 2-4 -> 4 ends at the boundary, not past it.
    assert rows[1]["tokens_per_s"] == pytest.approx(1200 / 0.080)
    assert rows[1]["ms_per_step"] == pytest.approx(20.0)
    assert out["graphs"] == 3 and out["status"] == "finished" and out["device"] == "gpu"


def test_an_interval_crossing_a_stage_boundary_is_left_out(tmp_path):
    steps = [(1, 100, 10.0), (3, 300, 30.0), (5, 900, 1000.0), (7, 1500, 1040.0)]  # 3-5 crosses step 4
    write_run(
        tmp_path, [{"step": s, "tokens_seen": t, "train_time_ms": ms, "loss": 1.0} for s, t, ms in steps]
    )
    rows = {r["stage"]: r for r in summary.summarize(tmp_path, "cmd", "d", 100.0, None)["rows"]}
    assert rows[0]["tokens_per_s"] == pytest.approx(200 / 0.020)
    assert rows[1]["tokens_per_s"] == pytest.approx(600 / 0.040)  # not slowed by the crossing interval


def test_the_runs_own_summary_supplies_the_reference_lines(tmp_path):
    steps = [(2, 200, 20.0), (4, 400, 40.0)]
    write_run(
        tmp_path, [{"step": s, "tokens_seen": t, "train_time_ms": ms, "loss": 1.0} for s, t, ms in steps]
    )
    refs = {"corpus entropy floor (perfect model)": 0.9154}
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": "summary", "tokens_per_s": 1e4, "references": refs}) + "\n")
    out = summary.summarize(tmp_path, "cmd", "d", 100.0, None)
    assert out["notes"][-1] == "final val loss 1.5000 against corpus entropy floor (perfect model) 0.9154"
    assert out["tokens_per_s_overall"] == 1e4


@pytest.mark.parametrize(
    ("field", "share"),
    [
        ("optimizer_ms", "optimizer_pct"),
        ("ngram_pull_ms", "ngram_pull_pct"),
        ("ngram_update_ms", "ngram_update_pct"),
        ("ngram_fold_ms", "ngram_fold_pct"),
        ("tail_ms", "tail_pct"),
    ],
)
def test_a_timed_parts_share_is_its_time_over_the_same_intervals_and_absent_for_runs_without_it(
    tmp_path, field, share
):
    # Stage 0: interval 2-4 (40 ms, 10 of them the part's); stage 1: 4-6 and 6-8 (80 ms, 6 + 14 the part's).
    # The first event's time (its interval has no earlier event) is left out with its interval.
    steps = [(2, 200, 20.0, 99.0), (4, 400, 60.0, 10.0), (6, 1000, 100.0, 6.0), (8, 1600, 140.0, 14.0)]
    events = [
        {"step": s, "tokens_seen": t, "train_time_ms": ms, "loss": 1.0, field: o} for s, t, ms, o in steps
    ]
    write_run(tmp_path, events)
    rows = {r["stage"]: r for r in summary.summarize(tmp_path, "cmd", "d", 100.0, None)["rows"]}
    assert rows[0][share] == pytest.approx(100 * 10 / 40)
    assert rows[1][share] == pytest.approx(100 * 20 / 80)
    del events[2][field]  # a run logged before the trainer timed this part (or without the n-gram table)
    write_run(tmp_path, events)
    rows = {r["stage"]: r for r in summary.summarize(tmp_path, "cmd", "d", 100.0, None)["rows"]}
    assert rows[0][share] == pytest.approx(25.0) and rows[1][share] is None


def test_the_ngram_pull_and_update_per_step_stand_beside_the_floor_of_the_rows_they_moved(tmp_path):
    # Stage 1 (300 tokens a step): intervals 4-6 and 6-8, four steps. Pulls of 1,000 and 3,000 rows in 6 and
    # 14 ms, one update of 2,000 rows in 8 ms. At 1,000 GB/s a row costs 8 bytes a table channel either way.
    steps = [
        (2, 200, 20.0, 0, 0.0),
        (4, 400, 60.0, 0, 0.0),
        (6, 1000, 100.0, 1000, 6.0),
        (8, 1600, 140.0, 3000, 14.0),
    ]
    events = [
        {"step": s, "tokens_seen": t, "train_time_ms": ms, "loss": 1.0, "ngram_pull_rows": rows,
         "ngram_pull_ms": pull, "ngram_update_rows": 2000 if s == 8 else 0,
         "ngram_update_ms": 8.0 if s == 8 else 0.0}
        for s, t, ms, rows, pull in steps
    ]  # fmt: skip
    write_run(tmp_path, events)
    rows = {
        r["stage"]: r for r in summary.summarize(tmp_path, "cmd", "d", 100.0, None, hbm_gbps=1000.0)["rows"]
    }
    dim = ModelConfig().ngram.dim
    assert rows[1]["ngram_pull_ms_per_step"] == pytest.approx(20.0 / 4)
    assert rows[1]["ngram_pull_ms_per_step_floor"] == pytest.approx(4000 * 8 * dim / 1e12 * 1e3 / 4)
    assert rows[1]["ngram_update_ms_per_step"] == pytest.approx(8.0 / 4)
    assert rows[1]["ngram_update_ms_per_step_floor"] == pytest.approx(2000 * 8 * dim / 1e12 * 1e3 / 4)
    del events[3]["ngram_pull_rows"]  # a run logged before the rows were counted: no floor, no figure
    write_run(tmp_path, events)
    rows = {r["stage"]: r for r in summary.summarize(tmp_path, "cmd", "d", 100.0, None)["rows"]}
    assert "ngram_pull_ms_per_step" not in rows[1] and "ngram_update_ms_per_step" in rows[1]
