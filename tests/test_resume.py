"""Resume that follows the run: every stop path prints a command, and that command, run as printed,
continues the run to the same bits as the run that was never stopped (its train loss at every step and its
final val loss, read from events.jsonl at full precision).

The runs are the command line's own (``track_1_short.train.cli``, in this process; a killed run in a child
process): the smoke record cut to 6 steps of 512 tokens on a small vocabulary, with a checkpoint every 2, so a
stop at step 3 leaves the checkpoint of step 2 and the resumed run crosses the stage transition (after 4).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from tests.faults_runs import SMALL_VOCAB
from track_1_short import resume, run_log, train, trainer
from track_1_short.config import ConfigError

pytestmark = pytest.mark.slow  # every test trains runs through the command line

ROOT = Path(__file__).resolve().parents[1]
SHORT = (
    "experiment=smoke_record",
    "schedule.stages.0.steps=4",
    "schedule.stages.1.steps=2",
    "schedule.stages.0.batch_tokens=512",
    "schedule.stages.1.batch_tokens=512",
    "schedule.rail_warmup_steps=2",
    "schedule.rail_cooldown_steps=2",
    "checkpoint.every=2",
    "data.val_tokens=512",
    "data.val_batch_tokens=512",
    *SMALL_VOCAB,
)
STOP_AT = 3  # steps complete when the run stops; the last checkpoint is step 2's


def _cli(capsys, monkeypatch, argv: list[str], stop: str | None = None) -> tuple[int, str]:
    """(exit status, stderr) of ``python -m track_1_short.train *argv`` run in this process; ``stop`` plants
    a crash or a Ctrl-C at step STOP_AT."""
    if stop is not None:
        real = trainer.Trainer.train_step

        def train_step(self, s, marks=None):
            if s == STOP_AT:
                raise RuntimeError("a crash planted") if stop == "crash" else KeyboardInterrupt
            return real(self, s, marks)

        monkeypatch.setattr(trainer.Trainer, "train_step", train_step)
    monkeypatch.setattr(sys, "argv", ["track_1_short.train", *argv])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    GlobalHydra.instance().clear()
    capsys.readouterr()
    try:
        train.cli()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        monkeypatch.undo()
    return code, capsys.readouterr().err


def _printed_command(text: str) -> list[str]:
    """The arguments of the last command the output names (after 'with: python -m track_1_short.train')."""
    line = [ln for ln in text.splitlines() if "with: python -m track_1_short.train" in ln][-1]
    argv = shlex.split(line.split("with: ", 1)[1])
    assert argv[:3] == ["python", "-m", "track_1_short.train"], line
    return argv[3:]


def _figures(run_dir: Path) -> tuple[dict[int, float], float]:
    """(train loss by step, final val loss) of the run as its directory holds it, a resumption's superseded
    steps replaced."""
    train_losses, val = {}, None
    for e in run_log.read_events(run_dir):
        if e["event"] == "train":
            train_losses[e["step"]] = e["loss"]
        elif e["event"] == "val" and e["step"] == e["total_steps"]:
            val = e["val_loss"]
    return train_losses, val


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    with pytest.MonkeyPatch.context() as mp:
        code, err = _cli(_Capture(), mp, [*SHORT, f"runs_root={root}", "run_name=ref"])
    assert code == 0, err[-3000:]
    return root / "ref"


class _Capture:
    """capsys for a module fixture (capsys itself is per test): the fixture needs no output."""

    def readouterr(self):
        return type("Out", (), {"err": ""})()


def _continues_bitwise(capsys, monkeypatch, argv: list[str], run_dir: Path, reference: Path) -> str:
    code, err = _cli(capsys, monkeypatch, argv)
    assert code == 0, err[-3000:]
    assert f"resumed at step 2 of 6 from {run_dir / 'checkpoints' / 'step_000002.pt'}" in err
    assert run_log.is_finished(run_dir)
    got, want = _figures(run_dir), _figures(reference)
    assert got[1] == want[1] and got[0].keys() == set(range(1, 7))
    assert got[0] == want[0]  # every step's loss, the ones after the resumption included
    return err


@pytest.mark.parametrize("mode", ["crash", "interrupt", "nan"])
def test_each_stop_prints_a_command_that_continues_the_run_bitwise(
    mode, reference, tmp_path, capsys, monkeypatch
):
    run_dir = tmp_path / "stopped"
    args = [*SHORT, f"runs_root={tmp_path}", "run_name=stopped"]
    if mode == "nan":
        faults = [f"fault_injection.nan_grad_step={STOP_AT}", "fault_injection.nan_grad_label=lm_head"]
        code, err = _cli(capsys, monkeypatch, args + faults)
        assert "non-finite gradient at step 3" in err
    else:
        code, err = _cli(capsys, monkeypatch, args, stop=mode)
    assert code == {"crash": 1, "interrupt": 130, "nan": 1}[mode], err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "step_000002.pt (step 2)" in lines[-1], err[-3000:]
    assert lines[-1].endswith(f"with: python -m track_1_short.train resume={run_dir}")
    # The stop is in log.txt too, with its reason.
    log = (run_dir / "log.txt").read_text()
    reason = {
        "crash": "RuntimeError: a crash planted",
        "interrupt": "interrupted (Ctrl-C)",
        "nan": "NonFinite",
    }
    assert f"stopped at step:{STOP_AT}/6: {reason[mode]}" in log
    argv = _printed_command(err)
    if mode == "nan":  # the run's own config injects the NaN again: an allowed override turns it off
        argv.append("fault_injection.nan_grad_step=-1")
    err = _continues_bitwise(capsys, monkeypatch, argv, run_dir, reference)
    # What the resumed run changed over its config.yaml is said on screen; nothing, when nothing was given.
    applied = [ln for ln in err.splitlines() if ln.startswith("resume: the settings of")]
    assert applied == (
        [f"resume: the settings of {run_dir / 'config.yaml'}, with fault_injection.nan_grad_step=-1"]
        if mode == "nan"
        else []
    )


def test_a_killed_run_is_named_by_the_next_start_with_a_command_that_continues_it_bitwise(
    reference, tmp_path, capsys, monkeypatch
):
    args = [*SHORT, f"runs_root={tmp_path}", "run_name=killed"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.stop_runs", "kill", str(STOP_AT), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == -9, out.stderr[-3000:]
    # The next start, the same command again: a note names the killed run, and the run directory is refused
    # with the same command.
    code, err = _cli(capsys, monkeypatch, args)
    assert code == 2, err[-3000:]
    notes = [ln for ln in err.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "stopped without an end (killed?)" in notes[0], err
    assert err.splitlines()[-1].endswith(f"with: python -m track_1_short.train resume={tmp_path / 'killed'}")
    _continues_bitwise(capsys, monkeypatch, _printed_command(notes[0]), tmp_path / "killed", reference)


def _asked(*overrides: str):
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))


GROUPS = [p.name for p in (ROOT / "configs").iterdir() if p.is_dir()]


def test_overrides_with_resume_apply_or_are_refused_each_named(reference):
    # The run's settings come from its config.yaml: nothing but resume= on the command line.
    alone = resume.follow(_asked(f"resume={reference}"), [f"resume={reference}"], GROUPS)
    assert (
        alone.schedule.stages[0].steps == 4 and alone.checkpoint.every == 2 and alone.model.vocab_size == 1024
    )
    # The command that started the run, repeated with resume=, changes nothing; an allowed override applies.
    same = [f"resume={reference}", *SHORT, "seed=0", "optim.adam_lr=0.004", "log_every=3"]
    followed = resume.follow(_asked(*same), same, GROUPS)
    assert followed.optim.adam_lr == 0.004 and followed.log_every == 3
    assert followed.schedule.stages[0].steps == 4
    # The preset alone would give it the preset's schedule and vocabulary, which it was not trained with.
    preset = [f"resume={reference}", "experiment=smoke_record"]
    with pytest.raises(ConfigError, match=r"experiment=smoke_record \(it changes model.vocab_size"):
        resume.follow(_asked(*preset), preset, GROUPS)
    # What cannot change is refused, each override named with the run's value.
    bad = [f"resume={reference}", "seed=7", "model.num_layers=4", "schedule=track1"]
    with pytest.raises(ConfigError) as info:
        resume.follow(_asked(*bad), bad, GROUPS)
    text = str(info.value)
    assert (
        "seed=7 (the run has seed=0)" in text
        and "model.num_layers=4 (the run has model.num_layers=8)" in text
    )
    assert "schedule=track1 (it changes schedule." in text and "resume= alone" in text


def test_the_command_line_refuses_a_frozen_override_with_exit_2_before_anything_runs(
    reference, capsys, monkeypatch
):
    before = (reference / "events.jsonl").read_bytes()
    code, err = _cli(capsys, monkeypatch, [f"resume={reference}", "seed=3"])
    assert code == 2 and "seed=3 (the run has seed=0)" in err, err[-2000:]
    assert "Traceback" not in err
    assert (reference / "events.jsonl").read_bytes() == before
