"""The cyclic garbage collector out of the timed loop: collect and freeze before the clock, off during it.

What it replaces (``gc_freeze=false`` keeps Python's default): the collector running whenever allocations of
container objects outnumber deallocations by ``gc.get_threshold()[0]`` (700 on CPython 3.11). A training step
allocates many short-lived containers (autograd nodes, tensor wrappers, the schedule's plan), so generation 0
is collected several times a step, and every 10th and 100th pass also walks the older generations, which
after the model, optimizer and compiled graphs are built hold every long-lived object of the run: a host pause
that grows with the live object count, at steps nobody chose, while the GPU may wait for the next launch.

Why it is faster: ``gc.collect()`` once, then ``gc.freeze()`` moves every surviving object into the permanent
generation (never walked again), and ``gc.disable()`` stops the automatic passes for the loop: no collector
pause on the clock. What a step frees is still freed by reference counting; only reference cycles made during
the loop wait until it ends, so the run's peak memory with the switch on and off is part of its measurement
(perf/RESULTS.md).

Invariants (tests/test_frozen_gc.py, tests/test_train.py):
1. Between :func:`freeze_gc` and :func:`restore_gc` the collector is disabled.
2. :func:`restore_gc` puts back the collector's enabled flag and, when the freeze was ours (no object was
   frozen before), unfreezes what it froze; the trainer calls it in a ``finally``, so an exception in the loop
   restores it too.
3. The switch changes no result: a run with it on and off trains bitwise the same parameters.

Provenance: the upstream track-1 record calls ``gc.collect()``, ``gc.freeze()`` and ``gc.disable()`` after its
warmup and in-place reset, right before its clock starts.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass


@dataclass(frozen=True)
class GcState:
    """What :func:`restore_gc` puts back: the collector's flag and whether the freeze was ours to undo."""

    was_enabled: bool
    froze: bool


def freeze_gc() -> GcState:
    """Collect, freeze the survivors and disable the collector; returns what :func:`restore_gc` needs."""
    state = GcState(was_enabled=gc.isenabled(), froze=gc.get_freeze_count() == 0)
    gc.collect()
    gc.freeze()
    gc.disable()
    return state


def restore_gc(state: GcState | None) -> None:
    """Undo :func:`freeze_gc` (None: it did not run, nothing to undo).

    An earlier freeze (someone else's, made before ours) cannot be undone in part, so then the objects frozen
    by both stay frozen; only the collector's flag is restored."""
    if state is None:
        return
    if state.froze:
        gc.unfreeze()
    if state.was_enabled:
        gc.enable()
    else:
        gc.disable()
