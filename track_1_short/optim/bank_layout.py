"""The layout of an ANVIL bank's per-step scalars: what the eager update (optim/anvil_bank.py), its Triton
kernels (perf/kernels/anvil_bank.py) and the batched upload (perf/bank_scalars.py) all read.

A module of its own so that the fast paths read the layout without importing the optimizer that dispatches
to them (the dependencies point one way: optim -> perf -> these definitions).
"""

from __future__ import annotations

N_SCALARS = 4  # momentum, eff_wd, fast_beta, fast_weight; then eff_lr per matrix


def scalars_size(chunk: int) -> int:
    """Length of a bank's ``scalars`` for a chunk of ``chunk`` matrices."""
    return N_SCALARS + chunk


def scalar_row(
    momentum: float, eff_wd: float, fast_beta: float, fast_weight: float, eff_lr: list[float]
) -> list[float]:
    """A bank's per-step values in the order of its ``scalars`` (the one layout both uploads write)."""
    return [momentum, eff_wd, fast_beta, fast_weight, *eff_lr]
