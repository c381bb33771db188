"""ANVIL's per-bank update as one compiled graph a bank (``OptimConfig.bank_update = "compiled"``).

What it replaces (``"eager"``): :func:`track_1_short.optim.anvil_bank.bank_update_` run op by op. For one bank
that is about a hundred small kernels (the cascade's 12 bmm/baddbmm with their casts and scalings, the two
rails, the blend and lookahead, the lane equaliser's reductions, the decay gate, the master's split and join),
each reading and writing its operands in global memory. On an H200 the elementwise part of the track-1 banks
takes 4.54 ms against a 0.47 ms memory floor (perf/RESULTS.md, the optimizer section).

Why it is faster: ``torch.compile(bank_update_, dynamic=False, fullgraph=True)`` traces the whole update of a
bank into one graph; Inductor fuses each run of elementwise ops and reductions between the cascade's matmuls
into a few kernels (the rails, blend and lookahead into one pass over the gradient; the equaliser's
power, gain and rescale; the join, decay, step and split of the master), so each element is read and written
a few times instead of dozens, and the host launches a few kernels instead of ~100.

Invariants (tests/optim/test_anvil_bank_compiled.py):
1. No graph break: ``fullgraph=True``, so a construct Dynamo cannot trace is an error, never a silent
   eager fallback.
2. One graph per bank, made on its first step and replayed afterwards: everything that changes between
   steps (momentum, decay, rail betas and weights, each matrix's lr) reaches the graph in the bank's device
   ``scalars`` tensor, never as a Python number, so new values neither recompile nor make the host wait; the
   per-bank keyword constants (beta2, slow rail beta, margin, lane axis) are fixed for the bank's life.
3. The same operations in the same order as the eager path: with the ``aot_eager`` backend (the traced
   graph run by the eager kernels) parameters and optimizer state are bitwise the eager ones over several
   steps; Inductor's fused kernels reorder fp32 reductions and contract multiply-adds, so there the
   agreement is within a stated bound (CPU and CUDA tests).

Provenance: upstream's track-1 record #360 compiles its bank update (``anvil_bank_update`` under
``torch.compile`` in modded-nanogpt's ``track_1_short/optim/anvil.py``) and replays it in a CUDA graph; this
module does the first part only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from track_1_short.optim.anvil_bank import bank_update_

COMPILE_BACKEND: str | Callable = "inductor"
"""The backend ``optim.bank_update=compiled`` uses; tests set ``aot_eager`` (the same graph run by the eager
kernels) or a graph-counting backend."""


def compiled_bank_update(backend: str | Callable | None = None) -> Callable[..., None]:
    """:func:`bank_update_` under ``torch.compile(dynamic=False, fullgraph=True)`` (default backend:
    :data:`COMPILE_BACKEND`), called like it.

    One callable serves every bank: Dynamo keys its graphs on the operands' shapes, strides and dtypes and on
    the constant keywords (guarded, so a bank's graph is replayed only for that bank's shapes and constants),
    so each bank gets its own graph on its first call. Static shapes (``dynamic=False``): a bank's shapes
    never change, and a graph specialised to them lets Inductor choose its kernels for those sizes. Dynamo
    keeps at most ``torch._dynamo.config.recompile_limit`` (8) graphs of one function; a model with more bank
    shapes than that would run the rest eagerly (the track-1 model has 3)."""
    return torch.compile(
        bank_update_, backend=COMPILE_BACKEND if backend is None else backend, dynamic=False, fullgraph=True
    )
