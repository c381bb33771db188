"""Triton kernels for the symmetric products of ANVIL's orthogonalisation cascade (``optim.cascade_gram``).

What it replaces (``cascade_gram="bmm"``): in each of the cascade's six rounds
(:mod:`track_1_short.optim.polar_express`) the Gram matrix A = X^T X (tall X) or X X^T (wide X) as a
``torch.bmm`` and the polynomial b A + c A A as a ``torch.baddbmm``. Both results are symmetric s x s
matrices (s = the smaller side of X), yet a general GEMM computes every one of their s^2 entries.

Why it was expected to be faster: the kernels cut the s x s output into square tiles and run programs only for
the tiles (i, j) with i <= j, writing each result at (i, j) and its transpose at (j, i): T (T + 1) / 2 of the
T^2 tiles, so a little over half the multiply-adds of those two products (for A A, A A^T is what is
computed: equal for a symmetric A). The application X <- a X + X (b A + c A A) is not symmetric and stays a
``torch.baddbmm``. Measured slower at the record's bank shapes, so the record presets keep cuBLAS (opt-in
only): on one H100 the cascade for all banks took 4.43 ms with bmm and 5.89 ms with these kernels
(perf/RESULTS.md, optimizer_triton.json, ``perf/bench_optimizer.py --cascade-gram bmm triton``).

Interface: ``gram_`` and ``sym_poly_`` write into a given output (eager only); ``sym_gram`` and ``sym_poly``
return a new tensor and are custom ops (``torch.ops.track_1_short.sym_gram`` / ``sym_poly``), so that a
``torch.compile(fullgraph=True)`` region (``optim.bank_update=compiled``) holds them without a graph break:
on a GPU ``torch.library.triton_op`` (the launch goes through ``wrap_triton``, so Inductor sees and launches
the kernel itself), under the interpreter an opaque ``torch.library.custom_op`` with a shape-only fake.
Batched over dim 0, bf16 in, bf16 out, one launch a call: the grid is (upper-triangular tile index, batch).
On the CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 before this module is
imported, as the test session and a CPU training run set it); elsewhere :func:`check_device` refuses.

Numerics:
- Products of bf16 values are exact in fp32 and ``tl.dot`` accumulates in fp32, so each output element is the
  fp32 sum of the exact products in some order, rounded once to bf16 (to nearest even, in integer arithmetic:
  kernels/bf16_bits.py, so the interpreter rounds as the GPU does; it otherwise truncates). torch.bmm on bf16
  makes the same contract with its own summation order, so the two agree to a rounding bound, not bitwise.
- ``sym_poly`` computes c * (A A) + b * A in fp32 from the fp32 accumulator and the exactly widened bf16 A,
  then rounds once to bf16: the order of cuBLAS's epilogue (alpha * acc + beta * C in the fp32 compute type)
  behind torch.baddbmm(A, A, A, beta=b, alpha=c) on CUDA. The GPU compiler may contract it into one fma.
- Exact symmetry: every element is written once, the upper triangle from its tile's accumulator and the
  strict lower triangle as that value's mirror (the diagonal tiles store only their upper half), so
  out == out.mT bitwise whatever the summation order.
- Under Triton's interpreter (CPU) bf16 ``tl.dot`` gives wrong values, so there the tiles are widened to fp32
  exactly and multiplied with ``input_precision="ieee"``: the same exact products, still accumulated in fp32.

Invariants (tests/perf/test_sym_gram.py; the CUDA ones run under ``pytest -m gpu``): bitwise symmetry; each
element within one bf16 ulp plus the fp32 accumulation bound of the fp32 reference rounded to bf16, and of
torch.bmm / the fp32 polynomial; tall and wide inputs, sizes that are not multiples of the tiles, batches,
the zero matrix; the cascade with these kernels agrees with the bmm cascade within the bound its own tests
accept.

Provenance: upstream's track-1 record #360 computes these products with symmetric Triton kernels (``XXT``,
``XTX``, ``ba_plus_cAA`` in modded-nanogpt's ``track_1_short/perf/kernels/polar_express.py``: the tiles on or
above the diagonal, mirrored); the tiling (a K loop of ``tl.dot`` on BLOCK x BLOCK_K by BLOCK_K x BLOCK tiles
into an fp32 accumulator) is that of Triton's matrix-multiplication tutorial. Written here from those
descriptions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import load_bf16, round_to_bf16_bits
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted

DEFAULT_BLOCK = 128  # output tile side: 128 x 128 fp32 accumulator over 8 warps (Hopper)
DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 8
DEFAULT_NUM_STAGES = 3


@triton.jit
def _sym_gram_kernel(
    x_ptr,  # [B, ., .] bf16 (int16 bits when WIDEN); row p of the product is x[b] read along s_stride
    out_ptr,  # [B, s, s] int16 bits of the bf16 result
    s,
    k_len,
    x_batch_stride,
    x_s_stride,  # step between the product's rows (and columns)
    x_k_stride,  # step along the summed dimension
    out_batch_stride,
    out_row_stride,
    out_col_stride,
    b_coef,
    c_coef,
    POLY: tl.constexpr,  # out = c * (x x^T) + b * x, x square and symmetric; else out = the Gram
    WIDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Tile t of the upper triangle, numbered column by column: t = j (j + 1) / 2 + i with 0 <= i <= j. The
    # float square root may be off by one near a perfect square; the two corrections settle it.
    t = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    j = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    j = tl.where((j + 1) * (j + 2) // 2 <= t, j + 1, j)
    j = tl.where(j * (j + 1) // 2 > t, j - 1, j)
    i = t - j * (j + 1) // 2

    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    x_base = x_ptr + batch * x_batch_stride
    rows_in = rows < s
    cols_in = cols < s
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        k_in = (k0 + ks) < k_len
        lhs_ptrs = x_base + rows[:, None] * x_s_stride + (k0 + ks)[None, :] * x_k_stride
        rhs_ptrs = x_base + (k0 + ks)[:, None] * x_k_stride + cols[None, :] * x_s_stride
        lhs = load_bf16(lhs_ptrs, rows_in[:, None] & k_in[None, :], WIDEN)
        rhs = load_bf16(rhs_ptrs, k_in[:, None] & cols_in[None, :], WIDEN)
        if WIDEN:
            acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
        else:
            acc = tl.dot(lhs, rhs, acc)

    if POLY:
        # x is A itself here: A[p, q] sits at p * x_s_stride + q * x_k_stride.
        a_ptrs = x_base + rows[:, None] * x_s_stride + cols[None, :] * x_k_stride
        a = load_bf16(a_ptrs, rows_in[:, None] & cols_in[None, :], WIDEN).to(tl.float32)
        # In fp32 whatever the launcher passed: Inductor hands Python floats to a kernel as fp64 scalars,
        # a plain launch as fp32 (the same coefficients once rounded to fp32, so the same bits).
        acc = tl.cast(c_coef, tl.float32) * acc + tl.cast(b_coef, tl.float32) * a
    bits = round_to_bf16_bits(acc)

    in_bounds = rows_in[:, None] & cols_in[None, :]
    out_base = out_ptr + batch * out_batch_stride
    upper = out_base + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride
    tl.store(upper, bits, mask=in_bounds & (rows[:, None] <= cols[None, :]))
    # The mirror: element (q, p) of the output takes (p, q)'s bits, for p < q only, so the diagonal is
    # written once and a diagonal tile's own lower half (summed separately) is never stored.
    lower = out_base + cols[:, None] * out_row_stride + rows[None, :] * out_col_stride
    mirrored = tl.trans(bits)
    mirror_in = cols_in[:, None] & rows_in[None, :] & (cols[:, None] > rows[None, :])
    tl.store(lower, mirrored, mask=mirror_in)


# Once, at import (runs_interpreted says why).
_INTERPRETED = runs_interpreted(_sym_gram_kernel)


def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (TRITON_INTERPRET=1 when this module was loaded)."""
    return _INTERPRETED


def check_device(device: torch.device | str, what: str) -> None:
    """Raise a RuntimeError naming ``what`` unless these kernels can run on ``device`` (CUDA, or any device
    under Triton's interpreter)."""
    _check_device(device, what, interpreted(), "sym_gram", "optim.cascade_gram=bmm")


def _check_block(block: int, block_k: int) -> None:
    for name, value in (("block", block), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(
                f"sym_gram: {name} must be a power of two >= 16 (tl.dot's least tile), got {value}"
            )


def _check_input(what: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: expected a batch of matrices [B, rows, cols], got {shape}.")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{what}: expected a bf16 tensor, got {x.dtype}; cast it with .bfloat16().")
    check_device(x.device, what)


def _check_output(what: str, x: torch.Tensor, out: torch.Tensor, s: int) -> None:
    shape = (x.size(0), s, s)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != torch.bfloat16:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{what}: out must be a bf16 tensor of shape {shape}, got {got}.")
    if out.device != x.device:
        raise ValueError(f"{what}: out is on {out.device}, the input on {x.device}; put both on one device.")
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        # Programs read tiles of the input while others write theirs: an in-place call would race.
        raise ValueError(f"{what}: out shares storage with the input; give it a buffer of its own.")


def _launch(x, out, s, k_len, s_stride, k_stride, b_coef, c_coef, poly, block, block_k, warps, stages):
    tiles = triton.cdiv(s, block)
    grid = (tiles * (tiles + 1) // 2, x.size(0))
    if grid[0] == 0 or grid[1] == 0:
        return
    widen = interpreted()
    torch.library.wrap_triton(_sym_gram_kernel)[grid](
        x.view(torch.int16) if widen else x,
        out.view(torch.int16),
        s,
        k_len,
        x.stride(0),
        s_stride,
        k_stride,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        float(b_coef),
        float(c_coef),
        POLY=poly,
        WIDEN=widen,
        BLOCK=block,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )


def _gram_geometry(x: torch.Tensor, tall: bool) -> tuple[int, int, int, int]:
    # (s, K, step between the product's rows, step along K): X^T X sums over rows, X X^T over columns.
    if tall:
        return x.size(2), x.size(1), x.stride(2), x.stride(1)
    return x.size(1), x.size(2), x.stride(1), x.stride(2)


def gram_(
    x: torch.Tensor,
    out: torch.Tensor,
    tall: bool,
    *,
    block: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK_K,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
) -> torch.Tensor:
    """out[b] = x[b]^T x[b] if ``tall`` else x[b] x[b]^T, exactly symmetric; x bf16 [B, rows, cols], out bf16
    [B, s, s] with s = cols if tall else rows (not sharing x's storage). Returns ``out``."""
    _check_block(block, block_k)
    _check_input("gram_", x)
    s, k_len, s_stride, k_stride = _gram_geometry(x, bool(tall))
    _check_output("gram_", x, out, s)
    _launch(x, out, s, k_len, s_stride, k_stride, 0.0, 1.0, False, block, block_k, num_warps, num_stages)
    return out


def sym_poly_(
    a: torch.Tensor,
    out: torch.Tensor,
    b_coef: float,
    c_coef: float,
    *,
    block: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK_K,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
) -> torch.Tensor:
    """out[b] = b_coef * a[b] + c_coef * a[b] a[b] for symmetric bf16 a [B, s, s], exactly symmetric, into
    bf16 ``out`` [B, s, s] (not sharing a's storage). Returns ``out``.

    Symmetry of ``a`` is the caller's promise (checking it would cost a pass): what is computed is
    a a^T, and only a's upper triangle enters b_coef * a."""
    _check_block(block, block_k)
    _check_input("sym_poly_", a)
    if a.size(1) != a.size(2):
        raise ValueError(f"sym_poly_: a must be square [B, s, s], got {tuple(a.shape)}.")
    s = a.size(1)
    _check_output("sym_poly_", a, out, s)
    _launch(
        a, out, s, s, a.stride(1), a.stride(2), b_coef, c_coef, True, block, block_k, num_warps, num_stages
    )
    return out


def _new_gram(x: torch.Tensor, tall: bool) -> torch.Tensor:
    s = x.size(2) if tall else x.size(1)
    return x.new_empty((x.size(0), s, s))


def _new_poly(a: torch.Tensor, b_coef: float, c_coef: float) -> torch.Tensor:
    return a.new_empty(a.shape)


def _custom_op(name: str, fake):
    """On a GPU a ``triton_op`` (torch.compile sees the kernel through wrap_triton and Inductor launches it);
    under the interpreter an opaque ``custom_op`` with a fake (shape-only) implementation: there
    torch.compile's fake tracing of a triton_op's body would run the interpreted kernel on fake tensors."""

    def register(fn):
        if not interpreted():
            return torch.library.triton_op(name, mutates_args=())(fn)
        op = torch.library.custom_op(name, mutates_args=())(fn)
        op.register_fake(fake)
        return op

    return register


@_custom_op("track_1_short::sym_gram", _new_gram)
def sym_gram(x: torch.Tensor, tall: bool) -> torch.Tensor:
    """:func:`gram_` into a new tensor (a custom op: traceable by torch.compile; default tiles)."""
    _check_input("sym_gram", x)
    s, k_len, s_stride, k_stride = _gram_geometry(x, tall)
    out = _new_gram(x, tall)
    _launch(
        x, out, s, k_len, s_stride, k_stride, 0.0, 1.0, False,
        DEFAULT_BLOCK, DEFAULT_BLOCK_K, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES,
    )  # fmt: skip
    return out


@_custom_op("track_1_short::sym_poly", _new_poly)
def sym_poly(a: torch.Tensor, b_coef: float, c_coef: float) -> torch.Tensor:
    """:func:`sym_poly_` into a new tensor (a custom op: traceable by torch.compile; default tiles)."""
    _check_input("sym_poly", a)
    if a.size(1) != a.size(2):
        raise ValueError(f"sym_poly: a must be square [B, s, s], got {tuple(a.shape)}.")
    s = a.size(1)
    out = _new_poly(a, b_coef, c_coef)
    _launch(
        a, out, s, s, a.stride(1), a.stride(2), b_coef, c_coef, True,
        DEFAULT_BLOCK, DEFAULT_BLOCK_K, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES,
    )  # fmt: skip
    return out
