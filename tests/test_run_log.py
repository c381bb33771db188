"""Run-directory writer: upstream-format progress lines, JSONL events, rank-0-only writes."""

import json
import math

import pytest

from track_1_short import run_log
from track_1_short.run_log import RunLog


def test_progress_line_has_the_upstream_format():
    assert (
        run_log.format_progress(25, 1194, 1234.4, 49.376) == "step:25/1194 train_time:1234ms step_avg:49.38ms"
    )
    assert (
        run_log.format_progress(1194, 1194, 39914.2, 33.43, val_loss=3.27731)
        == "step:1194/1194 val_loss:3.2773 train_time:39914ms step_avg:33.43ms"
    )


def test_parse_progress_inverts_format_and_ignores_other_lines():
    line = run_log.format_progress(1194, 1194, 39914.0, 33.43, val_loss=3.2773)
    assert run_log.parse_progress(line) == {
        "step": 1194,
        "total_steps": 1194,
        "train_time_ms": 39914.0,
        "step_avg_ms": 33.43,
        "val_loss": 3.2773,
    }
    assert run_log.parse_progress("step:3/10 train_time:5ms step_avg:1.67ms")["step"] == 3
    assert run_log.parse_progress("hello step:3/10") is None


def write_run(path, total=4, enabled=True):
    log = RunLog(path, enabled=enabled)
    log.write_config("seed: 1\n")
    log.write_env({"python": "3.11"})
    log.start(total_steps=total, seed=1, config={"seed": 1})
    for s in range(1, total + 1):
        log.train(
            s,
            total,
            loss=2.0 / s,
            lr_multiplier=1.0,
            tokens_seen=100 * s,
            train_time_ms=10.0 * s,
            step_avg_ms=10.0,
            progress_line=(s == total),
        )
    log.val(total, total, val_loss=1.5, train_time_ms=40.0, step_avg_ms=10.0)
    log.end(total, total, "finished", val_loss=1.5, train_time_ms=40.0)
    log.close()
    return path


def test_run_directory_holds_the_four_files_with_the_contract_fields(tmp_path):
    d = write_run(tmp_path / "run")
    assert sorted(p.name for p in d.iterdir()) == ["config.yaml", "env.json", "events.jsonl", "log.txt"]
    events = run_log.read_events(d)
    assert [e["event"] for e in events] == ["start"] + ["train"] * 4 + ["val", "end"]
    assert {"total_steps", "seed", "config"} <= events[0].keys()
    assert {"step", "loss", "lr_multiplier", "tokens_seen", "train_time_ms", "step_avg_ms"} <= events[
        1
    ].keys()
    assert {"step", "total_steps", "val_loss", "train_time_ms", "step_avg_ms"} <= events[-2].keys()
    assert {"step", "total_steps", "status", "val_loss", "train_time_ms"} <= events[-1].keys()
    assert run_log.is_finished(d)
    lines = (d / "log.txt").read_text().splitlines()
    progress = [p for x in lines if (p := run_log.parse_progress(x)) is not None]
    assert [p["step"] for p in progress] == [4, 4]
    assert progress[-1]["val_loss"] == 1.5
    # Throughput sits on its own line after the progress line: 400 tokens in 40 ms.
    assert lines[1].split() == ["tokens_seen:400", "tokens/s:10000", "(mean", "over", "the", "train", "time)"]


def test_run_without_final_val_is_not_finished(tmp_path):
    log = RunLog(tmp_path)
    log.start(total_steps=10, seed=0, config={})
    log.val(5, 10, 2.0, 1.0, 0.2)
    log.end(5, 10, "failed", val_loss=None, train_time_ms=1.0)
    log.close()
    assert not run_log.is_finished(tmp_path)


def test_disabled_log_writes_nothing(tmp_path):
    write_run(tmp_path / "rank1", enabled=False)
    assert not (tmp_path / "rank1").exists()


def test_non_finite_loss_is_logged_as_a_string_so_lines_stay_json(tmp_path):
    log = RunLog(tmp_path)
    log.train(1, 2, loss=math.nan, lr_multiplier=1.0, tokens_seen=1, train_time_ms=1.0, step_avg_ms=1.0)
    log.close()
    (line,) = (tmp_path / "events.jsonl").read_text().splitlines()
    assert json.loads(line)["loss"] == "nan"


def test_unknown_event_and_status_are_rejected(tmp_path):
    log = RunLog(tmp_path)
    with pytest.raises(ValueError, match="event"):
        log.event("bogus")
    with pytest.raises(ValueError, match="status"):
        log.end(1, 1, "done", 1.0, 1.0)


def test_environment_records_versions():
    env = run_log.environment()
    assert env["torch"] and env["python"] and env["devices"]


def test_record_gate_reads_what_the_run_log_writes(tmp_path):
    from tools import record_gate

    d = write_run(tmp_path / "run")
    for run in (record_gate.read_run_dir(d), record_gate.read_text_log(d / "log.txt")):
        assert run.finished and run.total_steps == 4 and run.final_loss == 1.5 and run.final_time_ms == 40.0
