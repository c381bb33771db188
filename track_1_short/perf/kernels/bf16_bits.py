"""bf16 <-> fp32 in integer arithmetic, for Triton kernels: exact widening, and rounding to nearest even
that gives the same bits on the GPU and under Triton's interpreter (which converts fp32 to bf16 toward zero
whatever rounding is asked for)."""

import triton
import triton.language as tl


@triton.jit
def widen_bf16(bits):
    # int16 bit pattern -> fp32 with the same value (exact).
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16_bits(x):
    # fp32 -> bf16 bit pattern, round to nearest even; NaN -> the canonical 0x7FFF.
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FFF, rounded).to(tl.uint16)
    return rounded.to(tl.int16, bitcast=True)


@triton.jit
def load_bf16(ptrs, mask, AS_BITS: tl.constexpr):
    # A bf16 tile: as int16 bits widened exactly to fp32 (AS_BITS: the interpreter, which has no numpy bf16;
    # or a bf16 tensor read where an fp32 one could be), or loaded as it is (the GPU: bf16 operands straight
    # into tl.dot; an fp32 tensor). One return for both branches: Triton type-checks every return of a
    # function, even under a constexpr branch not taken.
    if AS_BITS:
        tile = widen_bf16(tl.load(ptrs, mask=mask, other=0))
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile
