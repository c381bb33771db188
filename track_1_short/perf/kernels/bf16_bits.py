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
def rounded_bf16(x, AS_BITS: tl.constexpr):
    # fp32 -> the nearest-even bf16 value, widened back to fp32: in integer arithmetic (AS_BITS: the
    # interpreter, whose conversion truncates) or by the GPU's own conversion (cvt.rn, fewer registers in a
    # GEMM epilogue). The same value either way.
    if AS_BITS:
        value = widen_bf16(round_to_bf16_bits(x))
    else:
        value = x.to(tl.bfloat16).to(tl.float32)
    return value


@triton.jit
def bf16_bits(x, AS_BITS: tl.constexpr):
    # fp32 -> the bit pattern of its nearest-even bf16, as rounded_bf16 computes it.
    if AS_BITS:
        bits = round_to_bf16_bits(x)
    else:
        bits = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    return bits


@triton.jit
def load_bf16(ptrs, mask, AS_BITS: tl.constexpr):
    # A bf16 tile: as int16 bits widened exactly to fp32 (AS_BITS: the interpreter, which has no numpy bf16),
    # or loaded as it is (the GPU: bf16 operands straight into tl.dot). One return for both branches: Triton
    # type-checks every return of a function, even under a constexpr branch not taken.
    if AS_BITS:
        tile = widen_bf16(tl.load(ptrs, mask=mask, other=0))
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile
