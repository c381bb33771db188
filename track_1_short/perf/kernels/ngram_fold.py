"""One Triton kernel: a micro batch's n-gram row gradients folded into the cycle's per-row fp32 sums.

What it replaces: model/ngram.py's reference fold, ``per_slot.index_add_(0, slots, sink.grad.float())``: an
fp32 copy of the [2T, dim] bf16 sink gradient, then one atomic add per element, in an order the GPU does not
fix. Many tokens share a row (every document's first tokens share the reserved rows, frequent n-grams their
own), so the atomics contend. On one H100 at stage 2 of record_1gpu the index_add alone took 4.5 ms a step
(perf/RESULTS.md, "Train step").

Why it is faster: the slots are sorted once (stably); one program per run of equal slots adds its tokens'
bf16 rows into an fp32 accumulator in registers, in token order (loading CHUNK rows at a time, so a hot
row's long run is not one memory latency a token), and writes the row's sum once: the sink gradient is read
once, nothing is copied to fp32 and no two programs touch one row.

Invariants (tests/perf/test_ngram_fold.py, under the interpreter on the CPU and on the GPU): the bits of the
reference as the CPU computes it, ``per_slot[s] + g[t1] + g[t2] + ...`` left to right in token order (a
stable sort keeps it; fp32 adds only). On the GPU the reference's atomics add in another order each run,
so there the kernel is the deterministic one.

Provenance: record #92 folds its n-gram gradients with a scatter kernel (upstream perf/kernels/
row_scatter.py @ f380c1f0); here a sorted segment sum with no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import load_bf16
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted


@triton.jit
def _fold_runs_kernel(
    sums_ptr,
    grad_ptr,
    sorted_ptr,
    order_ptr,
    n,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    AS_BITS: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(sorted_ptr + i)
    previous = tl.load(sorted_ptr + tl.maximum(i - 1, 0))
    if (i == 0) | (previous != slot):  # the first position of a run: this program folds the run
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        row = slot.to(tl.int64) * D
        acc = tl.load(sums_ptr + row + offs, mask=mask, other=0.0)
        j = i
        more = i >= 0
        while more:
            # CHUNK tokens' rows loaded at once (their addresses are independent, so the loads overlap: a
            # hot row's long run costs its length / CHUNK memory latencies), then added one by one in order
            for k in tl.static_range(CHUNK):
                at = tl.minimum(j + k, n - 1)
                inrun = (j + k < n) & (tl.load(sorted_ptr + at) == slot)
                token = tl.load(order_ptr + at).to(tl.int64)
                g = load_bf16(grad_ptr + token * D + offs, mask & inrun, AS_BITS).to(tl.float32)
                acc = tl.where(inrun, acc + g, acc)  # past the run: unchanged (not + 0, which turns -0 to +0)
            j += CHUNK
            more = (j < n) & (tl.load(sorted_ptr + tl.minimum(j, n - 1)) == slot)
        tl.store(sums_ptr + row + offs, acc, mask=mask)


CHUNK = 8  # a run's tokens loaded together

# once, at import (interpreter.runs_interpreted says why)
_INTERPRETED = runs_interpreted(_fold_runs_kernel)


def fold_rows_(sums: torch.Tensor, slots: torch.Tensor, grads: torch.Tensor) -> None:
    """sums[slots[t]] += grads[t] for every t, in t order per slot: sums fp32 [S, D] (contiguous), slots int64
    [N] in [0, S), grads bf16 or fp32 [N, D] (the table's dtype)."""
    _check_device(
        sums.device, "ngram_fold.fold_rows_", _INTERPRETED, "ngram_fold", "model.ngram.fold_impl=reference"
    )
    if (
        sums.dtype != torch.float32
        or not sums.is_contiguous()
        or grads.dtype not in (torch.bfloat16, torch.float32)
    ):
        raise ValueError(
            f"ngram_fold.fold_rows_: sums must be contiguous fp32 and grads bf16 or fp32, got "
            f"{sums.dtype} and {grads.dtype}."
        )
    n, d = grads.shape
    if n == 0:
        return
    ordered, order = torch.sort(slots, stable=True)
    grads = grads.contiguous()
    as_bits = _INTERPRETED and grads.dtype == torch.bfloat16  # the interpreter has no numpy bf16
    _fold_runs_kernel[(n,)](
        sums,
        grads.view(torch.int16) if as_bits else grads,
        ordered,
        order,
        n,
        D=d,
        BLOCK=triton.next_power_of_2(d),
        CHUNK=CHUNK,
        AS_BITS=as_bits,
        enable_fp_fusion=False,
        num_warps=4,
    )
