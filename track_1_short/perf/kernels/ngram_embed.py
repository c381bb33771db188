"""Two Triton kernels: the n-gram embedding read straight from the cycle's cache, and its rows' gradient.

What they replace: model/ngram.py's reference, ``ngram_embedding(cache[slots], sign_pool, signs)`` and its
gradient ``cat([g, g]) * sign_pool[signs]``: a [2T, dim] gather of the rows, a [2T, dim] gather of their
sign rows, their product, then the sum of its halves (four passes over [2T, dim] tensors and two
temporaries), and in the backward the same again.

Why they are faster: one pass each way. The forward reads each position's two rows from the cache and its two
sign rows from the pool (8,192 rows: it stays in L2), and writes the [T, dim] sum once; the backward reads
the output's gradient once and writes both channels' row gradients. Behind the model's custom op
(model/ngram.py ``ngram_embed``) the compiler sees neither the gathers nor the sum, so it cannot recompute
them in every consumer of the embedding, as it may with plain gathers (record #92 measured that at 3.4 ms a
step).

Invariants (tests/perf/test_ngram_embed.py, under the interpreter on the CPU and on the GPU): the bits of the
reference, both ways. The sign rows are exactly +-1, so each product is exact and the forward's only
rounding is the sum's, to fp32 and then to the table's dtype, as the reference's bf16 add rounds it; the
backward's products are exact.

Provenance: record #92 fuses the same lookup into one kernel each way (upstream perf/kernels/ngram_embed.py
@ f380c1f0, which also hashes the sign rows in the kernel; here the signs come hashed with the rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import load_bf16, round_to_bf16_bits
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted

BLOCK_T = 4  # positions a program


@triton.jit
def _store_bf16(ptrs, x, mask, AS_BITS: tl.constexpr):
    # fp32 -> bf16, nearest even: as int16 bits (the interpreter rounds toward zero) or a plain cast (the GPU)
    if AS_BITS:
        tl.store(ptrs, round_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptrs, x.to(tl.bfloat16), mask=mask)


@triton.jit
def _tile(T, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # this program's positions and columns, and their masks
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    t_mask = t < T
    return t, cols, t_mask, t_mask[:, None] & (cols < D)[None, :]


@triton.jit
def _rows(base_ptr, index, cols, D: tl.constexpr):
    # pointers to the rows ``index`` of a [*, D] tensor (int64 offsets: a cache exceeds 2**31 elements)
    return base_ptr + index[:, None].to(tl.int64) * D + cols[None, :]


@triton.jit
def _signed_rows(pool_ptr, signs_ptr, at, t_mask, cols, mask, D: tl.constexpr, AS_BITS: tl.constexpr):
    sign = tl.load(signs_ptr + at, mask=t_mask, other=0)
    return load_bf16(_rows(pool_ptr, sign, cols, D), mask, AS_BITS).to(tl.float32)


@triton.jit
def _embed_forward_kernel(
    out_ptr,
    cache_ptr,
    slots_ptr,
    pool_ptr,
    signs_ptr,
    T,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    AS_BITS: tl.constexpr,
):
    t, cols, t_mask, mask = _tile(T, D, BLOCK_T, BLOCK_D)
    total = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for channel in tl.static_range(2):  # bigram rows at [0, T), trigram rows at [T, 2T)
        at = channel * T + t
        slot = tl.load(slots_ptr + at, mask=t_mask, other=0)
        row = load_bf16(_rows(cache_ptr, slot, cols, D), mask, AS_BITS).to(tl.float32)
        total += row * _signed_rows(pool_ptr, signs_ptr, at, t_mask, cols, mask, D, AS_BITS)
    _store_bf16(_rows(out_ptr, t, cols, D), total, mask, AS_BITS)


@triton.jit
def _embed_backward_kernel(
    out_ptr,
    grad_ptr,
    pool_ptr,
    signs_ptr,
    T,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    AS_BITS: tl.constexpr,
):
    t, cols, t_mask, mask = _tile(T, D, BLOCK_T, BLOCK_D)
    g = load_bf16(_rows(grad_ptr, t, cols, D), mask, AS_BITS).to(tl.float32)
    for channel in tl.static_range(2):
        at = channel * T + t
        sign = _signed_rows(pool_ptr, signs_ptr, at, t_mask, cols, mask, D, AS_BITS)
        _store_bf16(_rows(out_ptr, at, cols, D), g * sign, mask, AS_BITS)


# once, at import (interpreter.runs_interpreted says why)
_INTERPRETED = runs_interpreted(_embed_forward_kernel)


def _checked(what: str, *tensors: torch.Tensor) -> bool:
    """Whether to pass bf16 as int16 bits (the interpreter has no numpy bf16), after the checks."""
    _check_device(tensors[0].device, what, _INTERPRETED, "ngram_embed", "model.ngram.embed_impl=reference")
    if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors):
        raise ValueError(
            f"{what}: the table, its sign pool and the gradient must be contiguous bf16, got "
            f"{[(t.dtype, t.is_contiguous()) for t in tensors]}; use model.ngram.embed_impl=reference."
        )
    return _INTERPRETED


def _bits(t: torch.Tensor, as_bits: bool) -> torch.Tensor:
    return t.view(torch.int16) if as_bits else t


def _launch(kernel, out, args, t: int, d: int, as_bits: bool) -> torch.Tensor:
    if t:
        kernel[(triton.cdiv(t, BLOCK_T),)](
            _bits(out, as_bits),
            *args,
            t,
            D=d,
            BLOCK_T=BLOCK_T,
            BLOCK_D=triton.next_power_of_2(d),
            AS_BITS=as_bits,
            enable_fp_fusion=False,
            num_warps=4,
        )
    return out


def embed_forward(
    cache: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, signs: torch.Tensor
) -> torch.Tensor:
    """[T, dim]: cache[slots[t]] * pool[signs[t]] + cache[slots[T + t]] * pool[signs[T + t]], rounded once."""
    as_bits = _checked("ngram_embed.embed_forward", cache, pool)
    t, d = slots.numel() // 2, cache.shape[1]
    out = cache.new_empty((t, d))
    args = (_bits(cache, as_bits), slots.contiguous(), _bits(pool, as_bits), signs.contiguous())
    return _launch(_embed_forward_kernel, out, args, t, d, as_bits)


def embed_backward(grad: torch.Tensor, pool: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """[2T, dim]: the rows' gradient, grad [T, dim] times each channel's sign rows."""
    grad = grad.contiguous()
    as_bits = _checked("ngram_embed.embed_backward", grad, pool)
    t, d = grad.shape
    out = grad.new_empty((2 * t, d))
    args = (_bits(grad, as_bits), _bits(pool, as_bits), signs.contiguous())
    return _launch(_embed_backward_kernel, out, args, t, d, as_bits)
