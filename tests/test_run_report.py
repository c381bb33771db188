"""The end of a run (track_1_short/run_report.py, curves.py, tools/compare_runs.py): the summary in log.txt,
curves.png, the overlay of several runs, and the paragraph a Ctrl-C prints."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from tests.faults_runs import short_cfg
from track_1_short import curves, run_log, trainer
from track_1_short.run_report import RunInterrupted

ROOT = Path(__file__).resolve().parents[1]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


EXPECTED_PNG = (round(curves.FIGSIZE_IN[0] * curves.DPI), round(curves.FIGSIZE_IN[1] * curves.DPI))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return [trainer.run(short_cfg(str(root), f"run_name=s{seed}", f"seed={seed}")) for seed in (0, 1)]


def test_every_run_ends_with_curves_png_of_the_expected_size(two_runs):
    for r in two_runs:
        assert png_size(r.run_dir / "curves.png") == EXPECTED_PNG


def test_curves_hold_every_step_and_the_corpus_reference_lines(two_runs):
    r = two_runs[0]
    run = curves.read_curves(r.run_dir)
    assert [s for s, _ in run.train] == list(range(1, 7)) and [v for _, v in run.train] == r.train_losses
    assert run.val == [(6, r.val_loss)]
    refs = run.summary["references"]
    assert sorted(refs.values()) == sorted([r.corpus["entropy_floor"], r.corpus["unigram_entropy"]])


def test_fineweb_runs_are_drawn_against_the_record_target():
    assert curves.reference_lines({}, "shards", None) == {"record target": 3.28}


def test_summary_is_printed_and_also_in_log_txt_with_tokens_per_second(two_runs):
    r = two_runs[0]
    text = (r.run_dir / "log.txt").read_text().splitlines()
    assert r.summary and text[-len(r.summary) :] == r.summary
    assert f"final val loss {r.val_loss:.4f}" in r.summary[0]
    seconds = r.train_time_ms / 1e3
    assert f"{r.trainer.tokens_seen / seconds:,.0f} tokens/s" in r.summary[1]
    assert run_log.read_events(r.run_dir)[-1]["event"] == "summary"


def test_compare_runs_overlays_runs_and_prints_their_figures_side_by_side(two_runs, tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    from tools import compare_runs

    out = tmp_path / "compare.png"
    assert compare_runs.main([str(r.run_dir) for r in two_runs] + ["--out", str(out)]) == 0
    assert png_size(out) == EXPECTED_PNG
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["s0", "s1"]
    val_row = next(line for line in printed if line.startswith("final val loss"))
    assert val_row.split()[-2:] == [f"{r.val_loss:.4f}" for r in two_runs]
    assert compare_runs.main([str(two_runs[0].run_dir)]) == 2  # one run is nothing to compare
    # Each run labelled by what sets it apart, and that difference printed.
    assert "config difference:" in printed and "  seed: s0=0, s1=1" in printed
    runs = [curves.read_curves(r.run_dir) for r in two_runs]
    differ = curves.config_difference(runs)
    assert list(differ) == ["seed"]  # run_name and runs_root are where a run lives
    assert compare_runs.label(runs[1], 1, differ) == "s1 (seed=1)"


def test_compare_runs_does_not_overwrite_a_plot_without_force(two_runs, tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    from tools import compare_runs

    out = tmp_path / "compare.png"
    out.write_bytes(b"mine")
    dirs = [str(r.run_dir) for r in two_runs]
    assert compare_runs.main([*dirs, "--out", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err and out.read_bytes() == b"mine"
    assert compare_runs.main([*dirs, "--out", str(out), "--force"]) == 0
    assert png_size(out) == EXPECTED_PNG


def _curves(train, mtp, val=(), total=100) -> curves.Curves:
    return curves.Curves("r", train=list(train), mtp=dict(mtp), val=list(val), total_steps=total)


def test_the_mtp_weighted_train_loss_is_drawn_apart_and_the_y_axis_fits_the_rest():
    # Steps 1-20 carry a second target (weight sum 1.5): their loss is the weighted sum, above ln V.
    train = [(s, 11.5 - 0.2 * s if s <= 20 else 3.0 - 0.01 * s) for s in range(1, 101)]
    run = _curves(train, {s: 1.5 if s <= 20 else 1.0 for s in range(1, 101)}, val=[(100, 2.1)])
    nexttoken, summed = curves.split_train(run)
    assert [s for s, _ in summed] == list(range(1, 21)) and [s for s, _ in nexttoken] == list(range(21, 101))
    low, high = curves.y_range([run], {"floor": 0.9, "unigram": 7.36})
    assert low < 0.9 and 7.36 < high < 7.36 * 1.1  # the references and next-token losses, not the 11.5
    # A run without logged weights (an older run) is next-token throughout, and its first 5% of steps are
    # left out of the range.
    old = _curves([(1, 10.8), (50, 3.0), (100, 2.0)], {})
    assert curves.split_train(old) == (old.train, [])
    assert curves.y_range([old], {})[1] < 3.1


def test_the_trainer_logs_each_steps_mtp_weight_sum(two_runs):
    run = curves.read_curves(two_runs[0].run_dir)
    assert sorted(run.mtp) == [s for s, _ in run.train] and set(run.mtp.values()) == {1.0}  # one target


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path, monkeypatch):
    real = trainer.Trainer.train_step

    def interrupted(self, step):
        if step == 5:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(trainer.Trainer, "train_step", interrupted)
    with pytest.raises(RunInterrupted) as info:
        trainer.run(short_cfg(str(tmp_path), "checkpoint.every=2", "run_name=r"))
    text = info.value.paragraph()
    run_dir = tmp_path / "r"
    assert "\n" not in text and "interrupted at step 5 of 6" in text
    assert str(run_dir / "checkpoints" / "step_000004.pt") in text
    # The run's settings are in its config.yaml: resume= alone continues it.
    assert text.endswith(f"python -m track_1_short.train resume={run_dir}")


def test_ctrl_c_without_a_checkpoint_says_the_run_cannot_be_continued(tmp_path, monkeypatch):
    def interrupted(self, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.Trainer, "train_step", interrupted)
    with pytest.raises(RunInterrupted) as info:
        trainer.run(short_cfg(str(tmp_path), "run_name=r"))
    assert "No checkpoint was written" in info.value.paragraph()
