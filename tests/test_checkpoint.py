"""Atomic, label-keyed checkpoints: round trip, atomicity, finiteness, mismatches named before any change."""

import random

import numpy as np
import pytest
import torch

from track_1_short import checkpoint
from track_1_short.checkpoint import CheckpointError, NonFiniteError


class Labelled(torch.nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(width, 3))
        self.b = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
        self.a.label, self.b.label = "alpha", "beta"


def payload(model, step=3):
    return {
        "step": step,
        "model": checkpoint.model_state(model),
        "optimizer": {"alpha": {"exp_avg": torch.zeros(4, 3)}, "step": 7},
        "loader": {"cursor": 11},
        "rng": checkpoint.capture_rng(),
        "meta": {"total_steps": 9},
    }


def test_round_trip_restores_parameters_bitwise_in_place(tmp_path):
    src, dst = Labelled(), Labelled()
    path = checkpoint.save(tmp_path, payload(src))
    ptr = dst.a.data_ptr()
    loaded = checkpoint.load(tmp_path)
    checkpoint.load_model_state_(dst, loaded["model"])
    assert dst.a.data_ptr() == ptr  # copied in place: views and baked addresses survive
    assert torch.equal(dst.a.view(torch.int32), src.a.view(torch.int32))
    assert torch.equal(dst.b.view(torch.int16), src.b.view(torch.int16))
    assert loaded["step"] == 3 and loaded["loader"] == {"cursor": 11} and path.name == "step_000003.pt"


def test_latest_names_the_newest_complete_file_and_keep_last_prunes(tmp_path):
    m = Labelled()
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, payload(m, step), keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_000004.pt", "step_000006.pt"]
    assert checkpoint.resolve(tmp_path).name == "step_000006.pt"
    assert checkpoint.resolve(tmp_path.parent / tmp_path.name) == tmp_path / "step_000006.pt"


def test_partial_write_never_becomes_latest(tmp_path, monkeypatch):
    m = Labelled()
    checkpoint.save(tmp_path, payload(m, 2))

    def dies(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, payload(m, 4))
    monkeypatch.undo()
    assert checkpoint.resolve(tmp_path).name == "step_000002.pt"
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_000002.pt"]
    assert checkpoint.load(tmp_path)["step"] == 2


def test_non_finite_parameter_is_never_written(tmp_path):
    m = Labelled()
    with torch.no_grad():
        m.a[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="alpha"):
        checkpoint.save(tmp_path, payload(m))
    assert not list(tmp_path.iterdir())


def test_non_finite_optimizer_state_is_never_written(tmp_path):
    p = payload(Labelled())
    p["optimizer"]["alpha"]["exp_avg"][0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="exp_avg"):
        checkpoint.save(tmp_path, p)
    assert not list(tmp_path.iterdir())


def test_truncated_file_gets_a_clear_error(tmp_path):
    path = checkpoint.save(tmp_path, payload(Labelled()))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.load(path)


def test_foreign_model_is_rejected_before_any_parameter_changes(tmp_path):
    checkpoint.save(tmp_path, payload(Labelled(width=4)))
    other = Labelled(width=6)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match="alpha.*shape"):
        checkpoint.load_model_state_(other, checkpoint.load(tmp_path)["model"])
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    state = checkpoint.load(tmp_path)["model"]
    state["gamma"] = state.pop("beta")
    with pytest.raises(CheckpointError, match=r"missing \['beta'\], unknown \['gamma'\]"):
        checkpoint.load_model_state_(other, state)


def test_missing_resume_path_and_missing_latest_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        checkpoint.load(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="latest"):
        checkpoint.load(tmp_path)


def test_rng_states_round_trip():
    state = checkpoint.capture_rng()
    first = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.restore_rng(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_payload_without_required_keys_is_rejected(tmp_path):
    p = payload(Labelled())
    del p["loader"]
    with pytest.raises(CheckpointError, match="loader"):
        checkpoint.save(tmp_path, p)
