"""Checks before step 0 (track_1_short/preflight.py): damaged shards, run directories, resume refusals.

Every refused start here must leave the file system as it was: no run directory appears, and an existing
run's files keep their bytes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.faults_runs import short_cfg
from track_1_short import checkpoint, curves, data, trainer
from track_1_short.checkpoint import CheckpointError
from track_1_short.preflight import RunDirError

ROOT = Path(__file__).resolve().parents[1]
VOCAB, BOS = 1024, 1023  # faults_runs.short_cfg's small vocabulary


def write_corpus(d: Path, train_shards: int = 2, val_tokens: int = 4096) -> Path:
    rng = np.random.default_rng(0)
    d.mkdir(parents=True)

    def tokens(n):
        t = rng.integers(0, BOS, size=n)
        t[::300] = BOS  # documents of 300 tokens
        return t

    for i in range(1, train_shards + 1):
        data.write_shard(d / f"t_train_{i:06d}.bin", tokens(8192), VOCAB)
    data.write_shard(d / "t_val_000000.bin", tokens(val_tokens + 1), VOCAB)
    return d


def shard_cfg(corpus: Path, runs: Path, *overrides: str):
    return short_cfg(
        str(runs),
        "data.kind=shards",
        f"data.dir={corpus}",
        "data.train_pattern=t_train_*.bin",
        "data.val_pattern=t_val_*.bin",
        "run_name=r",
        *overrides,
    )


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _bad_magic(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[0] ^= 0xFF
    path.write_bytes(bytes(b))


def _longer(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0\0")


def _header_only(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: data.HEADER_BYTES - 4])


@pytest.fixture
def never_trains(monkeypatch):
    """Fail loudly if a step runs or the model is built: a preflight refusal must come before both."""

    def refuse(*_a, **_k):
        raise AssertionError("the run got past preflight")

    monkeypatch.setattr(trainer.Trainer, "train_step", refuse)
    monkeypatch.setattr("track_1_short.model.gpt.GPT.__init__", refuse)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_truncate, "truncated: byte offset 8 declares"),
        (_bad_magic, "magic number"),
        (_longer, "longer than its header says"),
        (_header_only, "shorter than the 1024-byte header"),
    ],
)
def test_damaged_val_shard_is_refused_before_step_0_and_writes_no_run_directory(
    tmp_path, never_trains, damage, match
):
    corpus = write_corpus(tmp_path / "corpus")
    damage(corpus / "t_val_000000.bin")
    with pytest.raises(data.ShardError, match=match) as info:
        trainer.run(shard_cfg(corpus, tmp_path / "runs"))
    assert "t_val_000000.bin" in str(info.value)
    assert not (tmp_path / "runs").exists()


def test_val_shard_shorter_than_the_validation_is_refused_before_step_0(tmp_path, never_trains):
    corpus = write_corpus(tmp_path / "corpus", val_tokens=256)  # the config validates 512 tokens
    with pytest.raises(data.ShardError, match=r"holds 257 tokens; validating data.val_tokens=512 needs 513"):
        trainer.run(shard_cfg(corpus, tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()


def test_damaged_later_train_shard_is_refused_before_step_0(tmp_path, never_trains):
    # The loader opens only the first shard at the start; the second would fail mid-run.
    corpus = write_corpus(tmp_path / "corpus", train_shards=3)
    _truncate(corpus / "t_train_000002.bin")
    with pytest.raises(data.ShardError, match="t_train_000002.bin"):
        trainer.run(shard_cfg(corpus, tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()


# -- run directories and resume --
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run with checkpoints after steps 2 and 4."""
    root = tmp_path_factory.mktemp("runs")
    return trainer.run(short_cfg(str(root), "checkpoint.every=2", "run_name=ref"))


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_name_that_holds_a_run_is_refused_and_its_files_keep_their_bytes(finished):
    root, before = finished.run_dir.parent, snapshot(finished.run_dir)
    with pytest.raises(RunDirError, match=r"already holds a run.*resume="):
        trainer.run(short_cfg(str(root), "run_name=ref"))
    assert snapshot(finished.run_dir) == before


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("seed=5", "seed (the run has 0, this command 5)"),
        ("schedule.lr_floor=0.2", "schedule (fields ['lr_floor'])"),
        ("model.mlp_hidden=256", "model (fields ['mlp_hidden'])"),
    ],
)
def test_resume_refuses_settings_that_cannot_change_naming_them_and_writes_nothing(finished, override, named):
    root = finished.run_dir.parent
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(CheckpointError, match="cannot change on resume") as info:
        trainer.run(
            short_cfg(str(root), f"resume={finished.run_dir}/checkpoints", "run_name=branch", override)
        )
    assert named in str(info.value)
    assert sorted(p.name for p in root.iterdir()) == before  # no stray directory


def test_resume_into_a_finished_run_is_refused(finished):
    root, before = finished.run_dir.parent, snapshot(finished.run_dir)
    with pytest.raises(RunDirError, match="has finished"):
        trainer.run(short_cfg(str(root), f"resume={finished.run_dir}"))
    assert snapshot(finished.run_dir) == before


def test_unreadable_checkpoint_is_one_line_without_torchs_advice(finished, tmp_path):
    bad = tmp_path / "step_000002.pt"
    bad.write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError) as info:
        trainer.run(short_cfg(str(tmp_path / "runs"), f"resume={bad}", "run_name=x"))
    message = str(info.value)
    assert "\n" not in message and "weights_only" not in message and str(bad) in message
    assert not (tmp_path / "runs").exists()


def test_resume_continues_in_the_runs_own_directory_after_a_marked_resumption(finished, tmp_path):
    # A copy of the finished run cut back to what a kill after step 5 leaves: steps 1..5 logged, no val.
    cut = tmp_path / "cut"
    shutil.copytree(finished.run_dir, cut)
    lines = (cut / "events.jsonl").read_text().splitlines(keepends=True)
    keep = [x for x in lines if '"event": "train", "step": 6' not in x and '"event": "val"' not in x]
    (cut / "events.jsonl").write_text(
        "".join(x for x in keep if '"event": "end"' not in x and "summary" not in x)
    )
    (cut / "log.txt").write_text("".join(x for x in (cut / "log.txt").read_text().splitlines(True)[:3]))
    config_before = (cut / "config.yaml").read_bytes()
    resumed = trainer.run(short_cfg(str(tmp_path), f"resume={cut}"))
    assert resumed.run_dir == cut
    assert (cut / "config.yaml").read_bytes() == config_before  # the run's config, not rewritten
    assert "resumed at step:4/6 from " in (cut / "log.txt").read_text()
    run = curves.read_curves(cut)
    assert [s for s, _ in run.train] == [1, 2, 3, 4, 5, 6]  # step 5's first try is superseded
    assert run.train[4][1] == finished.train_losses[4]  # bitwise: the continued run is the same run
    sys.path.insert(0, str(ROOT))
    from tools import record_gate

    gate = record_gate.read_run_dir(cut)
    assert gate.finished and gate.final_loss == resumed.val_loss == finished.val_loss
    assert [p.name for p in tmp_path.iterdir()] == ["cut"]  # nothing else was created


def test_cpu_threads_from_the_config_apply_at_the_start_of_a_run(finished):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RunDirError):  # refused after the threads are set, before anything is written
            trainer.run(short_cfg(str(finished.run_dir.parent), "run_name=ref", "cpu_threads=1"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_checkpoint_records_what_a_resume_may_not_change(finished):
    meta = checkpoint.load(finished.run_dir / "checkpoints", mmap=True)["meta"]
    assert meta["seed"] == 0 and meta["run_dir"] == str(finished.run_dir)
    assert meta["schedule"]["stages"][0]["steps"] == 4  # faults_runs.STEPS
