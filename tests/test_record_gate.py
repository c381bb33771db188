"""tools/record_gate.py: statistics equal upstream's on a public record, decisions, run formats, bad input.

The fixture tests/fixtures/upstream_bigrams/ is rebuilt by tests/fixtures/make_upstream_fixture.py from the
figures of upstream record 2026-05-20 BigramsSignTrick; the expected numbers below are copied from that
record's two statistics.md files and compared at the precision those files print.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from tests.fixtures.make_upstream_fixture import FIXTURE_DIR, write_fixture
from tools import record_gate
from tools.record_gate import (
    EXIT_BAD_INPUT,
    EXIT_FAIL,
    EXIT_PASS,
    RecordGateInputError,
    main,
    render_markdown,
    run_gate,
    write_plot,
)
from track_1_short.run_log import RunLog

REPO = Path(__file__).resolve().parents[1]
BASELINE, PR299 = FIXTURE_DIR / "baseline", FIXTURE_DIR / "pr299"

# Copied from the record's statistics.md files: baseline/ (10 runs) and pr299/ (20 runs). Losses in nats,
# times in ms; each figure is compared after rounding to the digits it is printed with there.
UPSTREAM = {
    "baseline": {
        "n": 10,
        "mean_loss": 3.27937,
        "std_loss": 0.00135,
        "min_loss": 3.2773,
        "max_loss": 3.2819,
        "mean_time_ms": 85394.3,
        "std_time_ms": 79.4,
        "min_time_ms": 85180,
        "max_time_ms": 85454,
    },
    "pr299": {
        "n": 20,
        "mean_loss": 3.27917,
        "std_loss": 0.00115,
        "min_loss": 3.2763,
        "max_loss": 3.2811,
        "mean_time_ms": 84429.5,
        "std_time_ms": 71.6,
        "min_time_ms": 84237,
        "max_time_ms": 84582,
    },
}
UPSTREAM_P_PR299 = 0.0024  # p(val_loss < 3.28), printed to 4 decimals
UPSTREAM_DELTA_LOSS = -0.00020  # "vs baseline" table, val_loss mean delta, 5 decimals
UPSTREAM_DELTA_TIME_MS = -964.8  # "vs baseline" table, train_time mean delta, 1 decimal
UPSTREAM_ROWS = {"02ed0a75": (3.2783, 85415), "f89b260d": (3.2794, 85402), "0cf91274": (3.2763, 84237)}


# ---- helpers: logs written the way the two supported formats write them ---------------------------------


def progress(step: int, total: int, time_ms: float, loss: float | None = None) -> str:
    val = f" val_loss:{loss:.4f}" if loss is not None else ""
    return f"step:{step}/{total}{val} train_time:{time_ms:.0f}ms step_avg:{time_ms / max(step, 1):.2f}ms\n"


def write_text_log(path: Path, loss: float | None, time_ms: float, total: int = 100) -> Path:
    """An upstream-format log with a mid-run val; loss=None leaves out the final val (an unfinished run)."""
    text = "Running Python 3.12\n" + progress(0, total, 0, 10.8) + progress(1, total, 50)
    text += progress(total // 2, total, time_ms / 2, 4.0) + progress(total, total, time_ms - 10)
    if loss is not None:
        text += progress(total, total, time_ms, loss)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_set(directory: Path, losses: list[float], times_ms: list[float], total: int = 100) -> Path:
    for i, (loss, time_ms) in enumerate(zip(losses, times_ms)):
        write_text_log(directory / f"run{i}.txt", loss, time_ms, total)
    return directory


def write_events(run_dir: Path, events: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def finished_events(loss, time_ms: float, total: int = 100) -> list[dict]:
    return [
        {"event": "start", "total_steps": total, "seed": 0, "config": {}},
        {"event": "val", "step": 0, "total_steps": total, "val_loss": 10.8, "train_time_ms": 0.0,
         "step_avg_ms": 0},
        {"event": "train", "step": total, "loss": 3.3, "lr_multiplier": 0.1, "tokens_seen": 1,
         "train_time_ms": time_ms - 5, "step_avg_ms": 1.0},
        {"event": "val", "step": total, "total_steps": total, "val_loss": loss, "train_time_ms": time_ms,
         "step_avg_ms": 1.0},
        {"event": "end", "step": total, "total_steps": total, "status": "finished", "val_loss": loss,
         "train_time_ms": time_ms},
    ]  # fmt: skip


def gate(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- the upstream fixture ----------------------------------------------------------------------------------


def test_committed_fixture_is_what_the_fixture_script_writes(tmp_path):
    written = write_fixture(tmp_path)
    committed = sorted(p.relative_to(FIXTURE_DIR) for p in FIXTURE_DIR.rglob("*.txt"))
    assert sorted(p.relative_to(tmp_path) for p in written) == committed
    assert len(committed) == 30
    for rel in committed:
        assert (tmp_path / rel).read_bytes() == (FIXTURE_DIR / rel).read_bytes(), rel


@pytest.mark.parametrize("name", ["baseline", "pr299"])
def test_set_statistics_equal_upstream_statistics_md_to_printed_precision(name):
    result = run_gate(FIXTURE_DIR / name)
    s, want = result.candidate, UPSTREAM[name]
    assert s.n == len(s.losses) == len(s.times_s) == want["n"]
    assert s.total_steps == 1480 and s.excluded == [] and s.diverged == []
    assert round(s.mean_loss, 5) == want["mean_loss"]
    assert round(s.std_loss, 5) == want["std_loss"]
    assert round(min(s.losses), 4) == want["min_loss"] and round(max(s.losses), 4) == want["max_loss"]
    assert round(s.mean_time_s * 1000, 1) == want["mean_time_ms"]
    assert round(s.std_time_s * 1000, 1) == want["std_time_ms"]
    assert (
        round(s.min_time_s * 1000) == want["min_time_ms"]
        and round(s.max_time_s * 1000) == want["max_time_ms"]
    )
    for run, (loss, time_ms) in UPSTREAM_ROWS.items():
        if run in s.runs:
            i = s.runs.index(run)
            assert (s.losses[i], round(s.times_s[i] * 1000)) == (loss, time_ms)


def test_candidate_p_value_and_deltas_equal_upstream_statistics_md():
    result = run_gate(PR299, BASELINE)
    assert round(result.candidate.p_value, 4) == UPSTREAM_P_PR299
    assert round(result.comparison.delta_loss, 5) == UPSTREAM_DELTA_LOSS
    assert round(result.comparison.delta_time_s * 1000, 1) == UPSTREAM_DELTA_TIME_MS


def test_p_values_agree_with_t_distribution_from_the_formulas():
    """One-sample t and Welch-Satterthwaite t and df computed here; only the t CDF comes from scipy."""
    result = run_gate(PR299, BASELINE)
    c, b, cmp = result.candidate, result.baseline, result.comparison

    def welch(x, y):
        vx, vy = stats.tvar(x) / len(x), stats.tvar(y) / len(y)
        t = (sum(x) / len(x) - sum(y) / len(y)) / math.sqrt(vx + vy)
        df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
        return t, df

    t_one = (c.mean_loss - 3.28) / (c.std_loss / math.sqrt(c.n))
    t_time, df_time = welch(c.times_s, b.times_s)
    t_loss, df_loss = welch(c.losses, b.losses)
    # Same formulas summed in another order: agreement to 1e-9 relative (p spans 1e-16 to 0.7).
    assert c.p_value == pytest.approx(stats.t.cdf(t_one, c.n - 1), rel=1e-9)
    assert cmp.welch_p_time == pytest.approx(stats.t.cdf(t_time, df_time), rel=1e-9)
    assert cmp.welch_p_loss == pytest.approx(2 * stats.t.sf(abs(t_loss), df_loss), rel=1e-9)
    assert cmp.speedup == pytest.approx(b.mean_time_s / c.mean_time_s, rel=1e-15)


def test_markdown_tables_carry_the_upstream_figures():
    md = render_markdown(run_gate(PR299, BASELINE))
    rows = {}
    for line in md.splitlines():
        cells = [x.strip().strip("*") for x in line.strip("|").split("|")]
        rows.setdefault(cells[0], []).append(cells[1:])
    assert md.startswith("# pr299 statistics\n\n20 runs, step 1480/1480.\n")
    (cand_loss, base_loss) = [[float(x) for x in r] for r in rows["val_loss"]]
    (cand_time, base_time) = [[float(x) for x in r] for r in rows["train_time (ms)"]]
    for got_loss, got_time, want in (
        (cand_loss, cand_time, UPSTREAM["pr299"]),
        (base_loss, base_time, UPSTREAM["baseline"]),
    ):
        assert got_loss == [want["mean_loss"], want["std_loss"], want["min_loss"], want["max_loss"]]
        assert got_time == [
            want["mean_time_ms"],
            want["std_time_ms"],
            want["min_time_ms"],
            want["max_time_ms"],
        ]
    assert [float(x) for x in rows["val_loss mean"][0]] == [3.27937, 3.27917, UPSTREAM_DELTA_LOSS]
    assert [float(x) for x in rows["train_time mean (ms)"][0]] == [85394.3, 84429.5, UPSTREAM_DELTA_TIME_MS]
    assert f"p(val_loss < 3.28) = **{UPSTREAM_P_PR299}**" in md
    assert rows["0cf91274"] == [["3.2763", "84237ms"]]


def test_record_passes_against_its_baseline_and_baseline_alone_fails_the_target(capsys):
    code, out, _ = gate(capsys, PR299, "--baseline", BASELINE)
    assert code == EXIT_PASS
    assert "PASS" in out and "fail:" not in out
    code, out, _ = gate(capsys, BASELINE)
    assert code == EXIT_FAIL
    assert "fail: mean val loss 3.27937 is not below the target 3.28 at p < 0.01" in out
    assert "note: no baseline given" in out


def test_alpha_and_target_flags_move_the_decision(capsys):
    assert gate(capsys, BASELINE, "--alpha", "0.1")[0] == EXIT_PASS  # baseline p = 0.087
    assert gate(capsys, PR299, "--target", "3.279")[0] == EXIT_FAIL  # mean 3.27917 is above 3.279


def test_systems_only_passes_when_losses_match_the_baseline(capsys):
    code, out, _ = gate(capsys, PR299, "--baseline", BASELINE, "--systems-only")
    assert code == EXIT_PASS
    assert "pass: candidate losses are not distinguishable from the baseline's" in out
    assert "below the target" not in out  # the target test is replaced, not added


def test_set_built_to_fail_fails_for_loss_above_target_and_slower(tmp_path, capsys):
    base = write_set(
        tmp_path / "base", [3.2770, 3.2775, 3.2780, 3.2772, 3.2778], [1000, 1004, 998, 1002, 1001]
    )
    cand = write_set(
        tmp_path / "cand", [3.2850, 3.2861, 3.2844, 3.2858, 3.2849], [1100, 1104, 1098, 1102, 1101]
    )
    code, out, _ = gate(capsys, cand, "--baseline", base, "--json", tmp_path / "g.json")
    assert code == EXIT_FAIL
    reasons = json.loads((tmp_path / "g.json").read_text())["reasons"]
    assert [r.split(":")[0] for r in reasons] == ["fail", "fail"]
    assert reasons[0].startswith("fail: mean val loss 3.28524 is not below the target 3.28")
    assert reasons[1].startswith("fail: candidate is not faster than the baseline at p < 0.01")
    assert "FAIL" in out


def test_systems_only_fails_when_losses_shift(tmp_path, capsys):
    base = write_set(
        tmp_path / "base", [3.2770, 3.2775, 3.2780, 3.2772, 3.2778], [1000, 1004, 998, 1002, 1001]
    )
    cand = write_set(tmp_path / "cand", [3.2870, 3.2875, 3.2880, 3.2872, 3.2878], [900, 904, 898, 902, 901])
    code, out, _ = gate(capsys, cand, "--baseline", base, "--systems-only")
    assert code == EXIT_FAIL
    assert "fail: candidate losses are distinguishable from the baseline's" in out
    assert "pass: candidate is faster than the baseline" in out


def test_json_holds_the_documented_keys_and_figures(tmp_path, capsys):
    path = tmp_path / "gate.json"
    gate(capsys, PR299, "--baseline", BASELINE, "--json", path)
    doc = json.loads(path.read_text())
    assert {"passed", "reasons", "candidate", "baseline", "comparison"} <= doc.keys()
    set_keys = {"n", "losses", "times_s", "mean_loss", "std_loss", "p_value", "mean_time_s", "std_time_s",
                "median_time_s", "min_time_s", "max_time_s"}  # fmt: skip
    assert set_keys <= doc["candidate"].keys() and set_keys <= doc["baseline"].keys()
    assert {"delta_time_s", "speedup", "welch_p_time", "welch_p_loss"} <= doc["comparison"].keys()
    assert doc["passed"] is True and doc["candidate"]["n"] == 20 and doc["baseline"]["n"] == 10
    assert round(doc["comparison"]["delta_time_s"], 4) == UPSTREAM_DELTA_TIME_MS / 1000
    i = doc["baseline"]["runs"].index("02ed0a75")
    assert (doc["baseline"]["losses"][i], doc["baseline"]["times_s"][i]) == (3.2783, 85.415)
    assert doc["baseline"]["median_time_s"] == pytest.approx((85.415 + 85.418) / 2, abs=1e-12)


def test_json_baseline_and_comparison_are_null_without_baseline(tmp_path, capsys):
    gate(capsys, PR299, "--json", tmp_path / "g.json")
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["baseline"] is None and doc["comparison"] is None and doc["candidate"]["n"] == 20


def test_plot_is_a_png_of_the_expected_size(tmp_path, capsys):
    from matplotlib.image import imread

    with_base, alone = tmp_path / "with_base.png", tmp_path / "alone.png"
    write_plot(run_gate(PR299, BASELINE), with_base)
    runs = tmp_path / "runs"
    for i, loss in enumerate([3.2701, 3.2712, 3.2699]):  # final val only: no curves to draw
        write_events(runs / f"seed{i}", finished_events(loss, 1000 + i)[3:4])
    write_plot(run_gate(runs), alone)
    for path in (with_base, alone):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(with_base).shape[:2] == (572, 1760)  # figsize 16 x 5.2 in at 110 dpi
    # No intermediate val losses: the curve panels are left out, not drawn empty (two panels of 16 / 3.5 in).
    assert imread(alone).shape[:2] == (572, 1005)


@pytest.mark.slow
def test_cli_script_runs_and_exits_with_the_decision(tmp_path):
    script = REPO / "tools" / "record_gate.py"
    out = [tmp_path / "s.md", tmp_path / "s.png"]
    run = subprocess.run(
        [sys.executable, script, PR299, "--baseline", BASELINE, "--markdown", out[0], "--plot", out[1]],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert run.returncode == EXIT_PASS, run.stderr
    assert "PASS" in run.stdout and all(p.stat().st_size > 0 for p in out)
    run = subprocess.run([sys.executable, script, tmp_path], capture_output=True, text=True, timeout=120)
    assert run.returncode == EXIT_BAD_INPUT and "no run logs" in run.stderr


# ---- this project's run directories -----------------------------------------------------------------------


def test_run_dirs_are_read_from_events_jsonl_or_log_txt(tmp_path):
    runs = tmp_path / "runs"
    write_events(runs / "a", finished_events(3.27651234, 1000.5))  # events only
    write_text_log(runs / "b" / "log.txt", 3.2712, 1010)  # log only
    write_events(runs / "c", finished_events(3.27351234, 1020.25))  # both: events win (full precision)
    write_text_log(runs / "c" / "log.txt", 3.2735, 1020)
    (runs / "notes").mkdir()  # not a run: skipped
    s = run_gate(runs).candidate
    assert s.runs == ["a", "b", "c"]
    assert s.losses == [3.27651234, 3.2712, 3.27351234]
    assert s.times_s == [1.0005, 1.01, 1.02025]


def test_run_dirs_written_by_run_log_are_read(tmp_path):
    runs = tmp_path / "runs"
    for seed, loss in enumerate([3.2701, 3.2722, 3.2713]):
        log = RunLog(runs / f"seed{seed}")
        log.start(total_steps=20, seed=seed, config={})
        log.val(0, 20, 10.8, 0.0, 0.0)
        log.train(20, 20, 3.3, 0.1, 1000, 900.0 + seed, 45.0, progress_line=True)
        log.val(20, 20, loss, 910.0 + seed, 45.5)
        log.end(20, 20, "finished", loss, 910.0 + seed)
        log.close()
    failed = RunLog(runs / "seed9")
    failed.start(total_steps=20, seed=9, config={})
    failed.train(7, 20, float("nan"), 0.1, 100, 300.0, 42.0, progress_line=True)
    failed.end(7, 20, "failed", None, 300.0)
    failed.close()
    s = run_gate(runs).candidate
    assert s.runs == ["seed0", "seed1", "seed2"] and s.losses == [3.2701, 3.2722, 3.2713]
    assert s.times_s == [0.91, 0.911, 0.912]
    assert s.excluded == [{"run": "seed9", "reason": "run ended with status 'failed' at step 7"}]
    # log.txt alone gives the same figures (to its 4 printed decimals).
    for run_dir in runs.iterdir():
        (run_dir / "events.jsonl").unlink()
    s2 = run_gate(runs).candidate
    assert s2.losses == s.losses and s2.times_s == s.times_s
    assert s2.excluded == [{"run": "seed9", "reason": "no final val at step 20/20 (last step logged: 7)"}]


def test_unfinished_run_is_listed_and_excluded_not_dropped(tmp_path, capsys):
    runs = write_set(tmp_path / "runs", [3.2701, 3.2712, 3.2699], [1000, 1001, 1002])
    write_text_log(runs / "crashed.txt", None, 1003)
    code, out, _ = gate(capsys, runs, "--json", tmp_path / "g.json", "--markdown", tmp_path / "s.md")
    doc = json.loads((tmp_path / "g.json").read_text())
    assert code == EXIT_PASS and doc["candidate"]["n"] == 3
    reason = "no final val at step 100/100 (last step logged: 100)"
    assert doc["candidate"]["excluded"] == [{"run": "crashed", "reason": reason}]
    assert f"excluded: crashed: {reason}" in out
    assert any(
        r.startswith("note: 1 candidate run(s) did not finish") and "crashed" in r for r in doc["reasons"]
    )
    assert f"Excluded (did not finish): crashed ({reason})." in (tmp_path / "s.md").read_text()


def test_line_cut_off_by_a_crash_makes_the_run_unfinished(tmp_path):
    runs = write_set(tmp_path / "runs", [3.2701, 3.2712], [1000, 1001])
    cut = write_text_log(runs / "cut.txt", 3.2705, 1002)
    cut.write_text(cut.read_text()[:-8])  # last line loses "57.71ms\n"-like tail: no newline, no unit
    write_events(runs / "cutjson", finished_events(3.2703, 1003))
    events = runs / "cutjson" / "events.jsonl"
    events.write_text(events.read_text()[:-1].rsplit("\n", 2)[0] + '\n{"event": "val", "st')
    s = run_gate(runs).candidate
    assert s.runs == ["run0", "run1"]
    assert {e["run"] for e in s.excluded} == {"cut", "cutjson"}


def test_diverged_candidate_run_fails_the_gate(tmp_path, capsys):
    runs = tmp_path / "runs"
    for i, loss in enumerate([3.2701, 3.2712, 3.2699, "nan"]):  # run_log writes a poisoned loss as "nan"
        write_events(runs / f"seed{i}", finished_events(loss, 1000 + i))
    code, out, _ = gate(capsys, runs)
    assert code == EXIT_FAIL
    assert "fail: candidate run(s) diverged (non-finite final val loss): seed3" in out
    assert "pass: mean val loss 3.27040" in out  # the finite runs' statistics are still reported


# ---- bad input: exit 2, one clear message, nothing written ----------------------------------------------


def bad(tmp_path, capsys, *argv) -> str:
    json_path = tmp_path / "never.json"
    code, out, err = gate(capsys, *argv, "--json", json_path)
    assert code == EXIT_BAD_INPUT
    assert not json_path.exists() and out == ""
    assert err.startswith("record_gate: bad input: ") and err.count("\n") == 1
    return err


def test_empty_directory_is_bad_input(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "no run logs in" in bad(tmp_path, capsys, tmp_path / "empty")


def test_missing_directory_is_bad_input(tmp_path, capsys):
    assert "is not a directory" in bad(tmp_path, capsys, tmp_path / "nope")


def test_logs_without_final_val_line_are_bad_input(tmp_path, capsys):
    write_text_log(tmp_path / "runs" / "a.txt", None, 1000)
    write_text_log(tmp_path / "runs" / "b.txt", None, 1000)
    err = bad(tmp_path, capsys, tmp_path / "runs")
    assert "has 0 finished run(s)" in err and "a: no final val at step 100/100" in err


@pytest.mark.parametrize(
    "field", ["val_loss:3.2x83", "train_time:85415", "train_time:abcms", "step:1480/14a0"]
)
def test_non_numeric_field_in_text_log_is_bad_input(tmp_path, capsys, field):
    runs = write_set(tmp_path / "runs", [3.2701, 3.2712], [1000, 1001])
    key = field.split(":")[0]
    good = {"val_loss": "val_loss:3.2712", "train_time": "train_time:1001ms", "step": "step:100/100"}[key]
    log = runs / "run1.txt"
    lines = log.read_text().splitlines(keepends=True)
    lines[-1] = lines[-1].replace(good, field)
    assert lines[-1] != progress(100, 100, 1001, 3.2712)
    log.write_text("".join(lines))
    err = bad(tmp_path, capsys, runs)
    assert (
        f"run1.txt:{len(lines)}:" in err
        and {"val_loss": "val_loss", "train_time": "train_time", "step": "total steps"}[key] in err
    )


def test_non_numeric_field_in_events_is_bad_input(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_events(runs / "a", finished_events(3.2701, 1000))
    write_events(runs / "b", finished_events("3.27 nats", 1001))
    err = bad(tmp_path, capsys, runs)
    assert "b/events.jsonl:4" in err and "'val_loss' must be a number" in err


def test_malformed_json_line_before_the_end_is_bad_input(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_events(runs / "a", finished_events(3.2701, 1000))
    b = write_events(runs / "b", finished_events(3.2702, 1001)) / "events.jsonl"
    b.write_text("{not json}\n" + b.read_text())
    assert "b/events.jsonl:1: not a JSON object" in bad(tmp_path, capsys, runs)


def test_single_run_is_bad_input(tmp_path, capsys):
    runs = write_set(tmp_path / "runs", [3.2701], [1000])
    assert "has 1 finished run(s)" in bad(tmp_path, capsys, runs)
    write_events(tmp_path / "one", finished_events(3.27, 1000))
    assert "is one run directory" in bad(tmp_path, capsys, tmp_path / "one")


def test_single_baseline_run_is_bad_input(tmp_path, capsys):
    base = write_set(tmp_path / "base", [3.2701], [1000])
    assert bad(tmp_path, capsys, PR299, "--baseline", base).startswith("record_gate: bad input: baseline ")


def test_mixed_step_counts_are_bad_input(tmp_path, capsys):
    runs = write_set(tmp_path / "runs", [3.2701, 3.2712], [1000, 1001])
    write_text_log(runs / "short.txt", 3.2799, 900, total=90)
    err = bad(tmp_path, capsys, runs)
    assert "mixes step counts (90 steps: short; 100 steps: run0, run1)" in err


def test_identical_losses_are_bad_input(tmp_path, capsys):
    runs = write_set(tmp_path / "runs", [3.2701, 3.2701, 3.2701], [1000, 1001, 1002])
    assert "same final val loss" in bad(tmp_path, capsys, runs)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--alpha", "0"], "--alpha must lie strictly between 0 and 1"),
        (["--alpha", "1.5"], "--alpha must lie strictly between 0 and 1"),
        (["--target", "nan"], "--target must be a finite loss"),
        (["--systems-only"], "--systems-only compares losses with a baseline: pass --baseline DIR"),
    ],
)
def test_bad_flags_are_bad_input(tmp_path, capsys, flags, message):
    assert message in bad(tmp_path, capsys, PR299, *flags)


def test_unparseable_flag_exits_2_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(PR299), "--target", "low"])
    assert exit_info.value.code == EXIT_BAD_INPUT
    assert "argument --target: invalid float value: 'low'" in capsys.readouterr().err


def test_undefined_welch_p_fails_the_speed_check_and_is_null_in_json(tmp_path, capsys):
    base = write_set(tmp_path / "base", [3.2770, 3.2775, 3.2780], [1000, 1000, 1000])
    cand = write_set(tmp_path / "cand", [3.2701, 3.2712, 3.2699], [1000, 1000, 1000])
    with pytest.warns(RuntimeWarning):  # scipy: Welch t is 0/0 when neither set varies and the means agree
        code, out, _ = gate(capsys, cand, "--baseline", base, "--json", tmp_path / "g.json")
    assert code == EXIT_FAIL
    assert "fail: candidate is not faster than the baseline at p < 0.01" in out and "p = undefined" in out
    assert json.loads((tmp_path / "g.json").read_text())["comparison"]["welch_p_time"] is None


def test_run_gate_raises_our_error_type_for_library_callers(tmp_path):
    with pytest.raises(RecordGateInputError, match="no run logs"):
        run_gate(tmp_path)
    assert issubclass(RecordGateInputError, ValueError)


def test_time_panel_error_bar_never_reaches_below_zero():
    # Times 1, 1, 10 s: mean 4, sample std ~5.2; the lower arm stops at 0 s, the upper keeps the std.
    (lower,), (upper,) = record_gate.error_bar(4.0, 5.2)
    assert lower == 4.0 and upper == 5.2
    assert record_gate.error_bar(4.0, 1.0) == [[1.0], [1.0]]  # a bar that stays above 0 is untouched


def test_a_resumed_run_directory_is_one_run_whose_superseded_steps_are_dropped(tmp_path):
    from track_1_short.run_log import RunLog, mark_resumption

    d = tmp_path / "runs" / "r"
    log = RunLog(d)
    log.start(total_steps=6, seed=0, config={})
    for s in (1, 2, 3, 4, 5):
        log.train(s, 6, 2.0, 1.0, 10 * s, 10.0 * s, 10.0, progress_line=True)
    log.val(5, 6, 9.9, 50.0, 10.0)  # logged by the killed run after its last checkpoint (step 4)
    mark_resumption(log, Path("ckpt/step_000004.pt"), 4, 6)
    log.start(total_steps=6, seed=0, config={}, start_step=4)
    for s in (5, 6):
        log.train(s, 6, 1.0, 1.0, 10 * s, 10.0 * s, 10.0, progress_line=True)
    log.val(6, 6, 1.5, 60.0, 10.0)
    log.end(6, 6, "finished", val_loss=1.5, train_time_ms=60.0)
    log.close()
    for run in (record_gate.read_run_dir(d), record_gate.read_text_log(d / "log.txt")):
        assert run.finished and run.final_loss == 1.5
        assert run.curve == [(6, 1.5)]  # the killed run's val at step 5 is superseded
    assert len(record_gate.load_runs(tmp_path / "runs").scored) == 1


# ---- the runs' configs: the target and one configuration per set -----------------------------------------


def write_configured_set(runs: Path, losses: list[float], **changes: dict) -> Path:
    """Finished run directories with a config.yaml each: the smoke preset's target, one seed a run;
    ``changes`` maps a run's name to the settings it has differently."""
    import yaml

    for seed, loss in enumerate(losses):
        name = f"seed{seed}"
        config = {"seed": seed, "run_name": name, "runs_root": f"/tmp/root{seed}", "smoke_target": 6.55,
                  "data": {"kind": "synthetic", "dir": f"/d{seed}"}, "optim": {"adam_lr": 0.008}}  # fmt: skip
        for key, value in changes.get(name, {}).items():
            section, _, leaf = key.rpartition(".")
            (config.setdefault(section, {}) if section else config)[leaf or key] = value
        write_events(runs / name, finished_events(loss, 1000 + seed, total=16))
        (runs / name / "config.yaml").write_text(yaml.safe_dump(config))
    return runs


def test_the_target_is_the_runs_smoke_target_unless_given(tmp_path, capsys):
    runs = write_configured_set(tmp_path / "runs", [6.4392, 6.4594, 6.4437, 6.4258, 6.4352])
    code, out, _ = gate(capsys, runs)
    assert code == EXIT_PASS, out
    assert (
        "below the target 6.55" in out and "note: target 6.55: smoke_target in the runs' config.yaml" in out
    )
    code, out, _ = gate(capsys, runs, "--target", "6.40")  # the flag wins
    assert code == EXIT_FAIL and "target 6.4 " in out


def test_runs_on_fineweb_without_a_smoke_target_use_the_record_target(tmp_path, capsys):
    changes = {f"seed{i}": {"smoke_target": None, "data.kind": "shards"} for i in range(3)}
    runs = write_configured_set(tmp_path / "runs", [3.2701, 3.2712, 3.2699], **changes)
    code, out, _ = gate(capsys, runs)
    assert code == EXIT_PASS and "below the target 3.28" in out and "for runs on FineWeb" in out


def test_runs_with_no_target_anywhere_are_bad_input_naming_the_flag(tmp_path, capsys):
    changes = {f"seed{i}": {"smoke_target": None} for i in range(3)}
    runs = write_configured_set(tmp_path / "runs", [6.1, 6.2, 6.3], **changes)
    assert "sets no smoke_target" in bad(tmp_path, capsys, runs) and "--target" in bad(tmp_path, capsys, runs)
    assert gate(capsys, runs, "--target", "7.0")[0] == EXIT_PASS


def test_runs_of_different_configurations_are_refused_naming_each_differing_key(tmp_path, capsys):
    # Seeds, names, roots and data directories differ in every set; these two runs differ in more.
    changes = {"seed1": {"optim.adam_lr": 0.004}, "seed2": {"smoke_target": 6.6}}
    runs = write_configured_set(tmp_path / "runs", [6.43, 6.44, 6.45], **changes)
    err = bad(tmp_path, capsys, runs)
    assert "mixes configurations" in err and "differ in optim.adam_lr, smoke_target (only" in err
    # The same as a baseline.
    same = write_configured_set(tmp_path / "same", [6.43, 6.44, 6.45])
    err = bad(tmp_path, capsys, same, "--baseline", runs)
    assert err.startswith("record_gate: bad input: baseline") and "optim.adam_lr" in err
