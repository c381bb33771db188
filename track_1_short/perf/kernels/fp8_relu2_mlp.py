"""The FP8 MLP's up-projection GEMMs with the activation and the next GEMM's FP8 operand in their epilogues.

What it replaces: in model/fp8.py's FP8ReLU2MLP (``model.fp8.mlp_impl=scaled_mm``), two pairs of kernels a
layer and micro batch. Forward: ``torch._scaled_mm`` writes pre = x W1^T (bf16), then the one-pass
quantise reads it back and writes relu(pre)^2 in e4m3, row-major and transposed, with its amax and clip
count. Backward: ``_scaled_mm`` writes dpost = g W2^T (bf16), then the quantise reads dpost and pre and
writes dpre = 2 dpost relu(pre) in e5m2, both layouts, with its amax and clip count.

Why it is faster: one persistent Triton GEMM each way (FP8 operands, TMA, fp32 accumulator), whose epilogue
does the quantise on the tile it holds: the forward stores pre (the backward's) and both e4m3 layouts of
post and never reads pre back; the backward never writes dpost. At the record's shapes (65,536 x 2,816)
that is 0.37 GB of reads a forward and 0.74 GB of traffic a backward less, and a launch fewer each.

Invariants (tests/perf/test_fp8_relu2_mlp.py, under the interpreter on the CPU; ``gpu`` on CUDA): given the
same fp32 accumulators, the bits of the reference (model/fp8.py's ``fp8_mm`` then ``quantize_both``): pre
and dpost rounded to bf16 from acc * (scale_a scale_b), post = bf16(relu(pre)^2), dpre = 2 dpost relu(pre)
in fp32, v / scale rounded to the format's grid (fp8_quantize.on_fp8_grid), the clip counts, and the amax.
Where the FP8 GEMM's sums are exact (operands on a coarse grid) every output equals the reference's bit
for bit; on a GPU the sums differ from cuBLAS's in order (and Hopper's FP8 accumulation), within the bound
tests/model/test_fp8.py states for ``_scaled_mm``.

Provenance: record #92 emits its FP8 operands from the MLP GEMMs' epilogues (upstream perf/kernels/mlp.py
@ 55865738, which drops pre and rebuilds relu(pre) from the e4m3 post); here pre is kept, so the kernel
gives the reference's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from track_1_short.perf.kernels.fp8_quantize import grid_constants, on_fp8_grid
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted
from track_1_short.perf.kernels.relu2_mlp import (
    gemm_tile,
    load_tile,
    persistent_programs,
    rounded_bf16,
    split_halves,
    store_bf16,
    tile_count,
    tile_origin,
)

# 128 x 256 output tiles, K in steps of 128 (FP8: the bytes of the bf16 kernel's 64), eight warps, three
# stages (about 197 KB of shared memory with the epilogue's buffers; four would not fit an H100 block). The
# epilogue runs on halves: quarters spilled more registers (172 bytes against 28 in the forward).
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 128
NUM_WARPS = 8
NUM_STAGES = 3


@triton.jit
def _quantized_store(
    v,
    q_desc,
    qt_desc,
    m,
    n,
    scale,
    amax_ptr,
    clips_ptr,
    site,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FMAX: tl.constexpr,
    CLIP: tl.constexpr,
    E5M2: tl.constexpr,
):
    # v / scale in the format, stored at (m, n) and transposed at (n, m); its amax and clip count added.
    # Rows and columns beyond the ends hold v = 0 (TMA reads zeros there): they raise neither.
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(v), 1), 0))
    y = tl.math.div_rn(v, scale)
    tl.atomic_add(clips_ptr + site, tl.sum(tl.sum((tl.abs(y) > CLIP).to(tl.int64), 1), 0))
    y = on_fp8_grid(y, MANT, MIN_EXP, FMAX)
    if E5M2:
        q = y.to(tl.float8e5)
        q_desc.store([m, n], q)
        qt_desc.store([n, m], tl.trans(q))
    else:
        q = y.to(tl.float8e4nv)
        q_desc.store([m, n], q)
        qt_desc.store([n, m], tl.trans(q))


@triton.jit
def _fp8_relu2_gemm_kernel(
    a_desc,
    b_desc,
    pre_desc,
    q_desc,
    qt_desc,
    a_scale_ptr,
    b_scale_ptr,
    q_scale_ptr,
    amax_ptr,
    clips_ptr,
    site,
    n_sites,
    M,
    N,
    K,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FORWARD: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FMAX: tl.constexpr,
    CLIP: tl.constexpr,
    AS_BITS: tl.constexpr,
):
    # acc = A @ B.T (FP8 A [M, K], B [N, K]), scaled by a_scale b_scale. Forward (A = x, B = W1): pre =
    # bf16(acc) stored, v = bf16(relu(pre)^2) in e4m3. Backward (A = g, B = W2): dpost = bf16(acc), v =
    # 2 dpost relu(pre) (pre read) in e5m2. v's format grid, amax and clip count as quantize_both's.
    s = tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
    q_scale = tl.load(q_scale_ptr)
    if tl.program_id(0) == 0:
        tl.atomic_add(clips_ptr + n_sites + site, M.to(tl.int64) * N)  # the elements seen
    half: tl.constexpr = BLOCK_N // 2
    for tile in tl.range(tl.program_id(0), tile_count(M, N, BLOCK_M, BLOCK_N), NUM_PROGRAMS, flatten=True):
        m, n = tile_origin(tile, N, BLOCK_M, BLOCK_N)
        # both ways with Triton's FP8 accumulation on sm_90 (the tensor cores' accumulator over all of K, as
        # cuBLAS's use_fast_accum), as upstream's kernel: the gradient's exact-fp32 form (adds into a second
        # accumulator each K step) spilled 396 bytes of registers in this tile
        acc = gemm_tile(a_desc, b_desc, m, n, K, BLOCK_M, BLOCK_N, BLOCK_K, False)
        acc0, acc1 = split_halves(acc * s, BLOCK_M, BLOCK_N)
        for j in tl.static_range(2):
            col = n + j * half
            if j == 0:
                a = acc0
            else:
                a = acc1
            if FORWARD:
                pre = rounded_bf16(a, AS_BITS)
                store_bf16(pre_desc, [m, col], pre, AS_BITS)
                r = tl.where(pre < 0.0, 0.0, pre)  # relu as torch's: a NaN stays NaN
                v = rounded_bf16(r * r, AS_BITS)  # the bf16 square's rounding
            else:
                dpost = rounded_bf16(a, AS_BITS)
                pre = load_tile(pre_desc, [m, col], AS_BITS).to(tl.float32)
                v = (2.0 * dpost) * tl.where(pre < 0.0, 0.0, pre)
            _quantized_store(
                v, q_desc, qt_desc, m, col, q_scale, amax_ptr, clips_ptr, site, MANT, MIN_EXP, FMAX, CLIP,
                not FORWARD,
            )  # fmt: skip


_INTERPRETED = runs_interpreted(_fp8_relu2_gemm_kernel)  # once, at import (interpreter.runs_interpreted)


def _check(what: str, a: Tensor, b: Tensor, fmt: torch.dtype, pre: Tensor | None = None) -> None:
    _check_device(a.device, what, _INTERPRETED, "fp8_relu2_mlp", "model.fp8.mlp_impl=scaled_mm")
    m, k = a.shape
    if a.dtype != fmt or b.dtype != torch.float8_e4m3fn or b.shape[1] != k or (m | k | b.shape[0]) % 16:
        raise ValueError(
            f"{what}: A must be {fmt} [M, K] and B e4m3 [N, K], with M, N and K multiples of 16 (TMA reads "
            f"16-byte rows of both layouts); got A {a.dtype} {tuple(a.shape)}, B {b.dtype} {tuple(b.shape)}. "
            "Use micro batches that are multiples of 16 tokens, or model.fp8.mlp_impl=scaled_mm."
        )
    if pre is not None and (pre.dtype != torch.bfloat16 or pre.shape != (m, b.shape[0])):
        raise ValueError(f"{what}: pre must be bf16 {(m, b.shape[0])}, got {pre.dtype} {tuple(pre.shape)}.")


def _launch(a, b, pre, q, qt, scales, amax, clips, site, clip_at, forward: bool) -> None:
    m, k = a.shape
    n = b.shape[0]
    fmt = q.dtype
    sms = persistent_programs(a.device, _INTERPRETED)
    bf = (lambda t: t.view(torch.int16)) if _INTERPRETED else (lambda t: t)  # the interpreter: bf16 as bits
    half = [BLOCK_M, BLOCK_N // 2]
    _fp8_relu2_gemm_kernel[(min(triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N), sms),)](
        TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K]),
        TensorDescriptor.from_tensor(b, [BLOCK_N, BLOCK_K]),
        TensorDescriptor.from_tensor(bf(pre), half),
        TensorDescriptor.from_tensor(q, half),
        TensorDescriptor.from_tensor(qt, half[::-1]),
        *scales,
        amax,
        clips,
        site,
        clips.size(1),
        m,
        n,
        k,
        NUM_PROGRAMS=sms,  # the stride: one compiled kernel for every shape
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        FORWARD=forward,
        **grid_constants(fmt),
        CLIP=clip_at,
        AS_BITS=_INTERPRETED,
        enable_fp_fusion=False,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


@torch.library.custom_op("track_1_short::fp8_relu2_up", mutates_args=("amax", "clips"))
def fp8_relu2_up(
    xq: Tensor,
    w1q: Tensor,
    x_scale: Tensor,
    w1_scale: Tensor,
    post_scale: Tensor,
    amax: Tensor,
    clips: Tensor,
    site: int,
    clip_at: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(pre, post_q, post_qt): pre = (xq W1q^T) x_scale w1_scale in bf16 [T, hidden], and relu(pre)^2 in
    e4m3 at ``post_scale``, row-major and transposed; raises ``amax`` to max relu(pre)^2 and adds the
    saturated and seen elements to clips[0, site] and clips[1, site]. xq e4m3 [T, D], w1q e4m3 [hidden, D];
    scales fp32 0-D."""
    _check("fp8_relu2_mlp.fp8_relu2_up", xq, w1q, torch.float8_e4m3fn)
    t, h = xq.shape[0], w1q.shape[0]
    pre = torch.empty((t, h), dtype=torch.bfloat16, device=xq.device)
    q = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=xq.device)
    qt = torch.empty((h, t), dtype=torch.float8_e4m3fn, device=xq.device)
    if t:
        _launch(xq, w1q, pre, q, qt, (x_scale, w1_scale, post_scale), amax, clips, site, clip_at, True)
    return pre, q, qt


@fp8_relu2_up.register_fake
def _up_fake(xq, w1q, x_scale, w1_scale, post_scale, amax, clips, site, clip_at):
    t, h = xq.shape[0], w1q.shape[0]
    e4m3 = torch.float8_e4m3fn
    return (
        xq.new_empty((t, h), dtype=torch.bfloat16),
        xq.new_empty((t, h), dtype=e4m3),
        xq.new_empty((h, t), dtype=e4m3),
    )


@torch.library.custom_op("track_1_short::fp8_relu2_up_grad", mutates_args=("amax", "clips"))
def fp8_relu2_up_grad(
    gq: Tensor,
    w2q: Tensor,
    g_scale: Tensor,
    w2_scale: Tensor,
    pre: Tensor,
    dpre_scale: Tensor,
    amax: Tensor,
    clips: Tensor,
    site: int,
    clip_at: float,
) -> tuple[Tensor, Tensor]:
    """(dpre_q, dpre_qt): dpre = 2 dpost relu(pre) with dpost = (gq W2q^T) g_scale w2_scale rounded to
    bf16, in e5m2 at ``dpre_scale``, row-major [T, hidden] and transposed; ``amax`` and ``clips`` as
    :func:`fp8_relu2_up`'s. gq e5m2 [T, D], w2q e4m3 [hidden, D], pre bf16 [T, hidden]."""
    _check("fp8_relu2_mlp.fp8_relu2_up_grad", gq, w2q, torch.float8_e5m2, pre)
    t, h = pre.shape
    q = torch.empty((t, h), dtype=torch.float8_e5m2, device=gq.device)
    qt = torch.empty((h, t), dtype=torch.float8_e5m2, device=gq.device)
    if t:
        _launch(
            gq,
            w2q,
            pre.contiguous(),
            q,
            qt,
            (g_scale, w2_scale, dpre_scale),
            amax,
            clips,
            site,
            clip_at,
            False,
        )
    return q, qt


@fp8_relu2_up_grad.register_fake
def _up_grad_fake(gq, w2q, g_scale, w2_scale, pre, dpre_scale, amax, clips, site, clip_at):
    e5m2 = torch.float8_e5m2
    return pre.new_empty(pre.shape, dtype=e5m2), pre.new_empty((pre.shape[1], pre.shape[0]), dtype=e5m2)
