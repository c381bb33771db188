"""One Triton kernel: the n-gram table's row-sparse Adam update, one program per touched row.

What it replaces: the reference row update of :mod:`track_1_short.optim.ngram_adam` (``_update_reference``):
a host loop over the events a row missed (each a masked multiply over every touched row), then gathers of the
rows' weights and second moments, seven elementwise ops over [rows, dim] and scatters back.

Why it is faster: each program replays its own row's missed second-moment decays in a register loop (a row
that slept through k events costs k multiplies, not k passes over all touched rows), reads the row's bf16
weights and fp32 gradient once, and writes the weights, the moment and the row's event stamp once.

Invariants (tests/optim/test_ngram_adam.py, under the interpreter on the CPU and on the GPU): the bits of
the reference for every touched row: the same fp32 operations in the same order, each rounded on its own
(launched with enable_fp_fusion=False; IEEE sqrt_rn and div_rn, where Triton's ``/`` would be approximate),
the weights widened from and rounded to bf16 in integer arithmetic (kernels/bf16_bits.py). The row mean
square of the gradient is an input (one torch reduction shared with the reference), so no reduction order
differs. Rows must be unique; rows not listed are not read or written.

Provenance: record #92's ``_adam_rows_kernel`` (upstream perf/kernels/ngram_adam.py @ f380c1f0): one program
a row, the missed decays replayed from a beta2 history. Here rows are unique on entry (the owner sums them
first), so no claim map is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import round_to_bf16_bits, widen_bf16
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import runs_interpreted


@triton.jit(do_not_specialize=["event"])
def _ngram_adam_kernel(
    p_ptr,
    v_ptr,
    last_ptr,
    hist_ptr,
    g_ptr,
    ms_ptr,
    rows_ptr,
    event,
    beta2,
    sq_mul,
    grad_mul,
    eps,
    step_size,
    eff_wd,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid).to(tl.int64)
    last = tl.load(last_ptr + row)
    v = tl.load(v_ptr + row)
    # the decays of events last + 1 .. event - 1, in event order: the eager decay's multiplies
    for k in range(last + 1, event):
        v = v * tl.load(hist_ptr + k)
    v = beta2 * v + sq_mul * tl.load(ms_ptr + pid)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(g_ptr + pid.to(tl.int64) * D + offs, mask=mask, other=0.0)
    p = widen_bf16(tl.load(p_ptr + row * D + offs, mask=mask, other=0))
    m = g * grad_mul
    u = tl.math.div_rn(m, tl.sqrt_rn(v) + eps) * step_size
    u = tl.where(u * p > 0, u + eff_wd * p, u)
    tl.store(p_ptr + row * D + offs, round_to_bf16_bits(p - u), mask=mask)
    tl.store(v_ptr + row, v)
    tl.store(last_ptr + row, event)


_INTERPRETED = runs_interpreted(_ngram_adam_kernel)  # once, at import (interpreter.runs_interpreted says why)


def update_rows_(
    shard: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    last_event: torch.Tensor,
    beta2_history: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    mean_sq: torch.Tensor,
    event: int,
    *,
    beta2: float,
    sq_mul: float,
    grad_mul: float,
    eps: float,
    step_size: float,
    eff_wd: float,
) -> None:
    """Event ``event``'s update of ``rows`` (unique int64 [N], local to the shard) in place: shard bf16
    [R, D], exp_avg_sq fp32 [R], last_event int32 [R], beta2_history fp32 (entry e: event e's beta2),
    grads fp32 [N, D], mean_sq fp32 [N] (grads' row mean squares). The scalars are rounded to fp32 at the
    launch."""
    _check_device(
        shard.device, "ngram_adam.update_rows_", _INTERPRETED, "ngram_adam", "model.ngram.adam_impl=reference"
    )
    if shard.dtype != torch.bfloat16 or not shard.is_contiguous():
        raise ValueError(f"ngram_adam.update_rows_: the shard must be contiguous bf16, got {shard.dtype}.")
    n, d = grads.shape
    if n == 0:
        return
    _ngram_adam_kernel[(n,)](
        shard.view(torch.int16),
        exp_avg_sq,
        last_event,
        beta2_history,
        grads.contiguous(),
        mean_sq.contiguous(),
        rows.contiguous(),
        event,
        beta2,
        sq_mul,
        grad_mul,
        eps,
        step_size,
        eff_wd,
        D=d,
        BLOCK=triton.next_power_of_2(d),
        enable_fp_fusion=False,
        num_warps=4,
    )
