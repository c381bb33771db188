"""One Triton kernel: an FP8 operand of model/fp8.py in both layouts, its saturation count and its amax, in
one pass.

What it replaces: model/fp8.py's ``quantize_both`` reference on CUDA: torch ops that Inductor turns into
three or four passes over the operand: the prologue and quantise with the row-major copy, the transposed copy
the weight-gradient GEMM needs (cuBLAS's FP8 GEMM takes only row-major A and column-major B), the amax of a
delayed scale and the clip count. On one H100 at stage 2 of record_1gpu those passes took 92.6 ms a step
around the MLP alone, where one pass per operand at the memory's bandwidth needs about 36 (perf/RESULTS.md,
"Train step").

Why it is faster: each program reads one [BM, BN] tile of the operand (and of ``pre`` for dpre) once,
writes the e4m3/e5m2 tile row-major and transposed (Triton stages the transpose through shared memory, so
both stores are coalesced), and adds its clip count and tile amax with one atomic each.

Invariants (tests/perf/test_fp8_quantize.py, under the interpreter on the CPU and on the GPU): the bits of
the reference for every prologue and format, both layouts, the clip counts and the amax. The value is
rounded to the format's grid in fp32 arithmetic (round to nearest even, subnormals included) before the
cast, so the cast is exact: Triton's interpreter converts fp32 to FP8 with another rounding. The division
by the scale is IEEE (div_rn), as torch's is; ReLU^2 is rounded to bf16 as the reference's bf16 square is.
An amax that meets a NaN may differ from the reference's (which then turns NaN): the NaN guard stops such
a step anyway.

Provenance: record #92 quantises inside its Triton GEMMs' epilogues (upstream perf/kernels/mlp.py @
f380c1f0); here the GEMMs stay cuBLAS's and the quantise is one pass of its own.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from track_1_short.perf.kernels.bf16_bits import load_bf16, round_to_bf16_bits, widen_bf16
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted

BLOCK = 64


def grid_constants(fmt: torch.dtype) -> dict:
    """The kernel's constants of an FP8 format's grid: mantissa bits, smallest normal exponent, largest
    finite value."""
    info = torch.finfo(fmt)
    return {
        "MANT": round(-math.log2(info.eps)),
        "MIN_EXP": round(math.log2(info.smallest_normal)),
        "FMAX": info.max,
    }


@triton.jit
def on_fp8_grid(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr):
    # y (fp32) saturated to +-FMAX and rounded to the FP8 format's grid (grid_constants), to nearest even: the
    # cast to the format after it is exact. At c = 2^23 ulp, fp32's own spacing is the ulp, so (|y| + c) - c
    # is |y| rounded to a multiple of it; below the smallest normal the ulp stays the subnormal step.
    # (sign and magnitude by shifts: they keep uint32, where a literal 0x80000000 could widen the type)
    y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 31
    mag = ((bits << 1) >> 1).to(tl.float32, bitcast=True)
    e = tl.maximum(((bits << 1) >> 24).to(tl.int32) - 127, MIN_EXP)
    c = ((e - MANT + 127 + 23) << 23).to(tl.float32, bitcast=True)
    mag = (mag + c) - c
    return (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_both_kernel(
    a_ptr,
    b_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    amax_ptr,
    clips_ptr,
    M,
    N,
    site,
    n_sites,
    PROLOGUE: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FMAX: tl.constexpr,
    CLIP: tl.constexpr,
    TRACK_AMAX: tl.constexpr,
    AS_BITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    v = load_bf16(a_ptr + offs, mask, AS_BITS).to(tl.float32)
    # PROLOGUE (model/fp8.py's numbers): 0 v = a, 1 v = bf16(relu(a)^2), 2 v = 2 a relu(b) in fp32
    if PROLOGUE == 1:
        r = tl.where(v < 0, 0.0, v)
        v = widen_bf16(round_to_bf16_bits(r * r))  # r*r is exact in fp32; the bf16 square rounds it
    elif PROLOGUE == 2:
        pre = load_bf16(b_ptr + offs, mask, AS_BITS).to(tl.float32)
        # relu as torch's: -0 stays -0 (the sign of a zero dpre, and of its FP8 bits, follows it)
        v = (2.0 * v) * tl.where(pre < 0, 0.0, pre)
    if TRACK_AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, tl.abs(v), 0.0), 1), 0))
    y = tl.math.div_rn(v, tl.load(scale_ptr))
    clipped = tl.sum(tl.sum((mask & (tl.abs(y) > CLIP)).to(tl.int64), 1), 0)
    tl.atomic_add(clips_ptr + site, clipped)
    if (pm == 0) & (pn == 0):
        tl.atomic_add(clips_ptr + n_sites + site, M.to(tl.int64) * N)
    q = on_fp8_grid(y, MANT, MIN_EXP, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))


_INTERPRETED = runs_interpreted(
    _quantize_both_kernel
)  # once, at import (interpreter.runs_interpreted says why)


@torch.library.custom_op("track_1_short::fp8_quantize_both", mutates_args=("clips", "amax"))
def quantize_both(
    a: Tensor,
    b: Tensor | None,
    scale: Tensor,
    clips: Tensor,
    amax: Tensor | None,
    site: int,
    prologue: int,
    e5m2: bool,
    clip_at: float,
) -> tuple[Tensor, Tensor]:
    """(q, q.T contiguous) of the prologue's value v / scale in e4m3 (``e5m2``: e5m2), saturated: a [M, N]
    bf16 (b, for prologue 2: pre [M, N] bf16), scale fp32 0-D. Adds the elements with |v / scale| >
    clip_at and the elements seen to clips[0, site] and clips[1, site] (int64 [2, sites]); with ``amax``
    (fp32 0-D), raises it to max |v|."""
    _check_device(a.device, "fp8_quantize.quantize_both", _INTERPRETED, "fp8_quantize", "model.fp8 off")
    if a.dtype != torch.bfloat16 or a.dim() != 2 or (b is not None and b.shape != a.shape):
        raise ValueError(f"fp8_quantize.quantize_both: a must be 2-D bf16 (b its shape), got {a.dtype}.")
    fmt = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    m, n = a.shape
    q = torch.empty((m, n), dtype=fmt, device=a.device)
    qt = torch.empty((n, m), dtype=fmt, device=a.device)
    if m * n == 0:
        return q, qt

    def operand(t: Tensor) -> Tensor:
        t = t.contiguous()
        return t.view(torch.int16) if _INTERPRETED else t  # the interpreter has no numpy bf16

    _quantize_both_kernel[(triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK))](
        operand(a),
        operand(b) if b is not None else a,
        q,
        qt,
        scale,
        amax if amax is not None else scale,
        clips,
        m,
        n,
        site,
        clips.size(1),
        PROLOGUE=prologue,
        **grid_constants(fmt),
        CLIP=clip_at,
        TRACK_AMAX=amax is not None,
        AS_BITS=_INTERPRETED,
        BM=BLOCK,
        BN=BLOCK,
        enable_fp_fusion=False,
        num_warps=4,
    )
    return q, qt


@quantize_both.register_fake
def _quantize_both_fake(a, b, scale, clips, amax, site, prologue, e5m2, clip_at):
    fmt = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    return a.new_empty(a.shape, dtype=fmt), a.new_empty((a.shape[1], a.shape[0]), dtype=fmt)
