"""One Triton kernel: a bf16 (or fp16) batch of matrices divided by one fp32 number per matrix, rounded once
to bf16 (or fp16).

What it replaces: ``torch.div(t, divisor, out=out)`` on CUDA, with t bf16 or fp16 [B, rows, cols], divisor
fp32 [B, 1, 1] and out bf16 or fp16 shaped as t: the cascade's normalisation and, in its Gram-space route, the
scaled changes of precision between bf16 and fp16 (:func:`track_1_short.optim.polar_express.scaled` calls this
on contiguous CUDA inputs outside torch.compile).

Why it is faster: the mixed-dtype, broadcast division goes through TensorIterator's non-vectorised path
with a dynamic cast per element, at about a quarter of the copy rate (perf/RESULTS.md, "Optimizer step",
and its kernel tables). Here each program reads a contiguous block of one matrix in wide loads, reads its
divisor once, and writes bf16.

Invariants (tests/perf/test_bf16_div.py, under the interpreter on the CPU and on the GPU): the bits of
torch.div's for every finite input (the quotient in fp32 with IEEE division, ``div_rn``; Triton's ``/`` is
the approximate div.full.f32; then round to nearest even: to bf16 in integer arithmetic, kernels/bf16_bits.py,
to fp16 by Triton's conversion, which rounds to nearest even on the GPU and under the interpreter); a bf16
NaN comes out as the canonical 0x7FFF, not necessarily torch's NaN pattern.

Provenance: an elementwise kernel in the form of Triton's vector-add tutorial, with a second grid axis for
the matrix, as PyTorch's own broadcast kernels index theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import load_bf16, round_to_bf16_bits
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted

BLOCK = 4096  # elements per program: 16 a thread over 8 warps, two 16-byte loads each
NUM_WARPS = 8


DTYPES = (torch.bfloat16, torch.float16)
"""What the kernel reads and writes (any pair of them)."""


@triton.jit
def _div_kernel(
    t_ptr,
    divisor_ptr,
    out_ptr,
    per_matrix,
    BLOCK: tl.constexpr,
    WIDEN: tl.constexpr,
    IN_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    matrix = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < per_matrix
    base = matrix * per_matrix
    if IN_BF16:
        values = load_bf16(t_ptr + base + offsets, inside, WIDEN).to(tl.float32)
    else:
        values = tl.load(t_ptr + base + offsets, mask=inside, other=0.0).to(tl.float32)
    quotient = tl.math.div_rn(values, tl.load(divisor_ptr + matrix))
    if OUT_BF16:
        tl.store(out_ptr + base + offsets, round_to_bf16_bits(quotient), mask=inside)
    else:
        tl.store(out_ptr + base + offsets, quotient.to(tl.float16), mask=inside)


_INTERPRETED = runs_interpreted(_div_kernel)  # once, at import (interpreter.runs_interpreted says why)


def supports(t: torch.Tensor, divisor: torch.Tensor) -> bool:
    """Whether :func:`div_` takes these inputs: bf16 or fp16 t [B, rows, cols] contiguous, fp32 divisor
    [B, 1, 1] contiguous, on one device."""
    return (
        t.dim() == 3
        and t.dtype in DTYPES
        and t.is_contiguous()
        and divisor.dtype == torch.float32
        and tuple(divisor.shape) == (t.size(0), 1, 1)
        and divisor.is_contiguous()
        and divisor.device == t.device
    )


def div_(t: torch.Tensor, divisor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[b] = (t[b].float() / divisor[b]).to(out.dtype), bitwise, for inputs that :func:`supports` takes and
    a bf16 or fp16 ``out`` shaped as t. Returns ``out``."""
    _check_device(t.device, "bf16_div.div_", _INTERPRETED, "bf16_div", "torch.div")
    if not supports(t, divisor):
        raise ValueError(
            "bf16_div.div_: expected a contiguous bf16 or fp16 [B, rows, cols] and a contiguous fp32"
            f" [B, 1, 1] on one device, got {t.dtype} {tuple(t.shape)} and {divisor.dtype}"
            f" {tuple(divisor.shape)}; use torch.div"
        )
    if out.shape != t.shape or out.dtype not in DTYPES or not out.is_contiguous():
        raise ValueError(f"bf16_div.div_: out must be a contiguous bf16 or fp16 {tuple(t.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")  # fmt: skip
    return launch_(t, divisor, out)


def launch_(t: torch.Tensor, divisor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`div_` without its checks, for a caller that has asked :func:`supports` already (the cascade's
    normalisation and the Gram-space route's changes of precision, up to six calls a bank update) and passes a
    contiguous bf16 or fp16 ``out`` shaped as t."""
    per_matrix = t[0].numel() if t.size(0) else 0
    if per_matrix == 0:
        return out
    grid = (triton.cdiv(per_matrix, BLOCK), t.size(0))
    in_bf16, out_bf16 = t.dtype == torch.bfloat16, out.dtype == torch.bfloat16
    _div_kernel[grid](
        t.view(torch.int16) if _INTERPRETED and in_bf16 else t,
        divisor,
        out.view(torch.int16) if out_bf16 else out,
        per_matrix,
        BLOCK=BLOCK,
        WIDEN=_INTERPRETED,
        IN_BF16=in_bf16,
        OUT_BF16=out_bf16,
        num_warps=NUM_WARPS,
    )
    return out
