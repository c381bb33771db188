"""ANVIL's per-step bank scalars in one upload: one host row for every bank, one non-blocking copy per step.

What it replaces (:meth:`track_1_short.optim.anvil_bank.AnvilBank.stage`, the reference the tests call; no
switch, as no run would choose the slower path): in ``AnvilAndAdam.set_schedule``, at the start of every
step, each bank (3 in the track-1 model) builds a tensor from a Python list and copies it to the
device with ``non_blocking=False``. From pageable memory torch follows that copy with a stream
synchronisation, so the host waits, once per bank, until the GPU has run everything queued before it: the
host cannot queue a step while the previous one still runs.

Why it is faster: every bank's ``scalars`` is a slice of one fp32 device buffer (4 + chunk values a bank:
100 for the track-1 banks on one GPU), filled from one host row through one copy. On CUDA the row is pinned
and the copy non-blocking, so ``set_schedule`` costs a NumPy fill and one queued copy, and never waits for
the GPU.

The pinned-buffer race, and the choice: a non-blocking copy reads its host buffer when the GPU reaches it, not
when it is queued, so the host must not rewrite that buffer before the copy ran, or the copy uploads a later
step's values. The row goes up through :class:`track_1_short.perf.replicated_adam.UploadRing` (already used,
and tested, for the replicated-Adam table): a ring of ``BANK_SCALAR_SLOTS`` pinned rows, each with an event
recorded after its copy; before a row is rewritten the host waits on its event. Against a double buffer with
one event, the ring lets the host run several steps ahead before that wait could block; against a fresh pinned
tensor per step, it allocates nothing per step (a pinned allocation can cost more than the copy it feeds).

Invariants (tests/perf/test_bank_scalars.py):
1. Each bank's view is ``scalars_size(chunk)`` long, at its offset in bank order; the views tile the buffer.
2. One ``stage()``: one upload of the whole row; afterwards each view holds bitwise what ``AnvilBank.stage``
   writes for the same values (so both paths train the same parameters and state, bitwise).
3. A host row is rewritten only after its event says its previous upload retired (CUDA: pinned rows and CUDA
   events; on the CPU one row and a plain, synchronous copy, or a ring when given an ``event_factory``).

Provenance: the upstream track-1 record #360: ``stage_bank_scalars`` into a ``BankScalarStaging`` device
buffer, one pinned row and one non-blocking H2D per step (16 event-guarded slots).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from track_1_short.perf.replicated_adam import UploadRing

# Pinned rows in the ring. Each step stages once and the host runs only a few steps ahead of the GPU (the
# depth of the CUDA launch queue bounds it), so the wait on a row's event returns at once; it only guards
# against rewriting a row whose copy has not run yet. Upstream uses 16.
BANK_SCALAR_SLOTS = 8


class BankScalarStaging:
    """One fp32 device buffer holding every bank's ``scalars``, uploaded from one host row per step.

    ``sizes``: label -> length of that bank's scalars (``anvil_bank.scalars_size(chunk)``), in bank order;
    ``event_factory``: builds the ring's events (CUDA events by default on CUDA; anything with ``record()``
    and ``synchronize()``, for tests on the CPU).
    """

    def __init__(
        self,
        sizes: Mapping[str, int],
        device: torch.device | str,
        slots: int = BANK_SCALAR_SLOTS,
        event_factory: Callable[[], object] | None = None,
    ):
        self._spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for label, size in sizes.items():
            self._spans[label] = (offset, int(size))
            offset += int(size)
        self.buffer = torch.zeros(offset, dtype=torch.float32, device=device)
        self._ring = UploadRing(self.buffer, slots=slots, event_factory=event_factory)

    def view(self, label: str) -> torch.Tensor:
        """Bank ``label``'s scalars: a slice of :attr:`buffer` (never rebound, so its address is fixed)."""
        start, size = self._spans[label]
        return self.buffer[start : start + size]

    def stage(self, rows: Mapping[str, Sequence[float]]) -> None:
        """Write every bank's row (``anvil_bank.scalar_row``) into the host row and upload it once."""
        if rows.keys() != self._spans.keys():
            raise ValueError(f"stage: rows for {sorted(rows)}, the staging holds {sorted(self._spans)}.")
        for label, row in rows.items():
            if len(row) != self._spans[label][1]:
                raise ValueError(
                    f"stage: {label!r} has {len(row)} values, its scalars {self._spans[label][1]}."
                )
        host = self._ring.host_buffer()  # waits until this row's previous upload has run
        # Python floats -> fp32 by NumPy's cast: to nearest even, as torch.tensor rounds in AnvilBank.stage
        for label, row in rows.items():
            start, size = self._spans[label]
            host[start : start + size] = row
        self._ring.upload()
