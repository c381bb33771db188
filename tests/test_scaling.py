"""perf/scaling.py: one run per process count through torchrun, read back per stage, efficiency against K=1.

The slow test runs the script itself on the CPU (gloo, K = 1 and 2) on a tiny 4-step config and checks its
JSON against the runs' own events; the others feed its pieces hand-made run directories and rows, and show
that bad input is refused before anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.faults_runs import SMALL_VOCAB
from tests.perf_scripts import load_perf_script
from track_1_short.run_log import read_events
from track_1_short.schedule import ScheduleConfig, StageConfig

scaling = load_perf_script("scaling")
results = load_perf_script("results")
ROOT = Path(__file__).resolve().parents[1]

# Two stages of two 512-token steps, micro batches of 256 (one rank runs 2, two ranks 1 each), the
# 1,024-token corpus of tests/faults_runs.py (built once, shared with those tests).
TINY = [
    "experiment=smoke_record",
    "schedule.stages=[{steps:2,batch_tokens:512,max_doc_len:256,window_short:1,window_long:2},"
    "{steps:2,batch_tokens:512,max_doc_len:512,window_short:1,window_long:2}]",
    "schedule.rail_warmup_steps=1",
    "schedule.rail_cooldown_steps=1",
    "micro_batch_tokens=256",
    "optim.replicated_impl=reference",  # the Triton interpreter's fused kernel costs seconds a step here
    "data.val_tokens=512",
    "data.val_batch_tokens=512",
    *SMALL_VOCAB,
]


def _script_env() -> dict:
    # This checkout first, whatever is installed; one thread a rank on the shared 2-core machine.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cpu_scaling(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaling")
    out = tmp / "scaling.json"
    cmd = [sys.executable, "perf/scaling.py", *TINY, "--device", "cpu", "--nproc", "1", "2"]
    cmd += ["--runs-root", str(tmp / "runs"), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=_script_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), tmp / "runs"


def _stage_rate(run_dir: Path, lo: int, hi: int) -> float:
    """tokens/s of steps lo..hi-1 straight from the run's train events (one event a step on the CPU)."""
    train = {e["step"]: e for e in read_events(run_dir) if e["event"] == "train"}
    a, b = train[lo], train[hi]
    return (b["tokens_seen"] - a["tokens_seen"]) / ((b["train_time_ms"] - a["train_time_ms"]) / 1e3)


@pytest.mark.slow
def test_cpu_runs_on_one_and_two_ranks_give_rows_per_stage_and_efficiency_from_their_own_events(cpu_scaling):
    out, runs = cpu_scaling
    assert out["nproc"] == [1, 2] and out["baseline_nproc"] == 1
    rows = {(r["nproc"], r["stage"]): r for r in out["rows"]}
    assert sorted(rows) == [(1, 0), (1, 1), (2, 0), (2, 1)]  # every stage of the schedule, for each K
    for k in (1, 2):
        assert rows[(k, 0)]["steps"] == "0-1" and rows[(k, 1)]["steps"] == "2-3"
        # The global batch stays 512 whatever K: one rank accumulates 2 micro batches of 256, two ranks 1.
        assert all(rows[(k, s)]["batch_tokens"] == 512 for s in (0, 1))
        assert all(rows[(k, s)]["micro_batches"] == 2 // k for s in (0, 1))
        assert all(0 < rows[(k, s)]["optimizer_pct"] < 100 for s in (0, 1))
        assert rows[(k, 1)]["timed_steps"] == 2
        # Stage 1 (steps 2-3) recomputed from the run's own events: the interval from step 2's event to 4's.
        assert rows[(k, 1)]["tokens_per_s"] == pytest.approx(_stage_rate(runs / f"k{k}", 2, 4), rel=1e-9)
    for s in (0, 1):
        assert rows[(1, s)]["efficiency"] is None  # the baseline
        want = rows[(2, s)]["tokens_per_s"] / (2 * rows[(1, s)]["tokens_per_s"])
        assert rows[(2, s)]["efficiency"] == pytest.approx(want, rel=1e-12)
    # The trainer records no peak memory on the CPU: the JSON says so and lists no rank.
    assert out["peak_memory"].startswith("not recorded") and out["tables"]["peak memory per rank"] == []
    assert [(r["nproc"], r["status"]) for r in out["tables"]["runs"]] == [(1, "finished"), (2, "finished")]
    assert any("--nproc_per_node=2" in n for n in out["notes"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert out["git_commit"] == (head.strip() or None)
    assert out["device"].startswith("cpu") and "perf/scaling.py" in out["command"]
    text = "\n".join(results.render_section("perf/results/scaling.json", out))
    assert "| nproc | stage | micro_batches |" in text and "runs:" in text and "efficiency" in text


# -- the pieces, on hand-made inputs --
def test_efficiency_is_the_rate_over_the_baseline_scaled_by_the_process_ratio():
    assert scaling.efficiency(200.0, 2, 100.0, 1) == 1.0
    assert scaling.efficiency(600.0, 8, 100.0, 1) == 0.75
    assert scaling.efficiency(300.0, 4, 200.0, 2) == 0.75  # against K0 = 2: twice the processes, 1.5x


def _run(k, rates, memory=None):
    rows = [{"nproc": k, "stage": s, "tokens_per_s": r} for s, r in rates.items()]
    return {"nproc": k, "rows": rows, "peak_memory_mib_per_rank": memory}


def test_rows_pair_each_stage_with_the_baselines_same_stage_and_a_missing_one_has_no_efficiency():
    runs = [_run(8, {0: 640.0, 1: 700.0, 2: 50.0}), _run(1, {0: 100.0, 2: 10.0})]  # K=1 lacks stage 1
    rows = {(r["nproc"], r["stage"]): r["efficiency"] for r in scaling.scaling_rows(runs)}
    assert list(rows) == [(1, 0), (1, 2), (8, 0), (8, 1), (8, 2)]  # K ascending, stages in order
    assert rows[(1, 0)] is None and rows[(1, 2)] is None
    assert rows[(8, 0)] == pytest.approx(0.8) and rows[(8, 2)] == pytest.approx(50 / 80)
    assert rows[(8, 1)] is None


def test_payload_lists_every_ranks_peak_memory_when_the_runs_recorded_it():
    runs = [_run(1, {0: 1.0}, [100]), _run(2, {0: 2.0}, [110, 120])]
    out = scaling.payload(
        [{**r, "status": "finished", "train_time_s": 1.0, "tokens_per_s_overall": 1.0, "run_dir": "d",
          "command": "c"} for r in runs],
        {"command": "x", "date": "d", "device": "gpu", "torch": "t", "triton": "r"},
        ["experiment=e"],
        "cuda",
    )  # fmt: skip
    assert out["tables"]["peak memory per rank"] == [
        {"nproc": 1, "rank": 0, "peak_memory_mib": 100},
        {"nproc": 2, "rank": 0, "peak_memory_mib": 110},
        {"nproc": 2, "rank": 1, "peak_memory_mib": 120},
    ]
    assert out["peak_memory"].startswith("every rank's CUDA allocator peak")


def test_read_run_takes_the_stage_rows_micro_batches_and_every_ranks_peak_from_the_run_directory(tmp_path):
    sched = ScheduleConfig(
        stages=[StageConfig(steps=2, batch_tokens=400), StageConfig(steps=2, batch_tokens=800)],
        rail_warmup_steps=1,
        rail_cooldown_steps=1,
    )
    cfg = {"schedule": OmegaConf.structured(sched), "model": {}, "micro_batch_tokens": 100}
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (tmp_path / "env.json").write_text(json.dumps({"torch": "t", "devices": [{"name": "gpu"}]}))
    # One event a step; stage 0 is timed over 1-2 (one step of 400 tokens in 20 ms), stage 1 over 2-4.
    steps = [(1, 400, 10.0, 1.0), (2, 800, 30.0, 5.0), (3, 1600, 70.0, 10.0), (4, 2400, 110.0, 10.0)]
    events = [{"event": "start", "total_steps": 4}]
    events += [
        {"event": "train", "step": s, "tokens_seen": t, "train_time_ms": ms, "loss": 1.0, "optimizer_ms": o}
        for s, t, ms, o in steps
    ]
    events.append(
        {"event": "end", "status": "finished", "train_time_ms": 110.0, "peak_memory_mib_per_rank": [7, 9]}
    )
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    run = scaling.read_run(tmp_path, 2, "torchrun ...")
    assert run["peak_memory_mib_per_rank"] == [7, 9] and run["status"] == "finished"
    r0, r1 = run["rows"]
    assert r0["stage"] == 0 and r0["tokens_per_s"] == pytest.approx(400 / 0.020)
    assert r0["ms_per_step"] == pytest.approx(20.0) and r0["optimizer_pct"] == pytest.approx(25.0)
    assert r1["tokens_per_s"] == pytest.approx(1600 / 0.080) and r1["optimizer_pct"] == pytest.approx(25.0)
    # 400 tokens on 2 ranks at 100 a micro batch: 2 each; 800: 4 each.
    assert (r0["micro_batches"], r1["micro_batches"]) == (2, 4)


# -- bad input: refused in one message before anything runs --
def _refused(tmp_path, capsys, *args):
    out = str(tmp_path / "o.json")
    with pytest.raises(SystemExit) as e:
        scaling.main(["perf/scaling.py", *TINY, *args, "--runs-root", str(tmp_path / "r"), "--out", out])
    assert e.value.code == 2
    assert not (tmp_path / "r").exists() and not (tmp_path / "o.json").exists()  # nothing ran or was written
    return capsys.readouterr().err


def test_more_processes_than_visible_gpus_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(scaling.torch.cuda, "device_count", lambda: 1)
    err = _refused(tmp_path, capsys, "--device", "cuda", "--nproc", "1", "2")
    assert "nothing was run" in err and "--nproc 2 needs 2 GPUs but 1 are visible" in err


def test_a_missing_torchrun_is_refused_before_anything_runs(tmp_path, capsys):
    err = _refused(
        tmp_path, capsys, "--device", "cpu", "--nproc", "1", "2", "--torchrun", str(tmp_path / "no")
    )
    assert "no torchrun executable" in err and "--torchrun PATH" in err


def test_one_process_count_or_one_below_one_is_refused():
    with pytest.raises(scaling.ScalingError, match="at least two different process counts"):
        scaling.check_request([2, 2], "cpu", sys.executable, 0)
    with pytest.raises(scaling.ScalingError, match="every process count must be at least 1"):
        scaling.check_request([0, 2], "cpu", sys.executable, 0)
