"""The fused softcapped-CE kernel (perf/kernels/softcapped_ce.py) against the reference loss (model/layers).

On the CPU the kernel runs under Triton's interpreter (numpy's exp, log and sigmoid); the ``gpu`` tests run it
compiled, with the GPU's approximate exp and log, at the record's vocabulary and chunk size.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.model.test_layers import CAP, SHIFT, TEMP
from tests.perf.compile_sm90 import compile_outside_the_interpreter
from track_1_short.model.config import ModelConfig, ModelConfigError
from track_1_short.model.layers import (
    _fused_block,
    _reference_block,
    mtp_row_weights,
    softcapped_cross_entropy_sum,
)
from track_1_short.perf.kernels.softcapped_ce import softcapped_ce_rows_

gpu = pytest.mark.gpu


def _case(t, d, v, mtp, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 2).to(device=device, dtype=dtype)
    w = (torch.randn(d, v, generator=g) * 0.5).to(device)
    targets = torch.randint(0, v, (t,), generator=g)
    targets[5] = targets[6] = targets[7]  # repeated targets: the K one-hot terms of a row share a column
    return x, w, targets.to(device), torch.tensor(mtp, device=device)


def _block_inputs(t, mtp_t):
    k = mtp_t.numel()
    device = mtp_t.device
    valid, row_weight = mtp_row_weights(mtp_t, t)
    idx = (torch.arange(t, device=device)[None, :] + torch.arange(k, device=device)[:, None]).clamp(max=t - 1)
    return valid, row_weight, idx


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits), the smallest normal's for zero."""
    e = torch.floor(torch.log2(x.abs().float().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(e - 7)


def _compare_blocks(x, w, targets, mtp_t, lo, rows):
    """(loss and g of the reference block, the same of the fused block) on one chunk of rows."""
    t = x.size(0)
    valid, row_weight, idx = _block_inputs(t, mtp_t)
    tgt = targets[idx]
    u = x[lo : lo + rows] @ w.to(x.dtype)  # the logits: both blocks add the shift and scale in fp32
    ref = _reference_block(x, w, tgt, valid, mtp_t, row_weight, CAP, SHIFT, TEMP, rows, True)
    fused = _fused_block(tgt, valid, mtp_t, row_weight, CAP, SHIFT, TEMP, True)
    loss_r, g_r = ref(u.clone(), lo, lo + rows)
    u_f = u.clone()
    loss_f, g_f = fused(u_f, lo, lo + rows)
    assert g_f.data_ptr() == u_f.data_ptr()  # the gradient is written over the logit block
    return (loss_r, g_r.clone()), (loss_f, g_f)


@pytest.mark.parametrize("mtp", [[1.0], [1.0, 0.5, 0.25]])
@pytest.mark.parametrize("lo", [0, 57])  # 57 + 16 rows reach the batch's end: the K - 1 rows without targets
def test_fused_block_bf16_gradient_within_one_bf16_ulp_of_the_reference(mtp, lo):
    x, w, targets, mtp_t = _case(73, 16, 515, mtp, torch.bfloat16, "cpu")
    (loss_r, g_r), (loss_f, g_f) = _compare_blocks(x, w, targets, mtp_t, lo, 16)
    # Both round the same fp32 formula once into bf16; their fp32 values differ only in the order of the row
    # sum (a tree against torch's sum): a few fp32 ulps, so the bf16 results differ by at most one bf16 ulp.
    diff = (g_f.float() - g_r.float()).abs()
    assert torch.all(diff <= _bf16_ulp(g_r)), diff.max()
    assert (diff > 0).float().mean() < 0.01  # almost everywhere the same bits: the formula is the same
    # The loss: 16 rows of O(10) terms in fp32, summed in another order
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mtp", [[1.0], [1.0, 0.5, 0.25]])
def test_fused_block_fp32_gradient_matches_the_reference_to_fp32_rounding(mtp):
    x, w, targets, mtp_t = _case(40, 16, 515, mtp, torch.float32, "cpu", seed=1)
    (loss_r, g_r), (loss_f, g_f) = _compare_blocks(x, w, targets, mtp_t, 24, 16)
    # Same formula, different summation order of sum_e: a relative error of a few fp32 ulps in
    # q = e s / sum_e, which g = q - q s carries relative to q (not to g: q - q s cancels where s is
    # near 1); q <= cap / temp.
    scale = CAP / TEMP
    torch.testing.assert_close(g_f, g_r, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-6, atol=0)


def test_fused_block_without_gradient_leaves_the_logits_and_gives_the_same_loss():
    x, w, targets, mtp_t = _case(40, 16, 300, [1.0, 0.5], torch.bfloat16, "cpu", seed=2)
    t = x.size(0)
    valid, row_weight, idx = _block_inputs(t, mtp_t)
    tgt = targets[idx]
    u = x[:16] @ w.to(x.dtype)
    u_before = u.clone()
    loss, g = _fused_block(tgt, valid, mtp_t, row_weight, CAP, SHIFT, TEMP, False)(u, 0, 16)
    assert g is None and torch.equal(u, u_before)
    with_grad, _ = _fused_block(tgt, valid, mtp_t, row_weight, CAP, SHIFT, TEMP, True)(u.clone(), 0, 16)
    assert torch.equal(loss, with_grad)  # the gradient pass does not touch the loss


def _op_grads(x, w, targets, mtp, chunk, impl):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = softcapped_cross_entropy_sum(xx, ww, targets, mtp, CAP, SHIFT, TEMP, chunk, impl)
    loss.backward()
    return loss.detach(), xx.grad.float(), ww.grad.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_fused_and_reference_ops_agree_in_bf16_across_partial_chunks():
    x, w, targets, mtp_t = _case(100, 16, 515, [1.0, 0.5, 0.25], torch.bfloat16, "cpu", seed=3)
    ref = _op_grads(x, w, targets, mtp_t, 32, "reference")  # 32, 32, 32, 4 rows
    fused = _op_grads(x, w, targets, mtp_t, 32, "fused")
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=0)
    # g differs by at most one bf16 ulp in under 1% of its entries; the GEMMs then carry that as a relative
    # norm error well under bf16's 2^-8 (measured ~1e-4).
    assert _rel(fused[1], ref[1]) < 2e-3 and _rel(fused[2], ref[2]) < 2e-3


def test_loss_impl_auto_is_the_reference_on_a_cpu_bitwise():
    x, w, targets, mtp_t = _case(70, 16, 300, [1.0, 0.5], torch.bfloat16, "cpu", seed=4)
    auto = _op_grads(x, w, targets, mtp_t, 32, "auto")
    ref = _op_grads(x, w, targets, mtp_t, 32, "reference")
    assert all(torch.equal(a, b) for a, b in zip(auto, ref))


def test_bad_loss_impl_is_one_clear_error():
    with pytest.raises(
        ModelConfigError, match=r"loss_impl='triton' must be one of \['auto', 'reference', 'fused'\]"
    ):
        ModelConfig(loss_impl="triton")
    x, w, targets, mtp_t = _case(20, 8, 64, [1.0], torch.float32, "cpu")
    with pytest.raises(ValueError, match="model.loss_impl"):
        softcapped_cross_entropy_sum(x, w, targets, mtp_t, CAP, SHIFT, TEMP, 8, "triton")


def test_kernel_rejects_non_contiguous_rows():
    u = torch.zeros(4, 16).T  # rows not contiguous
    tg = torch.zeros(1, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous rows"):
        softcapped_ce_rows_(u, tg, tg.float(), torch.ones(16), 0, CAP, SHIFT, TEMP, True)


_COMPILE_FOR_H200 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from track_1_short.perf.kernels.softcapped_ce import BLOCK_GPU, _NUM_WARPS, _softcapped_ce_rows_kernel

    ptr = {"tgt_ptr": "*i64", "coef_ptr": "*fp32", "row_weight_ptr": "*fp32", "loss_ptr": "*fp32",
           "p_tgt_ptr": "*i64", "p_coef_ptr": "*fp32"}
    scalars = {
        "u_stride": "i32", "tgt_stride": "i32", "lo": "i32", "V": "i32", "cap": "fp32", "shift": "fp32",
        "inv_t": "fp32", "grad_scale": "fp32"}
    count = 0
    for is_bf16 in (True, False):
        for write_grad in (True, False):
            for has_prefix in (False, True):  # the prefix-token target's arm
                consts = {"K": 3, "KP": 4, "IS_BF16": is_bf16, "WRITE_GRAD": write_grad, "BLOCK": BLOCK_GPU,
                          "HAS_PREFIX": has_prefix}  # fmt: skip
                sig = {"u_ptr": "*i16" if is_bf16 else "*fp32", **ptr, **scalars}
                sig.update(dict.fromkeys(consts, "constexpr"))
                src = ASTSource(fn=_softcapped_ce_rows_kernel, signature=sig, constexprs=consts)
                sm90 = GPUTarget("cuda", 90, 32)
                compiled = triton.compile(src, target=sm90, options={"num_warps": _NUM_WARPS})
                assert compiled.asm["cubin"], (is_bf16, write_grad, has_prefix)
                count += 1
    print(f"compiled {count} variants")
    """
)


def test_the_kernel_compiles_for_the_h200_on_this_machine():
    proc = compile_outside_the_interpreter(_COMPILE_FOR_H200)
    assert proc.returncode == 0 and "compiled 8 variants" in proc.stdout, proc.stderr[-3000:]


@gpu
@pytest.mark.parametrize("mtp", [[1.0], [1.0, 0.5, 0.25]])
def test_gpu_fused_loss_at_the_record_vocabulary_matches_the_reference(mtp):
    # The record's shapes in small: V = 50,304, 4,096-row chunks, bf16, the compiled kernel's approximate exp.
    x, w, targets, mtp_t = _case(8192 + 77, 768, 50304, mtp, torch.bfloat16, "cuda", seed=5)
    w = w * 0.02
    ref = _op_grads(x, w, targets, mtp_t, 4096, "reference")
    fused = _op_grads(x, w, targets, mtp_t, 4096, "fused")
    # Loss: 8,269 rows of O(10) in fp32 (each row's lse carries a few ulps from the GPU's approximate exp/log)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=0)
    assert _rel(fused[1], ref[1]) < 2e-3 and _rel(fused[2], ref[2]) < 2e-3
    # One chunk's g elementwise: within one bf16 ulp (of the reference's value) almost everywhere; the GPU's
    # approximate exp adds ~2 fp32 ulps, which can move a rounding by one bf16 ulp more rarely still.
    (_, g_r), (_, g_f) = _compare_blocks(x, w, targets, mtp_t, 4096, 4096)
    diff = (g_f.float() - g_r.float()).abs()
    assert torch.all(diff <= 2 * _bf16_ulp(g_r)), diff.max()
    assert (diff > 0).float().mean() < 0.01


@gpu
def test_gpu_fused_sampled_loss_with_the_prefix_term_matches_the_reference():
    # The record's shapes in small: V = 50,304, P = 14,336 (stage 2), 4,096-row chunks, bf16, prefix targets.
    from track_1_short.model.sampled_softmax import candidate_set

    x, w, targets, mtp_t = _case(8192 + 77, 768, 50304, [1.0, 0.5, 0.25], torch.bfloat16, "cuda", seed=6)
    w = w * 0.02
    targets = targets % 11000  # ~11k distinct targets, upstream's count at this stage
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(-1, 50304, (targets.numel(),), generator=g).cuda()
    cand = candidate_set(targets, 50304, 14336, 12345)
    runs = {}
    for impl in ("reference", "fused"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = softcapped_cross_entropy_sum(
            xx, ww, targets, mtp_t, CAP, SHIFT, TEMP, 4096, impl,
            prefix_targets=prefix, prefix_weight=0.25, candidates=cand,
        )  # fmt: skip
        loss.backward()
        runs[impl] = (loss.detach(), xx.grad.float(), ww.grad.float())
    ref, fused = runs["reference"], runs["fused"]
    # The bounds of the full-softmax GPU test above, for the same reasons.
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=0)
    assert _rel(fused[1], ref[1]) < 2e-3 and _rel(fused[2], ref[2]) < 2e-3
    outside = torch.ones(50304, dtype=torch.bool, device="cuda")
    outside[cand] = False
    assert torch.all(fused[2][:, outside] == 0)
