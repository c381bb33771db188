"""The provenance every bench JSON carries (perf/bench_meta.py) and its refusal of bad ones."""

import json
import os
import shlex
import sys

import pytest
import torch

from perf.bench_meta import (
    REPO_ROOT,
    REQUIRED_KEYS,
    bench_metadata,
    check_bench_payload,
    command_line,
    write_bench_json,
)


def test_metadata_has_every_key_results_needs_but_rows():
    meta = bench_metadata([str(REPO_ROOT / "perf" / "bench_x.py"), "--out", "a.json"], "cpu")
    assert set(REQUIRED_KEYS) - {"rows"} <= set(meta)
    assert meta["torch"] == torch.__version__
    assert meta["device"].startswith("cpu")


def test_command_is_relative_to_the_checkout_and_shell_quoted():
    cmd = command_line([str(REPO_ROOT / "perf" / "bench_x.py"), "--note", "two words"])
    words = shlex.split(cmd)
    assert words[1:] == ["perf/bench_x.py", "--note", "two words"]
    assert words[0] == os.path.basename(sys.executable)


def test_command_keeps_an_outside_script_absolute(tmp_path):
    script = tmp_path / "elsewhere.py"
    assert shlex.split(command_line([str(script)]))[1] == str(script.resolve())


def test_command_needs_the_script_path():
    with pytest.raises(ValueError, match="argv is empty"):
        command_line([])


def test_date_is_utc_iso8601():
    date = bench_metadata(["x.py"], "cpu")["date"]
    assert date.endswith("+00:00") and date[4] == "-" and date[10] == "T"


def test_write_round_trips_and_leaves_no_temporary(tmp_path):
    payload = {**bench_metadata(["x.py"], "cpu"), "rows": [{"a": 1, "a_floor": 0.5}], "notes": ["n"]}
    path = write_bench_json(tmp_path / "sub" / "r.json", payload)
    assert json.loads(path.read_text()) == payload
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


@pytest.mark.parametrize("missing", REQUIRED_KEYS)
def test_write_refuses_a_payload_without_a_required_key_before_writing(tmp_path, missing):
    payload = {**bench_metadata(["x.py"], "cpu"), "rows": []}
    del payload[missing]
    with pytest.raises(ValueError, match=f"missing key\\(s\\) {missing}"):
        write_bench_json(tmp_path / "r.json", payload)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows": {"a": 1}}, "'rows' must be a list of objects"),
        ({"rows": [1, 2]}, "'rows' must be a list of objects"),
        ({"notes": "one string"}, "'notes' must be a list of strings"),
    ],
)
def test_check_refuses_malformed_rows_and_notes(change, message):
    payload = {**bench_metadata(["x.py"], "cpu"), "rows": [], **change}
    with pytest.raises(ValueError, match=message):
        check_bench_payload(payload, "src.json")


def test_check_refuses_a_non_object_naming_the_source():
    with pytest.raises(ValueError, match="src.json: a bench result must be a JSON object, got list"):
        check_bench_payload([], "src.json")


def test_write_refuses_nan_naming_where(tmp_path):
    payload = {**bench_metadata(["x.py"], "cpu"), "rows": [{"mfu_pct": float("nan")}]}
    with pytest.raises(ValueError, match=r"payload\.rows\[0\]\.mfu_pct is nan"):
        write_bench_json(tmp_path / "r.json", payload)
    assert not (tmp_path / "r.json").exists()


def test_git_commit_from_the_environment_wins_over_the_checkout(monkeypatch):
    # A GPU machine's copy of the tree may carry a stale .git: run_gpu.sh's GIT_COMMIT names the real one.
    monkeypatch.setenv("GIT_COMMIT", "0123abc")
    assert bench_metadata(["perf/bench_x.py"])["git_commit"] == "0123abc"
    monkeypatch.delenv("GIT_COMMIT")
    assert bench_metadata(["perf/bench_x.py"])["git_commit"] != "0123abc"
