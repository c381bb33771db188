"""ANVIL's per-bank update outside the cascade as Triton kernels (``OptimConfig.bank_update = "triton"``).

:func:`track_1_short.optim.anvil_bank.triton_bank_update_` runs them in order around the cascade; this
module holds the kernels and their launchers only, so it imports nothing of the optimizer.

What it replaces (``"eager"``): the elementwise and reduction phases of
:func:`track_1_short.optim.anvil_bank.bank_update_` run op by op: the gradient's widening, both rails' lerps,
the blend and lookahead and the cast to bf16 (:func:`~track_1_short.optim.anvil_bank.twin_rails_`); the
lane equaliser's square and mean (:func:`~track_1_short.optim.anvil_bank.equalise_lanes_`); the master's
join, decay gate, step and split (:func:`~track_1_short.optim.anvil_bank.sign_gated_step_`). Each of those
ops is a kernel reading and writing whole-bank tensors in global memory. The cascade between them
(:func:`track_1_short.optim.polar_express.orthogonalize`) is unchanged.

Why it is faster: three passes over the bank instead of dozens. Kernel A (rails) reads the bf16
gradient and both fp32 rails and writes the rails and the bf16 lookahead u, once each. Kernel B (lane power)
reads the cascade's bf16 output V once. Kernel C (master step) reads V, the slow rail, the weight and the
mantissa and writes weight and mantissa. Both widen V to fp32 as they load it (exact), where the eager path
writes an fp32 copy of V first: for the MLP bank's 52M elements that copy and the doubled reads were about
0.5 GB of traffic a step. The equaliser's per-lane arithmetic between B and C
(:func:`~track_1_short.optim.anvil_bank.lane_scale_`: energy EMA, gains, the two Frobenius norms) stays torch
ops on [chunk, lanes] tensors (one value per lane: 1/256 of the bank or less at the track-1 shapes). Each
kernel is JIT-compiled by Triton on its first launch for a new set of constexprs and cached. Measured with
``perf/bench_optimizer.py --bank-update eager triton``: perf/RESULTS.md, "Optimizer step".

Numerics (tests/perf/test_anvil_bank_triton.py):
- Kernel A rounds every operation as the eager path does. torch's lerp(a, b, w) is ``a + w (b - a)`` for
  |w| < 0.5, else ``b - (b - a)(1 - w)``, and both the CPU kernel (vectorised ``fmadd``) and the CUDA one
  (nvcc contracts the multiply-add) compute it as one fused multiply-add of w or w - 1 (exact for
  w in [0.5, 1]) with the rounded b - a. Here that is ``tl.fma`` on a GPU; Triton's interpreter multiplies
  and adds with separate roundings, so under it the multiply-add runs in fp64 (the product of two fp32 values
  is exact there) and is rounded to fp32 once more, which equals the single rounding except when the fp64 sum
  lands on an fp32 halfway point (probability about 2^-29 an element). The weights are the eager ones:
  ``1 - fast_beta`` subtracted in fp32 from the device scalar, ``1 - slow_beta`` computed in fp64 on the host
  and rounded to fp32 (as torch converts a Python float weight). u is rounded to bf16 to nearest even in
  integer arithmetic (kernels/bf16_bits.py; the interpreter's own conversion truncates). So the rails and u
  are bitwise the eager ones (tested on the CPU).
- Kernel B sums v^2 along each lane in fp32 in its own order, so the lane power, and through it the lane
  energy, the scale and the step, agree with eager within fp32 summation bounds, not bitwise. On the GPU
  that order follows the compiled layout, which follows the loaded element's width: V read as bf16 (as the
  update does) and its fp32 widening sum in different orders, within the same bounds.
- Kernel C mirrors :func:`~track_1_short.optim.anvil_bank.sign_gated_step_` operation by operation (launched
  with ``enable_fp_fusion=False``, so no multiply-add is contracted): given the same scale it writes the same
  bits. A matrix with eff_lr = 0 (pad, frozen) keeps its weight and mantissa bit for bit.

Invariants (tested, tests/perf/test_anvil_bank_triton.py): rails and u bitwise eager; master step, lane
energy within the bounds stated there; pad and frozen matrices unchanged; tall and wide banks (both lane
axes); the optimizer with ``bank_update="triton"`` trains like the eager one within those bounds.
On the CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 before this module is
imported); elsewhere :func:`check_device` refuses.

Provenance: upstream's track-1 record #360 runs this part of the update compiled (``_rail_equalizer`` and
``_sign_aligned_decay_update`` in modded-nanogpt's ``track_1_short/optim/anvil.py`` under torch.compile);
the kernels here are written for this project.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from track_1_short.optim.bank_layout import N_SCALARS
from track_1_short.perf.kernels.bf16_bits import load_bf16, round_to_bf16_bits, widen_bf16
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted

ELEMENTWISE_BLOCK = 1024  # elements per program of kernels A and C
ELEMENTWISE_WARPS = 4
LANE_BLOCK = 32  # lanes per program of kernel B
REDUCE_BLOCK = 64  # reduced elements per lane per loop iteration of kernel B


@triton.jit
def _lerp(a, b, w, FMA_VIA_FP64: tl.constexpr):
    # torch.lerp's two forms as one fused multiply-add: w (b - a) + a, or (w - 1)(b - a) + b.
    small = tl.abs(w) < 0.5
    coeff = tl.where(small, w, w - 1.0)
    base = tl.where(small, a, b)
    diff = b - a
    if FMA_VIA_FP64:
        out = (coeff.to(tl.float64) * diff.to(tl.float64) + base.to(tl.float64)).to(tl.float32)
    else:
        out = tl.fma(coeff, diff, base)
    return out


@triton.jit
def _rails_kernel(
    grad_ptr,  # [n] int16 bits of the bf16 gradient
    velocity_ptr,  # [2 n] fp32: fast rail, then slow rail
    u_ptr,  # [n] int16 bits of the bf16 lookahead (output)
    scalars_ptr,  # fp32 scalars of the bank: momentum, eff_wd, fast_beta, fast_weight (anvil_bank.scalar_row)
    n,
    slow_weight,  # fp32 1 - slow_beta
    FMA_VIA_FP64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    momentum = tl.load(scalars_ptr + 0)
    fast_beta = tl.load(scalars_ptr + 2)
    fast_weight = tl.load(scalars_ptr + 3)
    fast_step = 1.0 - fast_beta  # fp32, as the eager path's rsub on the device scalar
    g = widen_bf16(tl.load(grad_ptr + offs, mask=mask, other=0))
    fast = _lerp(tl.load(velocity_ptr + offs, mask=mask, other=0.0), g, fast_step, FMA_VIA_FP64)
    slow = _lerp(tl.load(velocity_ptr + n + offs, mask=mask, other=0.0), g, slow_weight, FMA_VIA_FP64)
    tl.store(velocity_ptr + offs, fast, mask=mask)
    tl.store(velocity_ptr + n + offs, slow, mask=mask)
    blend = _lerp(slow, fast, fast_weight, FMA_VIA_FP64)
    u = _lerp(g, blend, momentum, FMA_VIA_FP64)
    tl.store(u_ptr + offs, round_to_bf16_bits(u), mask=mask)


@triton.jit
def _lane_power_kernel(
    v_ptr,  # [chunk, rows, cols] fp32, or the int16 bits of bf16 (V_BF16), contiguous
    power_ptr,  # [chunk, lanes] fp32 (output)
    lanes,
    length,  # elements per lane (the reduced side)
    matrix_stride,
    lane_stride,
    red_stride,
    V_BF16: tl.constexpr,
    BLOCK_LANES: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    matrix = tl.program_id(0).to(tl.int64)
    lane = tl.program_id(1) * BLOCK_LANES + tl.arange(0, BLOCK_LANES)
    lane_in = lane < lanes
    base = v_ptr + matrix * matrix_stride + lane[:, None].to(tl.int64) * lane_stride
    acc = tl.zeros((BLOCK_LANES, BLOCK_R), dtype=tl.float32)
    for r0 in range(0, length, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        # bf16 widened exactly: the same fp32 values as a float() copy, without the copy (tl.sum's order
        # below still follows the load's width on the GPU).
        v = load_bf16(base + r[None, :] * red_stride, lane_in[:, None] & (r < length)[None, :], V_BF16)
        acc += v * v
    power = tl.sum(acc, axis=1) / length  # the mean of v^2, as eager's sum then divide
    tl.store(power_ptr + matrix * lanes + lane, power, mask=lane_in)


@triton.jit
def _master_step_kernel(
    v_ptr,  # [n] cascade output: fp32, or the int16 bits of bf16 (V_BF16)
    scale_ptr,  # [chunk, lanes] fp32 equaliser scale
    slow_ptr,  # [n] fp32 slow rail
    weight_ptr,  # [n] int16 bits of the bf16 weight (in place)
    mantissa_ptr,  # [n] int16 bits of the uint16 mantissa (in place)
    scalars_ptr,
    n,
    rows,
    cols,
    lanes,
    LANES_ARE_ROWS: tl.constexpr,
    N_SCALARS: tl.constexpr,
    V_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    matrix = offs // (rows * cols)
    if LANES_ARE_ROWS:
        lane = (offs // cols) % rows
    else:
        lane = offs % cols
    scale = tl.load(scale_ptr + matrix * lanes + lane, mask=mask, other=0.0)
    eff_lr = tl.load(scalars_ptr + N_SCALARS + matrix, mask=mask, other=0.0)
    eff_wd = tl.load(scalars_ptr + 1)
    high = tl.load(weight_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    low = tl.load(mantissa_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    p32 = ((high << 16) | low).to(tl.float32, bitcast=True)
    slow = tl.load(slow_ptr + offs, mask=mask, other=0.0)
    update = load_bf16(v_ptr + offs, mask, V_BF16) * scale  # the equalised v, rounded as eager's mul_
    aligned = (slow * p32) >= 0  # zero counts as aligned
    decay = tl.where(aligned, p32 * (eff_wd * eff_lr), 0.0)
    p32 = p32 - decay - update * eff_lr
    bits = p32.to(tl.uint32, bitcast=True)
    tl.store(weight_ptr + offs, (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    tl.store(mantissa_ptr + offs, (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


# Once, at import (runs_interpreted says why).
_INTERPRETED = runs_interpreted(_rails_kernel)


def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (TRITON_INTERPRET=1 when this module was loaded)."""
    return _INTERPRETED


def check_device(device: torch.device | str, what: str = "optim.bank_update=triton") -> None:
    """Raise a RuntimeError naming ``what`` unless these kernels can run on ``device`` (CUDA, or any device
    under Triton's interpreter)."""
    _check_device(device, what, interpreted(), "anvil_bank", "optim.bank_update=eager")


def _check_v(v: torch.Tensor, what: str) -> bool:
    """Whether the cascade output ``v`` is bf16 (else fp32); anything else, or a strided ``v``, is refused."""
    if v.dtype not in (torch.bfloat16, torch.float32) or not v.is_contiguous():
        raise ValueError(
            f"{what}: v is {v.dtype}{'' if v.is_contiguous() else ', not contiguous'}; the kernel reads a "
            "contiguous bf16 or float32 cascade output."
        )
    return v.dtype == torch.bfloat16


def rails_(
    grad: torch.Tensor, velocity: torch.Tensor, scalars: torch.Tensor, slow_beta: float
) -> torch.Tensor:
    """Kernel A: advance both rails of ``velocity`` in place from the bf16 ``grad`` and return the bf16
    lookahead u (eager: ``twin_rails_(...).bfloat16()``)."""
    n = grad.numel()
    # torch converts a Python float lerp weight to fp32 by rounding the fp64 value: the same here.
    slow_weight = float(np.float32(1.0 - slow_beta))  # no tensor built on every step
    u = torch.empty_like(grad)
    _rails_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](
        grad.view(torch.int16),
        velocity,
        u.view(torch.int16),
        scalars,
        n,
        slow_weight,
        FMA_VIA_FP64=interpreted(),  # the interpreter has no fused multiply-add
        BLOCK=ELEMENTWISE_BLOCK,
        enable_fp_fusion=False,
        num_warps=ELEMENTWISE_WARPS,
    )
    return u


def lane_power(v: torch.Tensor, red_dim: int) -> torch.Tensor:
    """Kernel B: the mean of v^2 along ``red_dim`` of the contiguous ``v`` [chunk, rows, cols] (fp32, or bf16
    widened exactly as it is loaded), fp32, shaped like the lane energy (eager:
    ``v.float().square().mean(dim=red_dim, keepdim=True)``)."""
    chunk, rows, cols = v.shape
    lanes_are_rows = red_dim == -1
    lanes, length = (rows, cols) if lanes_are_rows else (cols, rows)
    power = torch.empty(
        (chunk, rows, 1) if lanes_are_rows else (chunk, 1, cols), dtype=torch.float32, device=v.device
    )
    v_bf16 = _check_v(v, "lane_power")
    _lane_power_kernel[(chunk, triton.cdiv(lanes, LANE_BLOCK))](
        v.view(torch.int16) if v_bf16 else v,
        power,
        lanes,
        length,
        rows * cols,
        cols if lanes_are_rows else 1,
        1 if lanes_are_rows else cols,
        V_BF16=v_bf16,
        BLOCK_LANES=LANE_BLOCK,
        BLOCK_R=REDUCE_BLOCK,
        enable_fp_fusion=False,
    )
    return power


def master_step_(
    weight: torch.Tensor,
    mantissa: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor,
    slow: torch.Tensor,
    scalars: torch.Tensor,
    red_dim: int,
) -> None:
    """Kernel C: the sign-gated step of the master (bf16 ``weight``, uint16 ``mantissa``) by ``v * scale``
    (``v`` fp32, or bf16 widened exactly as it is loaded; ``scale``: one value per lane, [chunk, rows, 1] for
    ``red_dim`` -1, else [chunk, 1, cols]), in place (eager: ``sign_gated_step_(weight, mantissa, v * scale,
    slow, eff_lr, eff_wd)``)."""
    chunk, rows, cols = v.shape
    n = v.numel()
    lanes_are_rows = red_dim == -1
    v_bf16 = _check_v(v, "master_step_")
    _master_step_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](
        v.view(torch.int16) if v_bf16 else v,
        scale,
        slow,
        weight.view(torch.int16),
        mantissa.view(torch.int16),
        scalars,
        n,
        rows,
        cols,
        rows if lanes_are_rows else cols,
        LANES_ARE_ROWS=lanes_are_rows,
        N_SCALARS=N_SCALARS,
        V_BF16=v_bf16,
        BLOCK=ELEMENTWISE_BLOCK,
        enable_fp_fusion=False,
        num_warps=ELEMENTWISE_WARPS,
    )
