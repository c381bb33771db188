"""The ReLU^2 MLP's up-projection GEMM with its activation in the epilogue, forward and backward.

What it replaces: model/layers.py's ``relu2_mlp`` compiled by Inductor, where cuBLAS writes pre = x @ W1.T,
then a pointwise kernel reads pre and writes post = relu(pre)^2 (forward), and in the backward cuBLAS writes
dpost = g @ W2 and a second pointwise kernel reads dpost and pre and writes dpre = 2 dpost relu(pre). At the
record's stage 2 (65,536 rows x 2,816 hidden, bf16) those two pointwise kernels took 39.7 ms of a 580.6 ms
step on an H100 (perf/RESULTS.md, "Train step").

Why it is faster: each GEMM applies the activation to the fp32 tile it holds in registers and stores the
result, so no [T, hidden] tensor is read back. The forward stores pre (for the backward) and post (the down
projection's input) and drops a read of pre; the backward reads pre and stores dpre, and drops dpost's
write and read: 1.1 GB less traffic a layer and micro batch, and two launches fewer. The GEMM is a
persistent Triton kernel on TMA descriptors (one program an SM, output tiles in row-band order, so a band
of x is read while its tiles are computed; W1 or W2, 4.3 MB, stays in L2). An earlier form of this kernel,
with pointer loads (``model.mlp_impl=fused`` at a8a9a28), ran its GEMM at 0.88 ms a call and made the step
2.3% slower (perf/RESULTS.md, "Superseded"); this one moves every tile by TMA and flattens the tile and K
loops into one, so that the next tile's loads overlap this tile's epilogue.

Invariants (tests/perf/test_relu2_mlp.py, under the interpreter on the CPU and on the GPU): given the same
fp32 accumulators, the reference's bits: pre and dpost are rounded to bf16 first, as the reference's
GEMMs write them, then post = bf16(relu(pre)^2) and dpre = bf16(2 dpost pre) where pre > 0, else 0
(NaN propagates, as torch's relu and threshold_backward do). Where the GEMM's sums are exact (inputs on a
coarse grid) the outputs equal the reference bit for bit; otherwise each output is within the accumulation
bound of the exact product, rounded.

Provenance: modded-nanogpt fuses the same epilogue into a persistent TMA kernel (upstream
perf/kernels/mlp.py @ 55865738, which also emits FP8 operands from it); here the bf16 path, bitwise the
reference's rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from track_1_short.perf.kernels.bf16_bits import round_to_bf16_bits, widen_bf16
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted

# One tile shape both ways: 128 x 256 output tiles, K in steps of 64, three stages (2 x 72 KB of operands a
# stage would not fit four), eight warps; the epilogue runs on two 128 x 128 halves to bound its registers.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
NUM_STAGES, NUM_WARPS = 3, 8
# Programs under the interpreter, where there are no SMs to fill: a few, so the persistent loop still
# runs several tiles a program in the tests.
INTERPRETED_PROGRAMS = 3


@triton.jit
def rounded_bf16(x, AS_BITS: tl.constexpr):
    # fp32 -> the fp32 value of its bf16 rounding (nearest even); under the interpreter through the bits,
    # since it casts toward zero
    if AS_BITS:
        y = widen_bf16(round_to_bf16_bits(x))
    else:
        y = x.to(tl.bfloat16).to(tl.float32)
    return y


@triton.jit
def store_bf16(desc, offsets, x, AS_BITS: tl.constexpr):
    # an fp32 tile, stored as bf16 (as int16 bits under the interpreter)
    if AS_BITS:
        desc.store(offsets, round_to_bf16_bits(x))
    else:
        desc.store(offsets, x.to(tl.bfloat16))


@triton.jit
def load_tile(desc, offsets, AS_BITS: tl.constexpr):
    # a tile as the GEMM reads it: as stored (bf16, FP8), or with AS_BITS bf16 as int16 bits widened exactly
    # to fp32 (the interpreter has no numpy bf16); products of bf16 are exact in fp32 either way
    if AS_BITS:
        tile = widen_bf16(desc.load(offsets))
    else:
        tile = desc.load(offsets)
    return tile


@triton.jit
def _epilogue(
    acc, pre_desc, out_desc, m, n, FORWARD: tl.constexpr, STORE_PRE: tl.constexpr, AS_BITS: tl.constexpr
):
    # one [BLOCK_M, BLOCK_N / 2] half of an output tile, its fp32 accumulator ``acc``
    if FORWARD:
        pre = rounded_bf16(acc, AS_BITS)
        if STORE_PRE:
            store_bf16(pre_desc, [m, n], pre, AS_BITS)
        r = tl.where(pre <= 0.0, 0.0, pre)  # relu; a NaN stays NaN
        store_bf16(out_desc, [m, n], r * r, AS_BITS)
    else:
        dpost = rounded_bf16(acc, AS_BITS)
        pre = load_tile(pre_desc, [m, n], AS_BITS).to(tl.float32)
        # relu's gradient: 0 where relu(pre) <= 0 (a NaN pre passes its NaN on), times d(h^2)/dh = 2h
        store_bf16(out_desc, [m, n], tl.where(pre <= 0.0, 0.0, (dpost * 2.0) * pre), AS_BITS)


@triton.jit
def gemm_tile(
    a_desc,
    b_desc,
    m,
    n,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # the fp32 [BLOCK_M, BLOCK_N] tile at (m, n) of A @ B.T, A [M, K] and B [N, K] read by TMA (rows and K
    # beyond the ends read as zeros); WIDEN: bf16 operands arrive as int16 bits (the interpreter)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = load_tile(a_desc, [m, k], WIDEN)
        b = load_tile(b_desc, [n, k], WIDEN)
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def tile_count(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # output tiles of an [M, N] product
    return tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)


@triton.jit
def tile_origin(tile, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the first row and column of output tile ``tile``, in row-band order: the programs running at one time
    # share a few bands of A, and B stays in L2
    tiles_n = tl.cdiv(N, BLOCK_N)
    return (tile // tiles_n) * BLOCK_M, (tile % tiles_n) * BLOCK_N


@triton.jit
def split_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # a [BLOCK_M, BLOCK_N] tile as its left and right [BLOCK_M, BLOCK_N / 2] halves (the epilogues run on
    # halves to bound their registers)
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _relu2_gemm_kernel(
    a_desc,
    b_desc,
    pre_desc,
    out_desc,
    M,
    N,
    K,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FORWARD: tl.constexpr,
    STORE_PRE: tl.constexpr,
    AS_BITS: tl.constexpr,
):
    # acc = A @ B.T for A [M, K], B [N, K]; the forward: pre = acc, out = relu(pre)^2; the backward (A the
    # down projection's output gradient, B = W2 stored [hidden, D]): dpost = acc, out = dpre
    half: tl.constexpr = BLOCK_N // 2
    for tile in tl.range(tl.program_id(0), tile_count(M, N, BLOCK_M, BLOCK_N), NUM_PROGRAMS, flatten=True):
        m, n = tile_origin(tile, N, BLOCK_M, BLOCK_N)
        acc = gemm_tile(a_desc, b_desc, m, n, K, BLOCK_M, BLOCK_N, BLOCK_K, AS_BITS)
        acc0, acc1 = split_halves(acc, BLOCK_M, BLOCK_N)
        _epilogue(acc0, pre_desc, out_desc, m, n, FORWARD, STORE_PRE, AS_BITS)
        _epilogue(acc1, pre_desc, out_desc, m, n + half, FORWARD, STORE_PRE, AS_BITS)


# once, at import (interpreter.runs_interpreted says why)
_INTERPRETED = runs_interpreted(_relu2_gemm_kernel)


def _checked(what: str, *tensors: torch.Tensor) -> bool:
    """Whether to pass bf16 as int16 bits (the interpreter), after the checks TMA needs."""
    _check_device(tensors[0].device, what, _INTERPRETED, "relu2_mlp", "model.mlp_impl=reference")
    for t in tensors:
        if t.dtype != torch.bfloat16 or t.dim() != 2 or not t.is_contiguous() or t.shape[1] % 8:
            raise ValueError(
                f"{what}: every operand must be a contiguous 2-D bf16 tensor whose rows are a multiple of 8 "
                f"elements (16 bytes, as TMA reads them); got "
                f"{[(x.dtype, tuple(x.shape)) for x in tensors]}. Use model.mlp_impl=reference."
            )
    return _INTERPRETED


def _desc(t: torch.Tensor, block: list[int], as_bits: bool) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t.view(torch.int16) if as_bits else t, block)


def persistent_programs(device: torch.device, interpreted: bool) -> int:
    """The persistent kernels' program stride: one program an SM (a few under the interpreter, which has no
    SMs to fill); the grid is the fewer of this and the tiles."""
    if interpreted:
        return INTERPRETED_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(a, b, pre, out, forward: bool, store_pre: bool, as_bits: bool) -> None:
    m, k = a.shape
    n = b.shape[0]
    if m == 0:
        return
    sms = persistent_programs(a.device, as_bits)
    half = [BLOCK_M, BLOCK_N // 2]
    _relu2_gemm_kernel[(min(triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N), sms),)](
        _desc(a, [BLOCK_M, BLOCK_K], as_bits),
        _desc(b, [BLOCK_N, BLOCK_K], as_bits),
        _desc(pre, half, as_bits),
        _desc(out, half, as_bits),
        m,
        n,
        k,
        NUM_PROGRAMS=sms,  # the stride: one compiled kernel for every shape
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        FORWARD=forward,
        STORE_PRE=store_pre,
        AS_BITS=as_bits,
        enable_fp_fusion=False,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


def relu2_up(
    x: torch.Tensor, w1: torch.Tensor, store_pre: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(pre, post): pre = x @ w1.T rounded to bf16 (None unless ``store_pre``) and post = relu(pre)^2, for x
    [T, D] and w1 [hidden, D] (the bank's c_fc), both bf16."""
    as_bits = _checked("relu2_mlp.relu2_up", x, w1)
    if x.shape[1] != w1.shape[1]:
        raise ValueError(f"relu2_mlp.relu2_up: x {tuple(x.shape)} and w1 {tuple(w1.shape)} differ in D.")
    post = x.new_empty((x.shape[0], w1.shape[0]))
    pre = torch.empty_like(post) if store_pre else None
    # without pre, its descriptor points at post and is never stored through
    _launch(x, w1, post if pre is None else pre, post, True, store_pre, as_bits)
    return pre, post


def relu2_up_grad(grad: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """dpre [T, hidden]: the gradient of relu(pre)^2 @ w2 at pre, from its output's gradient ``grad`` [T, D]
    and w2 [hidden, D] (the bank's c_proj), all bf16."""
    as_bits = _checked("relu2_mlp.relu2_up_grad", grad, w2, pre)
    if grad.shape[1] != w2.shape[1] or pre.shape != (grad.shape[0], w2.shape[0]):
        raise ValueError(
            f"relu2_mlp.relu2_up_grad: grad {tuple(grad.shape)}, w2 {tuple(w2.shape)} and pre "
            f"{tuple(pre.shape)} do not make grad @ w2.T the shape of pre."
        )
    dpre = torch.empty_like(pre)
    _launch(grad, w2, pre, dpre, False, False, as_bits)
    return dpre
