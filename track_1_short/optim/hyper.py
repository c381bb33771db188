"""Adam's per-parameter hyperparameter record and its per-step scalars: what the reference step
(optim/adam.py) and its fast path (perf/replicated_adam.py) both read.

A module of its own so that the fast path reads these definitions without importing the optimizer that
dispatches to it (the dependencies point one way: optim -> perf -> these definitions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol


class AdamParamConfig(Protocol):
    """The attributes an Adam step reads from a parameter's config (``ParamConfig`` in optim/anvil.py)."""

    adam_betas: Sequence[float]  # (beta1, beta2)
    lr: float  # current base lr (initial lr times the schedule multiplier)
    lr_mul: float  # per-parameter lr multiplier
    eps: float  # added to sqrt(v)
    weight_decay: float  # base decay
    wd_mul: float  # per-parameter decay multiplier


def first_moment_correction(beta1: float, step: int) -> float:
    """``1 - beta1^step`` in double precision (the divisor of the step size)."""
    return 1.0 - beta1**step


def second_moment_correction(beta2: float, step: int) -> float:
    """``sqrt(1 - beta2^step)`` in double precision (the factor of the step size)."""
    return math.sqrt(1.0 - beta2**step)


def adam_step_scalars(cfg: AdamParamConfig, step: int) -> tuple[float, float]:
    """(step_size, eff_wd) of Adam step ``step`` (1-based) in Python doubles; callers round once to fp32."""
    beta1, beta2 = cfg.adam_betas
    lr = cfg.lr * cfg.lr_mul
    step_size = lr * second_moment_correction(beta2, step) / first_moment_correction(beta1, step)
    eff_wd = ((lr * lr) * cfg.weight_decay) * cfg.wd_mul
    return step_size, eff_wd
