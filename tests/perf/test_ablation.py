"""perf/ablation.py: each arm's overrides turn exactly its component off, and rows hold the right deltas."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation", ROOT / "perf" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def preset(ablation):
    return ablation.preset_config([])


def _components(cfg):
    sampled = any(p for st in cfg.schedule.stages for p in st.sampled_candidates)
    return {
        "ngram": cfg.model.ngram.enabled,
        "ce_stack": (cfg.model.prefix_targets, sampled),
        "fp8": (cfg.model.fp8.mlp, cfg.model.fp8.qkv, cfg.model.fp8.lm_head),
        "tail": cfg.tail.enabled,
        "attention": cfg.model.attention_impl,
    }


def test_each_arm_changes_its_component_and_nothing_else(ablation, preset):
    base = _components(preset)
    assert base["ngram"] and base["tail"] and base["ce_stack"] == (True, True)
    for arm in ablation.ARMS:
        cfg = ablation.preset_config(ablation.arm_overrides(arm, preset))
        got = _components(cfg)
        assert {k for k in got if got[k] != base[k]} == ({arm} if arm != "all" else set()), arm
        assert cfg.schedule.stages[0].steps == preset.schedule.stages[0].steps and cfg.seed == preset.seed
    off = {arm: _components(ablation.preset_config(ablation.arm_overrides(arm, preset)))[arm] for arm in base}
    assert off["ngram"] is False and off["tail"] is False and off["ce_stack"] == (False, False)
    assert len(set(off["fp8"])) == 1 and off["fp8"][0] != base["fp8"][0]  # all three flipped together
    # the kernel the preset does not run: flash-attn-4 against the preset's FlexAttention, or back
    assert {base["attention"], off["attention"]} in ({"auto", "fa4"}, {"fa4", "flex"})


def test_an_arms_overrides_read_as_one_cell(ablation, preset):
    assert ablation.shown(ablation.arm_overrides("ce_stack", preset)) == (
        "model.prefix_targets=false schedule.stages.*.prefix_weights=[0.0] "
        "schedule.stages.*.sampled_candidates=[0]"
    )


def _run_dir(tmp_path, name, tps, val, last, status="finished", tail=None):
    """``tail``: (the train events' tail_ms, the ship's seconds) of a run with tail averaging."""
    d = tmp_path / name
    d.mkdir()
    events = []
    if tail is not None:
        events += [{"event": "train", "step": i + 1, "tail_ms": ms} for i, ms in enumerate(tail[0])]
        events.append({"event": "phase", "name": "tail_ship", "seconds": tail[1]})
    events += [
        {"event": "val", "step": 10, "total_steps": 10, "val_loss": val, "val_loss_last_iterate": last},
        {"event": "summary", "tokens_per_s": tps},
        {"event": "end", "status": status, "train_time_ms": 5000.0, "timed_loop_graphs": 0},
    ]
    (d / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return d


def test_rows_are_means_over_seeds_with_deltas_against_all(ablation, tmp_path):
    figs = {
        "all": {0: (1000.0, 3.0, 3.02), 1: (1200.0, 3.2, 3.22)},
        "ngram": {0: (1210.0, 3.15, 3.17), 1: (1430.0, 3.25, 3.27)},
    }
    results = {}
    for arm, by_seed in figs.items():
        results[arm] = {
            s: ablation.run_figures(_run_dir(tmp_path, f"{arm}_s{s}", *f)) for s, f in by_seed.items()
        }
    rows = {
        r["arm"]: r for r in ablation.rows_of(results, {"all": [], "ngram": ["model.ngram.enabled=false"]})
    }
    assert rows["all"]["tokens_per_s"] == pytest.approx(1100.0) and rows["all"]["d_tokens_per_s_pct"] is None
    assert rows["ngram"]["tokens_per_s"] == pytest.approx(1320.0)
    assert rows["ngram"]["d_tokens_per_s_pct"] == pytest.approx(20.0)
    assert rows["ngram"]["d_val_mnats"] == pytest.approx(100.0)
    assert rows["ngram"]["val_loss_sd"] == pytest.approx(0.0707107, rel=1e-5)  # sample sd of 3.15, 3.25
    assert rows["ngram"]["val_loss_last_iterate"] == pytest.approx(3.22)
    assert rows["ngram"]["upstream"].startswith("n-gram table")
    # Welch's t on (3.15, 3.25) against (3.0, 3.2): means 3.2 and 3.1, sample variances 0.005 and 0.02, so
    # squared standard errors 0.0025 and 0.01; Welch-Satterthwaite degrees of freedom 0.0125^2 / (0.0025^2 +
    # 0.01^2) (n - 1 = 1 each).
    t, dof = 0.1 / 0.0125**0.5, 0.0125**2 / (0.0025**2 + 0.01**2)
    assert rows["ngram"]["p_val"] == pytest.approx(2 * stats.t.sf(t, dof), rel=1e-9)
    assert rows["all"]["p_val"] is None


def test_the_tails_time_is_its_ticks_and_its_ship_over_the_train_time(ablation, tmp_path):
    # Train time 5 s a run (_run_dir): 0.25 s of tail is 5%, 0.75 s is 15%; a run without the tail has None.
    on = {0: ablation.run_figures(_run_dir(tmp_path, "a", 1.0, 3.0, 3.1, tail=([100.0, 50.0], 0.1)))}
    on[1] = ablation.run_figures(_run_dir(tmp_path, "b", 1.0, 3.0, 3.1, tail=([300.0, 200.0], 0.25)))
    off = {0: ablation.run_figures(_run_dir(tmp_path, "c", 1.0, 3.0, 3.0))}
    rows = {r["arm"]: r for r in ablation.rows_of({"all": on, "tail": off}, {"all": [], "tail": []})}
    assert on[0]["tail_s"] == pytest.approx(0.25) and on[1]["tail_s"] == pytest.approx(0.75)
    assert rows["all"]["tail_s"] == pytest.approx(0.5) and rows["all"]["tail_pct"] == pytest.approx(10.0)
    assert rows["tail"]["tail_s"] is None and rows["tail"]["tail_pct"] is None


def test_an_unfinished_run_is_not_counted(ablation, tmp_path):
    assert ablation.run_figures(_run_dir(tmp_path, "all_s0", 1.0, 3.0, 3.0, status="stopped")) is None
    assert ablation.run_figures(tmp_path / "missing") is None


def test_a_finished_run_is_read_not_run_again_and_the_rest_are_run(ablation, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    _run_dir(runs, "all_s0", 1000.0, 3.0, 3.1)  # an earlier call's run on this machine
    launched = []
    real_run = ablation.subprocess.run  # the module is shared: others' commands (uname) still run

    def fake_run(cmd, **kwargs):  # the trainer: record the run and leave a finished run directory behind
        if "track_1_short.train" not in cmd:
            return real_run(cmd, **kwargs)
        name = next(a.split("=", 1)[1] for a in cmd if a.startswith("run_name="))
        launched.append(name)
        _run_dir(runs, name, 1100.0, 3.2, 3.3)

    monkeypatch.setattr(ablation.subprocess, "run", fake_run)
    out = tmp_path / "ablation.json"
    args = ["--arms", "all", "ngram", "--seeds", "0", "--runs-root", str(runs), "--out", str(out)]
    assert ablation.main(args) == 0
    assert launched == ["ngram_s0"]
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["all"]["tokens_per_s"] == 1000.0
    assert rows["ngram"]["d_tokens_per_s_pct"] == pytest.approx(10.0)
    # Without the all arm the rows carry no deltas (the arm's own figures only).
    assert ablation.main(["--arms", "ngram", *args[3:]]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert launched == ["ngram_s0"] and row["arm"] == "ngram" and row["d_tokens_per_s_pct"] is None


def test_runs_go_side_by_side_one_per_gpu(ablation, tmp_path, monkeypatch):
    """--gpus 2: every run is pinned to one of the two GPUs, never two runs on one GPU at a time, and both
    GPUs are busy at once; the rows are the same as run one after another."""
    import threading
    import time as _time

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    runs = tmp_path / "runs"
    runs.mkdir()
    lock, active, seen = threading.Lock(), set(), []
    most = {"n": 0}
    real_run = ablation.subprocess.run

    def fake_run(cmd, env=None, **kwargs):
        if "track_1_short.train" not in cmd:
            return real_run(cmd, env=env, **kwargs)
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            assert gpu not in active, f"two runs on GPU {gpu} at once"
            active.add(gpu)
            most["n"] = max(most["n"], len(active))
        _time.sleep(0.2)
        name = next(a.split("=", 1)[1] for a in cmd if a.startswith("run_name="))
        seed = int(name[-1])
        _run_dir(runs, name, 1000.0 + 100 * ("ngram" in name) + seed, 3.0 + 0.01 * seed, 3.1)
        with lock:
            active.discard(gpu)
            seen.append((name, gpu))

    monkeypatch.setattr(ablation.subprocess, "run", fake_run)
    out = tmp_path / "ablation.json"
    args = ["--arms", "all", "ngram", "--seeds", "0", "1", "--runs-root", str(runs), "--out", str(out)]
    assert ablation.main([*args, "--gpus", "2"]) == 0
    assert sorted(n for n, _ in seen) == ["all_s0", "all_s1", "ngram_s0", "ngram_s1"]
    assert {g for _, g in seen} == {"3", "5"} and most["n"] == 2
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ngram"]["tokens_per_s"] == 1100.5 and rows["all"]["tokens_per_s"] == 1000.5
    assert rows["all"]["seeds"] == [0, 1]
    with pytest.raises(SystemExit, match="--gpus 3, but 2 GPU"):
        ablation.main([*args, "--gpus", "3"])
