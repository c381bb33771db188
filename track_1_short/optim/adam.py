"""One Adam step of one parameter or shard: the reference arithmetic every Adam path of the project matches.

With t the Adam step after incrementing it (it counts Adam updates, not training steps):

    lr        = cfg.lr * cfg.lr_mul
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)       Python doubles, rounded once to fp32
    eff_wd    = lr * lr * weight_decay * wd_mul                (lr squared: lr already includes lr_mul)
    m = beta1 * m + (1 - beta1) * g                            fp32 moments
    v = beta2 * v + (1 - beta2) * (g * g)
    u = m / (sqrt(v) + eps) * step_size                        bias correction folded into the step size
    u = u + eff_wd * p   where u * p > 0 (strict)              cautious decay: only where the step shrinks p
    p = p - u                                                  stored round-to-nearest-even (bf16 or fp32)

step_size and eff_wd reach the step as 0-D fp32 tensors, so the compiled step never recompiles when the
schedule moves the learning rate. On CUDA the step is compiled (``torch.compile(dynamic=False,
fullgraph=True)``), one graph per (shape, dtype, betas, eps); on the CPU it runs eagerly. The fused path
(``track_1_short.perf.replicated_adam``) reproduces this arithmetic bit for bit; see its kernel's docstring.
"""

from __future__ import annotations

from typing import Any

import torch

from track_1_short.optim.hyper import (  # noqa: F401  (the reference's public names, re-exported)
    AdamParamConfig,
    adam_step_scalars,
    first_moment_correction,
    second_moment_correction,
)

# One compiled graph per (shape, dtype, betas, eps) of every Adam tensor that takes the reference path: the 13
# replicated tensors plus the sharded ones need about 20; dynamo's default limit of 8 would silently fall back
# to eager (and to different numerics) from the ninth shape on.
_RECOMPILE_LIMIT = 64


def _sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    # The IEEE (correctly rounded) fp32 square root on every backend. Compiled CUDA code gets it from
    # torch.sqrt (Inductor emits tl.sqrt_rn), but eager CPU torch takes fp32 sqrt from MKL's vector library,
    # which is one ulp off on a sizeable fraction of inputs (measured: 16% of uniform inputs, AVX512 build).
    # The fp64 root rounded once to fp32 is exactly the IEEE fp32 root (53 >= 2 * 24 + 2 bits).
    return v.sqrt() if v.is_cuda else v.double().sqrt().float()


def _adam_step_math(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step_size: torch.Tensor,
    eff_wd: torch.Tensor,
) -> None:
    # Plain binary ops only (no addcmul/lerp/alpha): each is one IEEE rounding on every backend, which is what
    # lets the Triton kernel mirror this statement by statement (see perf/kernels/replicated_adam.py).
    g = grad.float()
    p = param.float()
    m = beta1 * exp_avg + (1.0 - beta1) * g
    v = beta2 * exp_avg_sq + (1.0 - beta2) * (g * g)
    u = m / (_sqrt_rn(v) + eps) * step_size
    u = torch.where(u * p > 0, u + eff_wd * p, u)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    param.copy_(p - u)


_compiled_step: Any = None


def _compiled_adam_step() -> Any:
    global _compiled_step
    if _compiled_step is None:
        dynamo_config = torch._dynamo.config
        # ``cache_size_limit`` is the pre-2.6 name of the same setting.
        name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
        # emulate_precision_casts turns off fp fusion in the generated Triton kernel: each multiply and add is
        # rounded on its own, as in eager and in the fused kernel (perf/kernels/replicated_adam.py says why).
        _compiled_step = torch.compile(
            _adam_step_math, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True}
        )
    return _compiled_step


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step_size: torch.Tensor,
    eff_wd: torch.Tensor,
) -> None:
    """One Adam step of ``param`` in place (moments fp32, shaped like param; step_size/eff_wd 0-D fp32)."""
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise TypeError(
            f"Adam moments must be float32, got exp_avg {exp_avg.dtype} and exp_avg_sq {exp_avg_sq.dtype}; "
            "create them with torch.zeros_like(param, dtype=torch.float32)"
        )
    if param.is_cuda:
        _compiled_adam_step()(param, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size, eff_wd)
    else:
        _adam_step_math(param, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size, eff_wd)


def new_scalar_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    """Two reusable 0-D CPU fp32 tensors for (step_size, eff_wd): refilled each step, never a new input."""
    return torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)


def adam_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    cfg: AdamParamConfig,
    scalars: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Increment ``state["step"]`` and apply one Adam step to ``param`` with ``state``'s moments."""
    step_size_t, eff_wd_t = scalars if scalars is not None else new_scalar_buffers()
    beta1, beta2 = cfg.adam_betas
    step = state["step"] + 1
    step_size, eff_wd = adam_step_scalars(cfg, step)
    step_size_t.fill_(step_size)  # double -> fp32: the one rounding
    eff_wd_t.fill_(eff_wd)
    adam_step_(
        param, grad, state["exp_avg"], state["exp_avg_sq"], beta1, beta2, cfg.eps, step_size_t, eff_wd_t
    )
    state["step"] = step
