"""The run's endgame: the canonical mask loaded at build time, the tail-averaged weights shipped on the clock,
and the final validation and what it reports.

The final validation's ``val`` event and its ``step:M/M val_loss:X`` line carry the loss the record gate
reads (tools/record_gate.py): the canonical-masked one when ``canonical_mask`` is on, else the unmasked one.
The event names it in ``gate_reads`` and holds the others beside it (``val_loss_unmasked``,
``val_loss_masked``, and with tail averaging ``val_loss_last_iterate``, the unmasked loss of the weights
before the ship); log.txt has the same on a line before the progress line.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from track_1_short import distributed

if TYPE_CHECKING:
    from track_1_short.trainer import Trainer


def load_canonical_mask(trainer: Trainer) -> torch.Tensor:
    """The mask on the run's device, on every rank: rank 0 loads it from the cache (or builds it there) and
    broadcasts it; a phase event says which, where, and how long it took."""
    from track_1_short.model import canonical_mask

    vp = trainer.model.topo.vocab_padded
    out = torch.zeros(vp, vp // 8, dtype=torch.uint8, device=trainer.device)
    outcome: tuple = ("ok", None)
    if distributed.is_main():
        try:
            loaded = canonical_mask.load_or_build(trainer.cfg.canonical_mask_dir, vp)
            out.copy_(torch.from_numpy(loaded.mask))
            outcome = ("ok", (loaded.built, loaded.seconds, str(loaded.path)))
        except (ValueError, OSError) as e:
            outcome = ("error", e)
    outcome = distributed.broadcast_object(outcome)  # every rank raises the same error, none hangs
    if outcome[0] == "error":
        raise outcome[1]
    t = time.perf_counter()
    distributed.broadcast_(out, src=0)
    built, seconds, path = outcome[1]
    trainer.phases.finished(
        "canonical_mask",
        seconds + time.perf_counter() - t,
        built=built,
        build_s=round(seconds, 3) if built else None,
        path=path,
    )
    return out


def ship_tail(trainer: Trainer) -> dict:
    """Validate the last iterate (off the clock), then ship the tail averages with their time on the clock;
    returns the fields the final validation reports beside its own."""
    last = trainer.validate()
    _sync(trainer.device)
    t = time.perf_counter()
    ratios = trainer.tail.ship()
    _sync(trainer.device)
    seconds = time.perf_counter() - t
    trainer.train_time_ms += 1e3 * seconds
    trainer.phases.finished("tail_ship", seconds, norm_ratios={k: round(v, 6) for k, v in ratios.items()})
    return {"val_loss_last_iterate": last}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def final_validation(trainer: Trainer, step: int, total_steps: int, extra: dict | None = None) -> float:
    """Validate the final weights, log the losses side by side, and return the one the record gate reads.
    ``extra``: fields the caller measured before (the last iterate's loss when tail averaging shipped)."""
    fields = dict(extra or {})
    unmasked = trainer.validate()
    gated, reads = unmasked, "val_loss_unmasked"
    fields["val_loss_unmasked"] = unmasked
    if trainer.canonical_mask is not None:
        gated = trainer.validate(masked=True)
        fields["val_loss_masked"] = gated
        reads = "val_loss_masked"
    fields["gate_reads"] = reads
    fields["weights"] = "tail-averaged" if trainer.tail is not None else "last iterate"
    parts = [f"{k}:{v:.4f}" for k, v in fields.items() if k.startswith("val_loss_")]
    trainer.log.text(
        f"final validation ({fields['weights']} weights): {' '.join(parts)}; "
        f"the record gate reads val_loss = {reads}"
    )
    ms = trainer.train_time_ms
    trainer.log.val(step, total_steps, gated, ms, ms / step, **fields)
    return gated
