"""The canonical mask through the trainer: at the final validation only, and what the run logs and gates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.faults_runs import run_route, short_cfg
from track_1_short import corpus, trainer
from track_1_short.config import ConfigError, to_object
from track_1_short.model import canonical_mask, layers

ROOT = Path(__file__).resolve().parents[1]


def _shards_cfg(runs_root: str, *overrides: str):
    """The short config on its small corpus read as shards (data.kind=shards), as a FineWeb run reads."""
    shards = Path(corpus.run_paths(to_object(short_cfg(runs_root)).data)["val"]).parent
    return short_cfg(runs_root, "data.kind=shards", f"data.dir={shards}", *overrides)


def test_canonical_mask_on_the_synthetic_corpus_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="canonical_mask=true needs GPT-2-tokenized text") as err:
        to_object(short_cfg(str(tmp_path), "canonical_mask=true"))
    assert "\n" not in str(err.value) and "canonical_mask=false" in str(err.value)
    assert not any(tmp_path.iterdir())  # refused before a run directory exists


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory):
    """Six steps with a validation every two and a random mask over the small vocabulary (vocab 1024)."""
    root = tmp_path_factory.mktemp("masked")
    mp = pytest.MonkeyPatch()
    rng = np.random.default_rng(0)
    mask = rng.integers(0, 256, (1024, 128), dtype=np.uint8)
    mp.setattr(canonical_mask, "load_or_build", lambda d, vp: canonical_mask.Loaded(mask, Path(d), True, 0.5))
    applied_at: list[int] = []
    current = [-1]
    real_validate, real_fill = trainer.Trainer.validate, layers._mask_non_canonical_

    def validate(self, max_batches=None, masked=False):
        current[0] = self.step
        return real_validate(self, max_batches, masked)

    def fill(logits, mask, prev):
        applied_at.append(current[0])
        return real_fill(logits, mask, prev)

    mp.setattr(trainer.Trainer, "validate", validate)
    mp.setattr(layers, "_mask_non_canonical_", fill)
    try:
        cfg = _shards_cfg(str(root), "canonical_mask=true", "val_every=2")
        r = trainer.run(cfg)
    finally:
        mp.undo()
    events = [json.loads(line) for line in (r.run_dir / "events.jsonl").read_text().splitlines()]
    return {"result": r, "applied_at": applied_at, "events": events, "mask": mask, "cfg": cfg}


@pytest.mark.slow
def test_the_mask_applies_at_the_final_validation_only(masked_run):
    vals = [e for e in masked_run["events"] if e["event"] == "val"]
    assert [e["step"] for e in vals] == [2, 4, 6]
    assert masked_run["applied_at"] and set(masked_run["applied_at"]) == {6}
    assert "val_loss_masked" not in vals[0] and "val_loss_masked" not in vals[1]


@pytest.mark.slow
def test_the_final_validation_reports_both_losses_and_the_gate_reads_the_masked_one(masked_run):
    r = masked_run["result"]
    final = [e for e in masked_run["events"] if e["event"] == "val"][-1]
    assert final["gate_reads"] == "val_loss_masked"
    assert final["val_loss"] == final["val_loss_masked"] == r.val_loss
    assert final["val_loss_unmasked"] != final["val_loss_masked"]
    log = (r.run_dir / "log.txt").read_text()
    assert f"val_loss_masked:{final['val_loss_masked']:.4f}" in log
    assert f"val_loss_unmasked:{final['val_loss_unmasked']:.4f}" in log
    assert "the record gate reads val_loss = val_loss_masked" in log
    steps = [line for line in log.splitlines() if line.startswith("step:")]
    assert steps[-1].startswith(f"step:6/6 val_loss:{final['val_loss_masked']:.4f} ")  # what the gate parses
    phase = [e for e in masked_run["events"] if e["event"] == "phase" and e["name"] == "canonical_mask"]
    assert phase and phase[0]["built"] and phase[0]["build_s"] == 0.5
    from tools import record_gate

    for run in (record_gate.read_run_dir(r.run_dir), record_gate.read_text_log(r.run_dir / "log.txt")):
        assert run.finished and run.final_loss == pytest.approx(final["val_loss_masked"], abs=5e-5)


@pytest.mark.slow
def test_the_masked_final_loss_is_the_restated_masked_loss_of_the_final_weights(masked_run):
    """The logged losses are those of the final weights with and without the mask set on the model."""
    t = masked_run["result"].trainer
    with run_route(masked_run["cfg"]):  # the run's bf16 matmul route: the same roundings
        unmasked = t.validate()
        t.model.canonical_mask = torch.from_numpy(masked_run["mask"])
        try:
            masked = t.validate()
        finally:
            t.model.canonical_mask = None
    final = [e for e in masked_run["events"] if e["event"] == "val"][-1]
    assert (masked, unmasked) == (final["val_loss_masked"], final["val_loss_unmasked"])


def test_the_gate_reads_the_loss_the_final_event_names(tmp_path):
    from tools import record_gate

    def run_with(**final):
        events = [
            {"event": "start", "total_steps": 2, "seed": 0, "config": {}},
            {"event": "val", "step": 2, "total_steps": 2, "train_time_ms": 1.0, "step_avg_ms": 0.5, **final},
        ]
        path = tmp_path / "events.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        return record_gate.read_events(path, "r")

    assert run_with(val_loss=3.0, val_loss_masked=2.9, gate_reads="val_loss_masked").final_loss == 2.9
    assert run_with(val_loss=3.0).final_loss == 3.0  # a log without the field: val_loss, as before
    with pytest.raises(record_gate.RecordGateInputError, match="'gate_reads' names 'val_loss_masked'"):
        run_with(val_loss=3.0, gate_reads="val_loss_masked")
