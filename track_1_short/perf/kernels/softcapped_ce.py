"""Triton kernel of the fused softcapped cross-entropy: one program per row of a [rows, V] logit block.

``softcapped_ce_rows_`` takes a chunk's logits l = x W (the GEMM's output, bf16 or fp32, no bias: the shift
and temperature are applied here, in fp32, so the GEMM needs no broadcast bias materialised over [rows, V]
first), and per row computes with u = (l + shift) * (1 / temperature), s = sigmoid(u), z = cap * s:
- the loss sum_k c_k (lse - z[t_k]), lse = cap + log(sum_j exp(z_j - cap)) (z <= cap: cap is a safe fixed max,
  so one pass sums the exponentials without rescaling), c_k = mtp weight k x (target t + k exists);
- with WRITE_GRAD, the gradient with respect to the logit l, over l in place and in l's dtype:
  dz/dl = (cap / temperature) s (1 - s), so with q = row_weight x (cap / temperature) x exp(z - cap) x s /
  sum_e, minus (cap / temperature) x c_k x s[t_k] at each target t_k, g = q (1 - s), computed as q - q s (the
  reference's rounding order).

With a prefix target (HAS_PREFIX: the prefix-token term of model/prefix_targets.py) the row has one more
target column p with its own coefficient c_p (the prefix weight, 0 where the row has none): the loss adds
c_p (lse - z[p]) and the gradient c_p's one-hot term at p, apart from the K-vector so that c_p = 0 adds exact
zeros (bitwise the loss without the term; row_weight then carries the prefix weight too, as upstream's S_w).
The sampled softmax (model/sampled_softmax.py) runs this same kernel on a [rows, P] block of the candidates'
logits, its targets given as positions among the candidates: one kernel family for both.

Two passes over the row (the sum, then the gradient) read l twice and write g once: about 3 x 2 bytes per
logit in bf16, where the reference (model/layers.py, eager torch ops over fp32 [rows, V] buffers) moves about
60. The one-hot terms touch K columns of the row: the second pass writes every column without them, and after
a block barrier (every store of the pass has landed) the K target columns are written again with them, rather
than comparing every column with the K targets. Each element is otherwise read and written by the same
program only, so the in-place gradient is race-free.

bf16 loads widen exactly and bf16 stores round to nearest even in integer arithmetic (kernels/bf16_bits.py),
so the interpreter and the GPU round alike. exp, log and sigmoid are Triton's (approximate on the GPU, within
a few fp32 ulps), and the row sum is a tree: results agree with the reference to a bound, not bitwise
(tests/perf/test_softcapped_ce.py says which and why).

The idea, computing the loss and the logit gradient in one pass over a chunk's logits so that no fp32 [rows,
V] intermediate is ever written, is the fused cross-entropy of upstream's record (its Triton cross-entropy
kernel for the softcapped head) and of Liger-style fused linear cross-entropy; this kernel is written for this
project's MTP targets and rounding order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import round_to_bf16_bits, widen_bf16

BLOCK_GPU = 2048  # columns per loop iteration: 8 warps x 32 lanes x 8 elements
BLOCK_INTERPRETER = 1 << 16  # one numpy operation per row under the interpreter
_NUM_WARPS = 8


@triton.jit
def _load_u(row_ptr, cols, mask, IS_BF16: tl.constexpr):
    # One return: Triton type-checks every return of a function, even under a constexpr branch not taken.
    if IS_BF16:
        u = widen_bf16(tl.load(row_ptr + cols, mask=mask, other=0))
    else:
        u = tl.load(row_ptr + cols, mask=mask, other=0.0)
    return u


@triton.jit
def _load_sigmoid(row_ptr, cols, mask, shift, inv_t, IS_BF16: tl.constexpr):
    # s = sigmoid((l + shift) * inv_t) in fp32: the same operations wherever a column's s is needed.
    return tl.sigmoid((_load_u(row_ptr, cols, mask, IS_BF16) + shift) * inv_t)


@triton.jit
def _ce_row(
    row,
    u_ptr,
    u_stride,
    tgt_ptr,
    coef_ptr,
    row_weight_ptr,
    loss_ptr,
    tgt_stride,
    lo,
    V,
    cap,
    shift,
    inv_t,
    grad_scale,
    p_tgt_ptr,
    p_coef_ptr,
    K: tl.constexpr,
    KP: tl.constexpr,
    IS_BF16: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    # One row's loss and, with WRITE_GRAD, its gradient over its logits (the kernel's arguments below).
    row_ptr = u_ptr + tl.cast(row, tl.int64) * u_stride  # rows x V passes 2^31 at the record's chunk
    col = lo + row
    cols = tl.arange(0, BLOCK)

    # The K targets of this row as one small vector, read before pass 2 overwrites any of the row with its
    # gradient (a target's sigmoid is needed after its column may already hold g).
    ks = tl.arange(0, KP)
    kmask = ks < K
    t_vec = tl.load(tgt_ptr + ks * tgt_stride + col, mask=kmask, other=0)
    c_vec = tl.load(coef_ptr + ks * tgt_stride + col, mask=kmask, other=0.0)
    s_t = _load_sigmoid(row_ptr, t_vec, kmask, shift, inv_t, IS_BF16)
    if HAS_PREFIX:
        # The prefix target: one more column with its own coefficient (0 where the row has none, its column
        # then clamped to 0), kept apart from the K-vector so that a zero weight adds exact zeros only.
        p_t = tl.load(p_tgt_ptr + col)
        p_c = tl.load(p_coef_ptr + col)
        s_p = _load_sigmoid(row_ptr, p_t, True, shift, inv_t, IS_BF16)

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        s = _load_sigmoid(row_ptr, idx, mask, shift, inv_t, IS_BF16)
        acc += tl.where(mask, tl.exp(cap * s - cap), 0.0)
    sum_e = tl.sum(acc, axis=0)
    lse = cap + tl.log(sum_e)
    row_loss = tl.sum(tl.where(kmask, c_vec * (lse - cap * s_t), 0.0), axis=0)
    if HAS_PREFIX:
        row_loss += p_c * (lse - cap * s_p)
    tl.store(loss_ptr + row, row_loss)

    if WRITE_GRAD:
        scale = tl.math.div_rn(tl.load(row_weight_ptr + col) * grad_scale, sum_e)
        for start in range(0, V, BLOCK):
            idx = start + cols
            mask = idx < V
            s = _load_sigmoid(row_ptr, idx, mask, shift, inv_t, IS_BF16)
            q = tl.exp(cap * s - cap) * s * scale
            g = q - q * s
            if IS_BF16:
                tl.store(row_ptr + idx, round_to_bf16_bits(g), mask=mask)
            else:
                tl.store(row_ptr + idx, g, mask=mask)
        # The K target columns again, now with their one-hot terms, once every store above has landed
        # (the barrier orders this block's global stores). Repeated targets add up, as the reference's
        # scatter_add does; a target past the batch's end (coefficient 0) rewrites its column with the
        # value it has.
        tl.debug_barrier()
        d_vec = tl.where(kmask, -grad_scale * c_vec * s_t, 0.0)
        d_sum = tl.sum(tl.where(t_vec[:, None] == t_vec[None, :], d_vec[None, :], 0.0), axis=1)
        if HAS_PREFIX:
            # A column that is both an MTP target and the prefix target takes both one-hot terms; both
            # stores below then write the same value.
            d_p = -grad_scale * p_c * s_p
            d_sum += tl.where(t_vec == p_t, d_p, 0.0)
            d_p += tl.sum(tl.where(t_vec == p_t, d_vec, 0.0), axis=0)
            q_p = tl.exp(cap * s_p - cap) * s_p * scale + d_p
            g_p = q_p - q_p * s_p
        q_t = tl.exp(cap * s_t - cap) * s_t * scale + d_sum
        g_t = q_t - q_t * s_t
        if IS_BF16:
            tl.store(row_ptr + t_vec, round_to_bf16_bits(g_t), mask=kmask)
        else:
            tl.store(row_ptr + t_vec, g_t, mask=kmask)
        if HAS_PREFIX:
            if IS_BF16:
                tl.store(row_ptr + p_t, round_to_bf16_bits(g_p))
            else:
                tl.store(row_ptr + p_t, g_p)


@triton.jit
def _softcapped_ce_rows_kernel(
    u_ptr,  # logits [rows, V] (int16 bits when IS_BF16), row stride u_stride; the gradient overwrites them
    u_stride,
    tgt_ptr,  # int64 [K, tgt_stride]: targets of row r at column lo + r (clamped where invalid)
    coef_ptr,  # fp32 [K, tgt_stride]: mtp weight k where target t + k exists, else 0
    row_weight_ptr,  # fp32 [tgt_stride]: softmax normaliser weight per row
    loss_ptr,  # fp32 [rows] out
    tgt_stride,
    lo,
    V,
    cap,
    shift,
    inv_t,  # 1 / temperature (fp32)
    grad_scale,  # cap / temperature
    p_tgt_ptr,  # int64 [tgt_stride]: the prefix target of row r at column lo + r (0 where it has none)
    p_coef_ptr,  # fp32 [tgt_stride]: the prefix weight where row r has a prefix target, else 0
    K: tl.constexpr,
    KP: tl.constexpr,  # K rounded up to a power of two (Triton's vector sizes)
    IS_BF16: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    args = (
        u_ptr,
        u_stride,
        tgt_ptr,
        coef_ptr,
        row_weight_ptr,
        loss_ptr,
        tgt_stride,
        lo,
        V,
        cap,
        shift,
        inv_t,
    )
    _ce_row(
        tl.program_id(0),
        *args,
        grad_scale,
        p_tgt_ptr,
        p_coef_ptr,
        K,
        KP,
        IS_BF16,
        WRITE_GRAD,
        BLOCK,
        HAS_PREFIX,
    )


def softcapped_ce_rows_(
    u: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    row_weight: torch.Tensor,
    lo: int,
    cap: float,
    shift: float,
    temperature: float,
    write_grad: bool,
    *,
    block: int | None = None,
    num_warps: int = _NUM_WARPS,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-row losses (fp32 [rows]) of the logit block ``u`` [rows, V], the rows lo .. lo + rows of the batch.

    u: the logits x W, bf16 or fp32, rows contiguous (the softcap's argument is (u + shift) / temperature,
    formed in fp32 here); with ``write_grad`` it is overwritten by d(loss)/du in its own dtype. targets int64
    [K, T] (clamped to the batch), coef fp32 [K, T] (the weight of target k of row t, 0 where t + k >= T),
    row_weight fp32 [T] (the softmax normaliser weight of every row). All on u's device.

    block, num_warps: the columns of a loop iteration (None: BLOCK_GPU on CUDA, the whole row under the
    interpreter) and the warps of a program. prefix: (int64 [T] prefix target, clamped to a column; fp32 [T]
    its weight, 0 where the row has none), or None for no prefix term. The row_weight passed in already counts
    the prefix weight.
    """
    rows, vocab = u.shape
    k = targets.size(0)
    if u.dtype not in (torch.bfloat16, torch.float32) or u.stride(1) != 1:
        raise ValueError(f"softcapped_ce_rows_: u must be bf16 or fp32 with contiguous rows, got {u.dtype}")
    if targets.shape != coef.shape or not (targets.is_contiguous() and coef.is_contiguous()):
        raise ValueError("softcapped_ce_rows_: targets and coef must be contiguous [K, T] tensors")
    loss = torch.empty(rows, dtype=torch.float32, device=u.device)
    is_bf16 = u.dtype == torch.bfloat16
    on_gpu = u.device.type == "cuda"
    if block is None:
        block = BLOCK_GPU if on_gpu else min(BLOCK_INTERPRETER, triton.next_power_of_2(vocab))
    grid = (rows,)
    if prefix is not None and not (prefix[0].is_contiguous() and prefix[1].is_contiguous()):
        raise ValueError("softcapped_ce_rows_: the prefix targets and weights must be contiguous [T] tensors")
    p_tgt, p_coef = prefix if prefix is not None else (targets, coef)  # unread without HAS_PREFIX
    _softcapped_ce_rows_kernel[grid](
        u.view(torch.int16) if is_bf16 else u,
        u.stride(0),
        targets,
        coef,
        row_weight,
        loss,
        targets.size(1),
        lo,
        vocab,
        float(cap),
        float(shift),
        1.0 / float(temperature),
        float(cap) / float(temperature),
        p_tgt,
        p_coef,
        K=k,
        KP=max(2, triton.next_power_of_2(k)),
        IS_BF16=is_bf16,
        WRITE_GRAD=write_grad,
        BLOCK=block,
        HAS_PREFIX=prefix is not None,
        num_warps=num_warps,
    )
    return loss
