"""``--help`` lists the groups, the presets and every config field with its docstring; ``--cfg job``
resolves interpolations."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from track_1_short import help as cli_help
from track_1_short import train
from track_1_short.config import CheckpointConfig, TrainConfig, schema_paths

ROOT = Path(__file__).resolve().parents[1]
FIELD = re.compile(r"^  ([a-z_][\w.]*) +=")  # "  key = value"; its docstring follows, indented by 8


def _help(capsys, monkeypatch, *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["track_1_short.train", *args])
    with pytest.raises(SystemExit) as info:
        train.cli()
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_names_each_fields_docstring_and_the_default_runs_value(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "--help")
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split("=")[0].strip() == "checkpoint.every")
    assert lines[at].split("=")[1].strip() == "0"
    assert lines[at + 1].strip().startswith("Write a checkpoint every this many completed steps")
    # The value is the default run's (model=tiny on the compact vocabulary), not the schema's.
    vocab = next(line for line in lines if line.split("=")[0].strip() == "model.vocab_size")
    assert vocab.split("=")[1].strip() == "2176"
    # Every leaf field of the schema is listed, each with a docstring.
    fields = [i for i, line in enumerate(lines) if FIELD.match(line)]
    listed = {FIELD.match(lines[i])[1] for i in fields}
    leaves = {p for p in schema_paths() if not any(q.startswith(p + ".") for q in schema_paths())}
    assert leaves <= listed, sorted(leaves - listed)
    for i in fields:
        assert lines[i + 1].startswith("        ") and lines[i + 1].strip(), lines[i]


def test_help_lists_every_group_and_preset(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "-h")
    for group in (ROOT / "configs").iterdir():
        if group.is_dir():
            assert f"  {group.name}:" in text
            for option in group.glob("*.yaml"):
                assert f"    {option.stem} " in text, option
    assert "--cfg job" in text


def test_attribute_docstrings_are_read_from_the_schema():
    docs = cli_help.attribute_docs(CheckpointConfig)
    assert docs["keep_last"].startswith("Keep only the newest this many checkpoints")
    assert cli_help.attribute_docs(TrainConfig)["seed"].startswith("Seed of the model init")
    assert cli_help.first_sentence("One, e.g. two. Three.") == "One, e.g. two."


@pytest.mark.slow
def test_cfg_job_prints_interpolations_resolved():
    out = subprocess.run(
        [sys.executable, "-m", "track_1_short.train", "--cfg", "job"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "${" not in out.stdout and "vocab_size: 2176" in out.stdout
