"""Building blocks: the chunked softcapped CE against plain autograd, rotary/YaRN, smear, document ids."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from track_1_short.model.layers import (
    apply_rotary,
    document_ids,
    document_starts,
    rope_base_frequencies,
    smear,
    softcap,
    softcapped_cross_entropy_eval_sum,
    softcapped_cross_entropy_sum,
    yarn_rescale_,
)

CAP, SHIFT, TEMP = 23.0, 5.0, 7.5


def naive_loss(x, w, targets, mtp):
    """Upstream's training loss spelled out with autograd: softcapped logits, F.cross_entropy per shift, and
    for the last rows, whose target t + k lies past the end, the gradient (not the value) of
    w_k * logsumexp(z[t]): upstream's kernel normalises every row's softmax by the sum of all MTP weights."""
    z = softcap(x @ w, CAP, SHIFT, TEMP)
    t = x.size(0)
    total = 0.0
    for k, wk in enumerate(mtp):
        if t - k > 0:
            total = total + wk * F.cross_entropy(z[: t - k], targets[k:], reduction="sum")
        past = torch.logsumexp(z[max(t - k, 0) :], -1).sum()
        total = total + wk * (past - past.detach())
    return total


def test_ce_normaliser_counts_mtp_weights_past_the_end_as_upstreams_kernel():
    # Only the last row has no target at t + 1: its x gradient is w_0 softmax + w_1 softmax - w_0 onehot.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, generator=g).requires_grad_()
    w = torch.randn(4, 9, generator=g)
    targets = torch.randint(0, 9, (6,), generator=g)
    softcapped_cross_entropy_sum(x, w, targets, [1.0, 0.5], CAP, SHIFT, TEMP, 4).backward()
    z = softcap(x.detach() @ w, CAP, SHIFT, TEMP).requires_grad_()
    dz = (1.0 + 0.5) * torch.softmax(z[-1], -1) - F.one_hot(targets[-1], 9)
    dlogit = dz * (CAP / TEMP) * (z[-1] / CAP) * (1 - z[-1] / CAP)
    # fp32 chain against the same chain in another order: 1e-5 relative
    torch.testing.assert_close(x.grad[-1], dlogit @ w.T, rtol=1e-5, atol=1e-6)


def test_eval_loss_is_upstreams_bf16_softcap_then_fp32_cross_entropy_bitwise():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 16, generator=g).bfloat16()
    w = (torch.randn(16, 300, generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, 300, (48,), generator=g)
    got = softcapped_cross_entropy_eval_sum(x, w, targets, [1.0], CAP, SHIFT, TEMP, 64)
    # upstream gpt.py _loss, validation branch: (23 * torch.sigmoid((lm_head(x) + 5) / 7.5)).float()
    logits = (23 * torch.sigmoid((x @ w + 5) / 7.5)).float()
    assert torch.equal(got, F.cross_entropy(logits, targets, reduction="sum"))
    fp32_softcap = F.cross_entropy(softcap((x @ w).float(), CAP, SHIFT, TEMP), targets, reduction="sum")
    assert not torch.equal(got, fp32_softcap)  # the precision is visible in the loss: it is a real choice
    chunked = softcapped_cross_entropy_eval_sum(x, w, targets, [1.0, 0.5], CAP, SHIFT, TEMP, 7)
    mtp = F.cross_entropy(logits, targets, reduction="sum") + 0.5 * F.cross_entropy(
        logits[:-1], targets[1:], reduction="sum"
    )
    torch.testing.assert_close(chunked, mtp, rtol=1e-6, atol=0)  # chunked fp32 sums: order only


@pytest.mark.parametrize("impl", ["reference", "fused"])  # model.loss_impl (fused: the Triton row kernel)
@pytest.mark.parametrize("mtp", [[1.0], [1.0, 0.5, 0.25]])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_ce_matches_autograd_of_the_plain_loss(mtp, chunk, impl):
    g = torch.Generator().manual_seed(0)
    t, d, v = 130, 16, 515
    x = torch.randn(t, d, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(d, v, generator=g) * 0.5).requires_grad_()  # fp32 weight: no storage rounding
    targets = torch.randint(0, v, (t,), generator=g)
    targets[5] = targets[6] = targets[7]  # repeated targets share a column in the MTP correction
    loss = softcapped_cross_entropy_sum(x, w, targets, mtp, CAP, SHIFT, TEMP, chunk, impl)
    loss.backward()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = naive_loss(xr, wr, targets, mtp)
    ref.backward()
    # fp32 against fp64: relative 1e-5 on a sum of ~130 O(10) terms, 1e-4 on gradients (cancellation in p - 1)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-4, atol=1e-6)


def test_chunked_ce_scales_its_gradient_by_the_incoming_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g).requires_grad_()
    w = torch.randn(8, 100, generator=g).requires_grad_()
    targets = torch.randint(0, 100, (40,), generator=g)
    softcapped_cross_entropy_sum(x, w, targets, [1.0], CAP, SHIFT, TEMP, 16).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (softcapped_cross_entropy_sum(x, w, targets, [1.0], CAP, SHIFT, TEMP, 16) * 0.25).backward()
    torch.testing.assert_close(
        x.grad, gx * 0.25, rtol=1e-6, atol=0
    )  # scaling by a power of two: exact up to fp32
    torch.testing.assert_close(w.grad, gw * 0.25, rtol=1e-6, atol=0)


def test_chunked_ce_without_grad_gives_the_same_loss_bitwise():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 8, generator=g).requires_grad_()
    w = torch.randn(8, 64, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, 64, (50,), generator=g)
    with_grad = softcapped_cross_entropy_sum(x, w, targets, [1.0, 0.5], CAP, SHIFT, TEMP, 16)
    with torch.no_grad():
        without = softcapped_cross_entropy_sum(x, w, targets, [1.0, 0.5], CAP, SHIFT, TEMP, 16)
    assert torch.equal(with_grad.detach(), without)


def test_softcap_is_upstreams_formula_and_bounded():
    z = torch.tensor([-1e4, -5.0, 0.0, 1e4])
    out = softcap(z, CAP, SHIFT, TEMP)
    assert out[0] == 0.0 and out[-1] == CAP  # saturates to (0, 23)
    assert out[1] == CAP / 2  # sigmoid(0)
    assert torch.allclose(out[2], torch.tensor(23 * (1 / (1 + math.exp(-5 / 7.5)))))


def test_rotary_keeps_norms_and_stationary_dims_and_depends_only_on_relative_position():
    g = torch.Generator().manual_seed(0)
    freq = rope_base_frequencies(16)  # 8 pairs rotate; dims 16..31 stay
    q = torch.randn(5, 2, 32, generator=g)
    k = torch.randn(5, 2, 32, generator=g)
    pos = torch.tensor([0, 3, 7, 100, 1000])
    rq, rk = apply_rotary(q, pos, freq), apply_rotary(k, pos, freq)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=0)
    assert torch.equal(rq[..., 16:], q[..., 16:])
    # <R(p) q, R(p') k> depends on p - p' only: shift both positions by 37
    sq, sk = apply_rotary(q, pos + 37, freq), apply_rotary(k, pos + 37, freq)
    dots = torch.einsum("ihd,jhd->hij", rq, rk)
    shifted = torch.einsum("ihd,jhd->hij", sq, sk)
    torch.testing.assert_close(shifted, dots, atol=1e-3, rtol=1e-4)  # fp32 angles up to ~1000 rad
    assert torch.equal(apply_rotary(q, torch.zeros(5, dtype=torch.long), freq), q)  # position 0: identity


def test_rope_frequencies_are_upstreams():
    f = rope_base_frequencies(64)
    assert f.numel() == 32 and f[0] == 1.0
    torch.testing.assert_close(f[-1], torch.tensor(1 / 1024))


def test_yarn_interpolates_slow_frequencies_keeps_fast_ones_and_scales_attention():
    freq = torch.tensor([1e-4, 0.02, 1.0, 3.0])
    old, new = 128, 384
    rotations = old * freq / (2 * math.pi)  # [0.002, 0.41, 20.4, 61.1]
    out = freq.clone()
    gain = yarn_rescale_(out, old, new, alpha=1.0, beta=32.0)
    assert gain == pytest.approx(1 + 0.2 * math.log(3))
    torch.testing.assert_close(out[:2], freq[:2] * old / new)  # below alpha: fully interpolated
    assert out[3] == freq[3]  # above beta: kept
    w = (rotations[2] - 1) / 31
    torch.testing.assert_close(out[2], freq[2] * (old / new + w * (1 - old / new)))


def test_document_bookkeeping_handles_empty_documents():
    cu = torch.tensor(
        [0, 3, 3, 5, 8, 8], dtype=torch.int32
    )  # empty documents (repeated offsets) at both ends
    assert document_starts(cu, 8).tolist() == [True, False, False, True, False, True, False, False]
    assert document_ids(cu, 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]


def test_smear_adds_the_gated_previous_token_and_stops_at_document_starts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g)
    gate_w = torch.randn(1, 12, generator=g)
    lam = torch.tensor(0.7)
    start = torch.tensor([True, False, False, True, False, False])
    out = smear(x, gate_w, lam, start)
    gate = torch.sigmoid(x[:, :12] @ gate_w.T)
    expected = x.clone()
    for t in (1, 2, 4, 5):
        expected[t] = x[t] + lam * gate[t] * x[t - 1]
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[[0, 3]], x[[0, 3]])  # document starts: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_padded_mtp_weights_give_the_same_gradient_bitwise_and_the_same_loss(dtype):
    # The trainer pads every stage's MTP weights with zeros to the widest stage's count (one compiled graph).
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 8, generator=g).to(dtype)
    w = (torch.randn(8, 96, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, 96, (70,), generator=g)
    results = []
    for mtp in ([1.0, 0.4], [1.0, 0.4, 0.0], [1.0, 0.4, 0.0, 0.0]):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = softcapped_cross_entropy_sum(xg, wg, targets, torch.tensor(mtp), CAP, SHIFT, TEMP, 32)
        (loss * 0.5).backward()
        results.append((loss.detach(), xg.grad, wg.grad))
    (loss_ref, gx_ref, gw_ref), *padded = results
    for loss, gx, gw in padded:
        # A zero weight adds exactly 0 to the softmax normaliser and -0.0 at its targets: the same gradient.
        assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)
        # The loss sums a [rows, K] product whose zero columns change only the summation order: the same
        # value up to fp32 reassociation over ~140 positive terms (a few ulps of the sum).
        assert abs(float(loss) - float(loss_ref)) <= 8 * 2.0**-23 * abs(float(loss_ref))
    assert gx_ref.abs().sum() > 0
