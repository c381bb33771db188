"""FP8 projections (model/fp8.py): the emulation against the bf16 path within a bound derived from the
formats' precision, against a plain restatement bitwise, the switches, the weight-copy refresh cadence, the
delayed scales and the saturation counters. GPU tests (marked ``gpu``) compare ``torch._scaled_mm`` with
the emulation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.model.conftest import load_config, needs_fp8_gpu
from track_1_short.model import fp8 as fp8_mod
from track_1_short.model.config import FP8Config
from track_1_short.model.fp8 import E4M3, E5M2, SITE, FP8State
from track_1_short.model.layers import relu2_mlp

BF16_U = 2.0**-8  # bf16 unit roundoff (8 significant bits)
# Unit roundoff and half the subnormal spacing of each format, in units of its scale: e4m3 has 4 significant
# bits (u = 2^-4) and subnormals spaced 2^-9; e5m2 has 3 (u = 2^-3) and subnormals spaced 2^-16.
FMT = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}


# -- error bounds ----------------------------------------------------------------------------------------
# Every bound below is elementwise and rigorous for unsaturated operands (each test asserts that nothing
# saturated): rounding v / s to the format moves it by at most max(u |v|, s h) (relative in the normal
# range, absolute among the subnormals). A product of perturbed operands (A + dA)(B + dB) is off by at most
# |dA||B| + |A||dB| + |dA||dB|, and its fp32 accumulation over K terms by gamma_K times the product of the
# operands' magnitudes (K + 2: the two scale multiplies). Rounding an output to bf16 adds BF16_U of it.


def q_err(mag, scale, fmt):
    u, h = FMT[fmt]
    return torch.maximum(u * mag, torch.full_like(mag, h * scale))


def gemm_err(a, ea, b, eb, out_u):
    """Bound on |computed - a @ b| given |A - a| <= ea, |B - b| <= eb (all float64)."""
    k = a.size(-1)
    gamma = (k + 2) * 2.0**-24 / (1 - (k + 2) * 2.0**-24)
    aa, ab = a.abs(), b.abs()
    e = ea @ ab + aa @ eb + ea @ eb + gamma * ((aa + ea) @ (ab + eb))
    return e + out_u * ((a @ b).abs() + e)


def mlp_bounds(x, w1, w2, g, q):
    """Bounds on the MLP's output and gradients (out, dx, dw1, dw2), float64, for one path.

    ``q(name, magnitude)`` is that path's representation error of an operand (FP8 rounding, or zero where
    the bf16 path uses the value as it is); both paths round GEMM outputs and the square to bf16."""
    ex, ew1, ew2, eg = q("x", x.abs()), q("w1", w1.abs()), q("w2", w2.abs()), q("g", g.abs())
    pre = x @ w1.T
    epre = gemm_err(x, ex, w1.T, ew1.T, BF16_U)
    r = F.relu(pre)
    post = r.square()
    # |relu(p')^2 - relu(p)^2| <= |p' - p| (|relu p'| + |relu p|) <= e (2 |p| + e); then the bf16 square
    epost = epre * (2 * pre.abs() + epre)
    epost = epost + BF16_U * (post + epost)
    epost = epost + q("post", post + epost)
    out_e = gemm_err(post, epost, w2, ew2, BF16_U)
    dw2_e = gemm_err(post.T, epost.T, g, eg, BF16_U)
    dpost = g @ w2.T
    edpost = gemm_err(g, eg, w2.T, ew2.T, BF16_U)
    dpre = 2 * dpost * r
    # |2 d' r' - 2 d r| <= 2 (|d' - d| (|r| + e_r) + |d| e_r), r = relu(pre) moves by at most epre;
    # the bf16 path rounds 2 h dpost twice
    edpre = 2 * (edpost * (r + epre) + dpost.abs() * epre)
    edpre = edpre + 2 * BF16_U * (dpre.abs() + edpre)
    edpre = edpre + q("dpre", dpre.abs() + edpre)
    dx_e = gemm_err(dpre, edpre, w1, ew1, BF16_U)
    dw1_e = gemm_err(dpre.T, edpre.T, x, ex, BF16_U)
    return out_e, dx_e, dw1_e, dw2_e


def exact_mlp(x, w1, w2, g):
    pre = x @ w1.T
    r = F.relu(pre)
    dpost = g @ w2.T
    dpre = 2 * dpost * r
    return r.square() @ w2, dpre @ w1, dpre.T @ x, r.square().T @ g


def _data(t=96, d=64, hidden=128, seed=0, g_mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = F.rms_norm(torch.randn(t, d, generator=gen), (d,)).bfloat16()
    w1 = (torch.rand(hidden, d, generator=gen) - 0.5).mul(2 * math.sqrt(3) * 0.5 / math.sqrt(d)).bfloat16()
    w2 = (torch.randn(hidden, d, generator=gen) * 0.02).bfloat16()
    g = (torch.randn(t, d, generator=gen) * g_mag).bfloat16()
    return x, w1, w2, g


def _state(bank=None, qkv=None, lm_head=None, **switches):
    st = FP8State(FP8Config(**switches))
    st.refresh(bank, qkv, lm_head)
    return st


def _fp8_mlp(x, w1, w2, g, st=None):
    """Forward and backward of the emulated FP8 MLP (slot 0 of a one-slot bank)."""
    bank = torch.stack((w1, w2))[None]
    st = st or _state(bank, mlp=True)
    x = x.clone().requires_grad_()
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    out = st.mlp_forward(x, 0, w1, w2)
    out.backward(g)
    return st, out.detach(), x.grad, w1.grad, w2.grad


def _bf16_mlp(x, w1, w2, g):
    x, w1, w2 = (t.clone().requires_grad_() for t in (x, w1, w2))
    out = relu2_mlp(x, w1, w2)
    out.backward(g)
    return out.detach(), x.grad, w1.grad, w2.grad


# -- quantise --------------------------------------------------------------------------------------------


def test_quantize_saturates_to_the_formats_range_and_counts_what_it_clipped():
    clips = torch.zeros(2, len(fp8_mod.SITES), dtype=torch.int64)
    v = torch.tensor([1000.0, -1000.0, 447.0, 0.3, 40000.0, -60000.0])
    q4 = fp8_mod.quantize(v, 1.0, E4M3, clips, 2)
    assert q4.dtype == E4M3
    assert q4.float().tolist() == [448.0, -448.0, 448.0, 0.3125, 448.0, -448.0]
    q5 = fp8_mod.quantize(v, 1.0, E5M2, clips, 3)
    assert q5.dtype == E5M2
    assert q5.float().tolist() == [1024.0, -1024.0, 448.0, 0.3125, 40960.0, -57344.0]
    # 447 rounds to 448 without saturating; only what rounds past the largest number counts: |v| > 464
    # (e4m3, midway to 480) and > 59392 (e5m2, midway to 61440)
    assert clips[:, 2].tolist() == [4, 6] and clips[:, 3].tolist() == [1, 6]


# -- the emulation against the bf16 path -----------------------------------------------------------------


def test_emulated_fp8_mlp_agrees_with_bf16_within_the_formats_bound():
    x, w1, w2, g = _data()
    st, *fp8_out = _fp8_mlp(x, w1, w2, g)
    bf16_out = _bf16_mlp(x, w1, w2, g)
    assert st.clip_counts()[0].sum() == 0  # the bound holds for unsaturated operands
    m = st.mlp
    scales = {"x": 2.0**-4, "w1": m["w_s"][0][0].item(), "w2": m["w_s"][0][1].item(), "g": 2.0**-6,
              "post": m["post_s"][0].item(), "dpre": m["dpre_s"][0].item()}  # fmt: skip
    fmts = {"x": E4M3, "w1": E4M3, "w2": E4M3, "post": E4M3, "g": E5M2, "dpre": E5M2}
    x64, w164, w264, g64 = (t.double() for t in (x, w1, w2, g))
    fp8_b = mlp_bounds(x64, w164, w264, g64, lambda n, mag: q_err(mag, scales[n], fmts[n]))
    bf16_b = mlp_bounds(x64, w164, w264, g64, lambda n, mag: BF16_U * mag if n in ("post",) else 0 * mag)
    exact = exact_mlp(x64, w164, w264, g64)
    for name, a, b, e, bf, bb in zip(("out", "dx", "dw1", "dw2"), fp8_out, bf16_out, exact, fp8_b, bf16_b):
        # each path is within its bound of the exact values, so the two within the sum of the bounds
        assert (a.double() - e).abs().le(bf).all(), name
        assert (b.double() - e).abs().le(bb).all(), name
        assert (a.double() - b.double()).abs().le(bf + bb).all(), name
        # The elementwise bound is the worst case (every rounding error aligned) and loose; the typical
        # error is normwise: roundings uncorrelated with the data add in quadrature, each operand's at most
        # u relative, so a GEMM's output is within about u of its norm per operand. Forward: x and W1
        # (e4m3) give pre ~2^-4, the square doubles it, post and W2 add theirs in quadrature: < 2^-3.
        # Backward: the e5m2 gradient and dpre (u = 2^-3) dominate: < 2^-2. (Measured 0.058 and 0.075-0.093;
        # the bf16 path's is 0.004.) A scale applied on one side only (2x) or a saturated operand exceeds it.
        rel = ((a.double() - e).norm() / e.norm()).item()
        assert rel < (2.0**-3 if name == "out" else 2.0**-2), (name, rel)


def test_emulated_fp8_qkv_and_logits_agree_with_bf16_within_the_formats_bound():
    x, w, _, _ = _data(hidden=96)
    g = torch.randn(x.size(0), 96, generator=torch.Generator().manual_seed(1)).bfloat16() * 0.3
    gain = torch.tensor(0.5, requires_grad=True)
    st = FP8State(FP8Config(qkv=True))
    st.refresh(None, {0: w}, None)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = st.qkv_forward(0)(xg, wg, gain)
    out.backward(g)
    assert st.clip_counts()[0].sum() == 0
    x64, w64, g64 = x.double(), w.double(), g.double()
    s_w = st.qkv[0][2].item()
    ex, ew, eg = q_err(x64.abs(), 8 / 448, E4M3), q_err(w64.abs(), s_w, E4M3), q_err(g64.abs(), 1 / 448, E5M2)
    # gain 0.5 is exact in bf16 and only scales: the bounds of x @ w.T, g @ w and g.T @ x, times 0.5
    # dw: the fp32 dw_eff times 0.5, rounded to bf16 once
    dw_err = 0.5 * gemm_err(g64.T, eg.T, x64, ex, 0.0)
    checks = (
        (out, 0.5 * x64 @ w64.T, 0.5 * gemm_err(x64, ex, w64.T, ew.T, BF16_U)),
        (xg.grad, 0.5 * g64 @ w64, 0.5 * gemm_err(g64, eg, w64, ew, BF16_U)),
        (wg.grad, 0.5 * g64.T @ x64, dw_err + BF16_U * (0.5 * (g64.T @ x64).abs() + dw_err)),
    )
    for name, (got, exact, bound) in zip(("out", "dx", "dw"), checks):
        assert (got.double() - exact).abs().le(bound).all(), name
    # d gain = <g.T x, w>: the dw_eff bound summed against |w|
    dgain_bound = (gemm_err(g64.T, eg.T, x64, ex, 0.0) * w64.abs()).sum() * (1 + 2.0**-20)
    assert abs(gain.grad.double() - ((g64.T @ x64) * w64).sum()) <= dgain_bound

    # logits: x (100/448) and lm_head (2/448) in e4m3, bf16 out
    lm = (torch.randn(64, 200, generator=torch.Generator().manual_seed(2)) * 0.05).bfloat16()
    st = FP8State(FP8Config(lm_head=True))
    st.refresh(None, None, lm)
    got = fp8_mod.fp8_logits(
        st.lm_head_input(x), st.lm_col, out=torch.empty(x.size(0), 200, dtype=torch.bfloat16)
    )
    lm64 = lm.double()
    bound = gemm_err(x64, q_err(x64.abs(), 100 / 448, E4M3), lm64, q_err(lm64.abs(), 2 / 448, E4M3), BF16_U)
    assert st.clip_counts()[0].sum() == 0
    assert (got.double() - x64 @ lm64).abs().le(bound).all()


# -- the emulation against a plain restatement -----------------------------------------------------------


def _wide(t, lo, hi, seed):
    """t with every element scaled by 10^U(lo, hi): values in every binade from the subnormals to
    saturation, where a scale other than the stated one would round differently (a power-of-two change of
    scale rounds the normal range identically)."""
    return (
        t.float() * 10 ** torch.empty(t.shape).uniform_(lo, hi, generator=torch.Generator().manual_seed(seed))
    ).to(t.dtype)


def _q(v, s, fmt):
    lim = 448.0 if fmt == E4M3 else 57344.0
    return (v.float() / s).clamp(-lim, lim).to(fmt)


def _mm(a, b, sa, sb, dt):
    return ((a.float() @ b.float()) * (sa * sb)).to(dt)


def test_emulated_fp8_mlp_equals_a_plain_restatement_bitwise():
    x, w1, w2, g = _data(seed=3)
    # x from 2^-4 subnormals (|x| < 2^-10) to near 448 2^-4 = 28; the gradient from e5m2's subnormals at
    # 2^-6 (|g| < 2^-20) past its saturation (57344 2^-6 = 896)
    x, g = _wide(x, -4, 1.1, 10), _wide(g, -7, 3, 11)
    st, out, dx, dw1, dw2 = _fp8_mlp(x, w1, w2, g)
    assert 0 < st.clip_counts()[0, SITE["mlp.grad"]] < 0.05 * g.numel()
    m = st.mlp
    w1_s, w2_s = m["w_s"][0]
    # upstream's constants, written out: x 2^-4 e4m3, gradient 2^-6 e5m2, post 1.0 and dpre 2^-6 initially
    xs, gs = torch.tensor(2.0**-4), torch.tensor(2.0**-6)
    post_s, dpre_s = torch.tensor(1.0), torch.tensor(2.0**-6)
    assert torch.equal(w1_s, w1.float().abs().amax() / 448) and torch.equal(
        w2_s, w2.float().abs().amax() / 448
    )
    w1q, w2q = _q(w1, w1_s, E4M3), _q(w2, w2_s, E4M3)
    xq = _q(x, xs, E4M3)
    pre = _mm(xq, w1q.t(), xs, w1_s, torch.bfloat16)
    post = F.relu(pre).square()
    pq = _q(post, post_s, E4M3)
    ref_out = _mm(pq, w2q.t().contiguous().t(), post_s, w2_s, torch.bfloat16)
    gq = _q(g, gs, E5M2)
    ref_dw2 = _mm(pq.t().contiguous(), gq.t().contiguous().t(), post_s, gs, torch.bfloat16)
    dpost = _mm(gq, w2q.t(), gs, w2_s, torch.bfloat16)
    dpre = 2.0 * dpost.float() * F.relu(pre).float()
    dq = _q(dpre, dpre_s, E5M2)
    ref_dx = _mm(dq, w1q.t().contiguous().t(), dpre_s, w1_s, torch.bfloat16)
    ref_dw1 = _mm(dq.t().contiguous(), xq.t().contiguous().t(), dpre_s, xs, torch.bfloat16)
    for name, a, b in (
        ("out", out, ref_out),
        ("dx", dx, ref_dx),
        ("dw1", dw1, ref_dw1),
        ("dw2", dw2, ref_dw2),
    ):
        assert torch.equal(a, b), name
    # the amaxes the next refresh turns into scales
    assert torch.equal(m["post_amax"][0], post.amax().float())
    assert torch.equal(m["dpre_amax"][0], dpre.abs().amax())


def test_emulated_fp8_qkv_equals_a_plain_restatement_bitwise():
    x, w, _, _ = _data(hidden=96, seed=4)
    g = torch.randn(x.size(0), 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    x, g = _wide(x, -5, 1, 12), _wide(g, -9, 2, 13)  # through 8/448's and 1/448's subnormals and saturation
    st = FP8State(FP8Config(qkv=True))
    st.refresh(None, {3: w}, None)
    gain = torch.tensor(0.7, requires_grad=True)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = st.qkv_forward(3)(xg, wg, gain)
    out.backward(g)
    xs, gs = torch.tensor(8 / 448), torch.tensor(1 / 448)
    ws = w.float().abs().amax() / 448
    gain_c = gain.detach().bfloat16().float()
    wq, xq, gq = _q(w, ws, E4M3), _q(x, xs, E4M3), _q(g, gs, E5M2)
    assert torch.equal(out, _mm(xq, wq.t(), xs, ws * gain_c, torch.bfloat16))
    assert torch.equal(xg.grad, _mm(gq, wq.t().contiguous().t(), gs, ws * gain_c, torch.bfloat16))
    dw_eff = _mm(gq.t().contiguous(), xq.t().contiguous().t(), gs, xs, torch.float32)
    assert torch.equal(wg.grad, (dw_eff * gain_c).bfloat16())
    assert torch.equal(gain.grad, (dw_eff * w.float()).sum())
    assert st.clip_counts()[0, SITE["qkv.x"]] > 0 and st.clip_counts()[0, SITE["qkv.grad"]] > 0


def test_fp8_logits_equal_a_plain_restatement_bitwise():
    x, _, _, _ = _data(seed=14)
    x = _wide(x, -6, 2.2, 15)  # 100/448's subnormals (|x| < 2^-8.2) to past its saturation at 100
    lm = _wide(
        (torch.randn(64, 200, generator=torch.Generator().manual_seed(16)) * 0.05).bfloat16(), -4, 1.7, 17
    )
    st = FP8State(FP8Config(lm_head=True))
    st.refresh(None, None, lm)
    got = fp8_mod.fp8_logits(
        st.lm_head_input(x), st.lm_col, out=torch.empty(x.size(0), 200, dtype=torch.bfloat16)
    )
    xs, ws = torch.tensor(100 / 448), torch.tensor(2 / 448)
    ref = _mm(_q(x, xs, E4M3), _q(lm.t(), ws, E4M3).t(), xs, ws, torch.bfloat16)
    assert torch.equal(got, ref)
    assert st.clip_counts()[0, SITE["lm_head.x"]] > 0 and st.clip_counts()[0, SITE["lm_head.w"]] > 0


# -- scales ------------------------------------------------------------------------------------------------


def test_delayed_scales_take_the_amax_since_the_last_refresh_with_upstreams_headroom():
    x, w1, w2, g = _data(seed=6)
    bank = torch.stack((w1, w2))[None]
    st = _state(bank, mlp=True)
    amax_post, amax_dpre = [], []
    for k in range(2):  # two micro batches before one optimizer update
        _fp8_mlp(x * (1 + k), w1, w2, g * (1 + k), st)
        amax_post.append(st.mlp["post_amax"][0].clone())
        amax_dpre.append(st.mlp["dpre_amax"][0].clone())
    st.refresh(bank, None, None)
    assert torch.equal(st.mlp["post_s"][0], torch.maximum(*amax_post) * (1.03 / 448))
    assert torch.equal(st.mlp["dpre_s"][0], torch.maximum(*amax_dpre) * (1.25 / 57344))
    assert st.mlp["post_amax"][0] == 0 and st.mlp["dpre_amax"][0] == 0
    # a refresh with no forward since (amax 0) keeps the scales
    before = torch.stack(st.mlp["post_s"])
    st.refresh(bank, None, None)
    assert torch.equal(torch.stack(st.mlp["post_s"]), before)


def test_weight_scales_are_exact_for_16_refreshes_then_one_refresh_late_with_headroom():
    x, w1, w2, _ = _data(seed=7)
    st = FP8State(FP8Config(mlp=True))
    amaxes = []
    for k in range(19):
        bank = torch.stack((w1, w2))[None] * (1 + 0.01 * k)
        st.refresh(bank, None, None)
        amaxes.append(bank.float().abs().amax(dim=(2, 3))[0])
        if k < 16:
            expected = amaxes[k] / 448
        else:
            expected = amaxes[k - 1] * (1.12 / 448)
        assert torch.equal(torch.stack(st.mlp["w_s"][0]), expected), k
        assert torch.equal(st.mlp["row"][0, 0], _q(bank[0, 0], expected[0], E4M3)), k
        assert torch.equal(st.mlp["t"][0, 1], _q(bank[0, 1], expected[1], E4M3).t()), k
    st.rearm()
    assert st.refreshes == 0
    assert all(s == 1.0 for s in st.mlp["post_s"]) and all(s == 2.0**-6 for s in st.mlp["dpre_s"])


def test_every_scale_a_gemm_reads_is_its_own_allocation(monkeypatch):
    # cuBLASLt refuses a scale pointer inside a stacked tensor (CUBLAS_STATUS_NOT_SUPPORTED on an H100) and
    # Inductor fails to lower _scaled_mm on such a view: every scale fp8_mm gets must own its storage.
    import track_1_short.model.fp8 as fp8

    x, w1, w2, g = _data(seed=12)
    seen = []
    real = fp8.fp8_mm

    def spy(a, b, scale_a, scale_b, *args, **kwargs):
        seen.extend((scale_a, scale_b))
        return real(a, b, scale_a, scale_b, *args, **kwargs)

    monkeypatch.setattr(fp8, "fp8_mm", spy)
    st = FP8State(FP8Config(mlp=True, qkv=True, lm_head=True))
    bank = torch.stack((w1, w2))[None].repeat(2, 1, 1, 1)
    st.refresh(bank, {0: w1[:64], 1: w2[:64]}, w1.t().contiguous())
    for slot in (0, 1):
        st.mlp_forward(x.clone().requires_grad_(), slot, w1, w2).backward(g)
    qx = x.clone().requires_grad_()
    st.qkv_forward(1)(qx, w2[:64], torch.tensor(0.5)).backward(torch.ones(x.size(0), 64, dtype=x.dtype))
    fp8.fp8_logits(st.lm_head_input(x), st.lm_col)
    assert len(seen) == 2 * (2 * 6 + 3 + 1)  # two MLP slots of 6 GEMMs, QKV's 3, the logits GEMM
    for scale in seen:
        assert scale.dim() == 0 and scale.storage_offset() == 0, scale
        assert scale.untyped_storage().nbytes() == scale.element_size(), "a view into a bigger tensor"


def test_a_scale_that_clips_more_than_the_stated_fraction_is_reported():
    x, w1, w2, g = _data(seed=8, g_mag=2000.0)  # 2000 / 2^-6 overflows e5m2's 57344 on most entries
    st, *_ = _fp8_mlp(x, w1, w2, g)
    lines = st.clip_report()
    assert any(line.startswith("fp8: mlp.grad saturated") for line in lines), lines
    assert not any("mlp.x" in line for line in lines)
    assert st.clip_report() == []  # counted since the last report only
    x, w1, w2, g = _data(seed=8)
    st, *_ = _fp8_mlp(x, w1, w2, g)
    assert st.clip_report() == []


# -- the model's switches and the refresh cadence ---------------------------------------------------------


def _tiny(**fp8):
    torch.manual_seed(0)
    from track_1_short.model.gpt import GPT

    m = GPT(load_config("tiny", vocab_size=1024, fp8=fp8))
    with torch.no_grad():  # c_proj starts at zero; give the down projection something to carry
        m.mlp_bank[:, 1].normal_(0, 0.02)
    return m


def _batch():
    g = torch.Generator().manual_seed(0)
    inp = torch.randint(1, 1024, (256,), generator=g)
    inp[[0, 100]] = 0
    return (
        inp.int(),
        torch.randint(0, 1024, (256,), generator=g),
        torch.tensor([0, 100, 256], dtype=torch.int32),
    )


def test_switches_off_run_the_bf16_path_and_evaluation_never_uses_fp8(monkeypatch):
    inp, tgt, cu = _batch()
    off = _tiny()
    assert off._fp8 is None
    on = _tiny(mlp=True, qkv=True, lm_head=True)
    assert torch.equal(off.val_loss_sum(inp, tgt, cu, (1, 2)), on.val_loss_sum(inp, tgt, cu, (1, 2)))
    with torch.no_grad():
        assert torch.equal(off(inp, tgt, cu, (1, 2)), on(inp, tgt, cu, (1, 2)))
    assert on._fp8.refreshes == 0  # an evaluation forward does not even build the copies

    calls = {"mlp": 0, "qkv": 0, "lm": 0}
    real = (fp8_mod.FP8ReLU2MLP.apply, fp8_mod.FP8Linear.apply, fp8_mod.fp8_logits)

    def counting(key, fn):
        def wrapper(*a, **k):
            calls[key] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(fp8_mod.FP8ReLU2MLP, "apply", counting("mlp", real[0]))
    monkeypatch.setattr(fp8_mod.FP8Linear, "apply", counting("qkv", real[1]))
    monkeypatch.setattr(fp8_mod, "fp8_logits", counting("lm", real[2]))
    cfg = off.cfg
    n_mlp = cfg.num_layers - len(cfg.no_mlp_layers) + (cfg.parallel_mlp_layer >= 0)
    for switches, expected in (
        ({"mlp": True}, {"mlp": n_mlp, "qkv": 0, "lm": 0}),
        ({"qkv": True}, {"mlp": 0, "qkv": len(cfg.attn_layers), "lm": 0}),
        ({"lm_head": True}, {"mlp": 0, "qkv": 0, "lm": -(-256 // cfg.loss_chunk_rows)}),  # one per chunk
    ):
        calls.update(mlp=0, qkv=0, lm=0)
        _tiny(**switches)(inp, tgt, cu, (1, 2))
        assert calls == expected, switches


def test_no_preset_switches_an_fp8_path_on_while_it_measures_slower():
    # FP8 measured slower than bf16 in the trainer on an H100 (configs/experiment/record.yaml says how much).
    from tests.test_config import compose_train, to_object

    for preset in ("default", "smoke_record", "record", "record_1gpu"):
        f = to_object(compose_train(f"experiment={preset}")).model.fp8
        assert not f.any, preset


def test_the_trainer_refreshes_the_copies_once_per_optimizer_update(tmp_path):
    from tests.faults_runs import build, run_route, short_cfg

    cfg = short_cfg(str(tmp_path), "model.fp8.mlp=true", "model.fp8.qkv=true", "model.fp8.lm_head=true")
    with run_route(cfg):
        t = build(cfg)
        st = t.model._fp8
        assert st.refreshes == 1  # the built weights' copies
        micro = {"n": 0}
        real_forward = t.forward

        def forward(*a, **k):
            micro["n"] += 1
            return real_forward(*a, **k)

        t.forward = forward
        for step in range(2):
            t.train_step(step)
        assert micro["n"] == 4  # two micro batches a step: a per-micro-batch refresh would count 5
        assert st.refreshes == 3
        # the copies are the updated weights'
        m = st.mlp
        assert torch.equal(
            m["row"],
            _q(t.model.mlp_bank, torch.stack([torch.stack(p) for p in m["w_s"]])[:, :, None, None], E4M3),
        )
        lm = t.model.lm_head
        assert torch.equal(st.lm_col, _q(lm.t(), 2 / 448, E4M3))
        layer = next(iter(st.qkv))
        qk_w, v_w, _ = t.model._attn_weights()[layer]
        w = torch.cat((qk_w, v_w))
        assert torch.equal(st.qkv[layer][0], _q(w, w.float().abs().amax() / 448, E4M3))
        assert st.clip_counts()[1, SITE["mlp.grad"]] > 0  # the backward counted what it quantised
        # the loss is a per-token mean over the step's 512 tokens: the gradient scales are upstream's / 512
        assert st.loss_divisor == 512
        assert st.consts["mlp_g"] == torch.tensor(2.0**-6 / 512)
        assert st.consts["qkv_g"] == torch.tensor((1 / 448) / 512)


# -- GPU: torch._scaled_mm against the emulation -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_scaled_mm_agrees_with_the_emulation(fast_accum, fmts):
    needs_fp8_gpu()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 512, 768, 1152
    a = _q(torch.randn(m, k, device="cuda", generator=gen), 1 / 64, fmts[0])
    b = _q(torch.randn(n, k, device="cuda", generator=gen), 1 / 64, fmts[1]).t()
    sa, sb = torch.tensor(1 / 64, device="cuda"), torch.tensor(1 / 32, device="cuda")
    got = fp8_mod.fp8_mm(a, b, sa, sb, torch.bfloat16, fast_accum, emulate=False)
    ref = fp8_mod.fp8_mm(a, b, sa, sb, torch.float32, fast_accum, emulate=True)
    mag = (a.float().abs() @ b.float().abs()) * (sa * sb)
    # The operands are the same FP8 numbers, exact in fp32, so only the accumulation and the output rounding
    # differ: bf16 output rounding (2^-8 relative), plus the fp32 sum's order (K 2^-24 relative to the
    # magnitude sum). Hopper's fast accumulation keeps fewer accumulator bits between promotions (about
    # 2^-13 relative per addition, by its published 22-bit accumulator), so that bound is K 2^-13 instead.
    acc_u = 2.0**-13 if fast_accum else 2.0**-24
    bound = 2.0**-8 * ref.abs() + k * acc_u * mag
    assert (got.float() - ref).abs().le(bound).all()
    assert torch.isfinite(got).all()


@pytest.mark.gpu
def test_scaled_mm_mlp_and_qkv_agree_with_their_emulation():
    needs_fp8_gpu()
    x, w1, w2, g = (t.cuda() for t in _data(t=256, d=768, hidden=2816, seed=9))
    g_qkv = torch.randn(256, 1152, generator=torch.Generator().manual_seed(10)).bfloat16().cuda()
    res = {}
    for emulate in (True, False):
        st = FP8State(FP8Config(mlp=True, qkv=True), emulate=emulate)
        st.refresh(torch.stack((w1, w2))[None], {0: w1[:1152]}, None)
        _, *res[emulate] = _fp8_mlp(x, w1, w2, g, st)
        gain = torch.tensor(0.5, device="cuda", requires_grad=True)
        xg, wg = x.clone().requires_grad_(), w1[:1152].clone().requires_grad_()
        out = st.qkv_forward(0)(xg, wg, gain)
        out.backward(g_qkv)
        res[emulate] += [out.detach(), xg.grad, wg.grad, gain.grad]
    names = ("mlp out", "mlp dx", "mlp dw1", "mlp dw2", "qkv out", "qkv dx", "qkv dw", "qkv dgain")
    for name, e, k in zip(names, res[True], res[False]):
        # Same FP8 operands on both sides up to the first GEMM; after it, a bf16 intermediate (pre, post,
        # dpre) that differs by one rounding can quantise to a neighbouring FP8 value (2^-3 relative for e4m3
        # at worst), so the outputs are compared normwise: within 2% of the output's norm, where the FP8
        # error itself against bf16 is several percent (test_emulated_fp8_mlp_agrees_with_bf16_...).
        err = (k.float() - e.float()).norm() / e.float().norm()
        assert err < 0.02, (name, err.item())


@pytest.mark.gpu
@pytest.mark.parametrize("mlp_impl", ["scaled_mm", "triton"])
def test_the_compiled_fp8_model_trains_as_the_eager_one_on_cuda(mlp_impl):
    needs_fp8_gpu()
    from track_1_short.model.gpt import GPT

    inp, tgt, cu = (t.cuda() for t in _batch())
    results = {}
    for mode in ("bf16", "eager", "compiled"):
        torch.manual_seed(0)
        fp8 = {"mlp": True, "qkv": True, "lm_head": True, "mlp_impl": mlp_impl} if mode != "bf16" else {}
        m = GPT(load_config("tiny", vocab_size=1024, fp8=fp8), device="cuda")
        with torch.no_grad():
            m.mlp_bank[:, 1].normal_(0, 0.02)
        m.refresh_fp8()
        m.follow_windows((1, 2))
        f = torch.compile(m, dynamic=False) if mode == "compiled" else m
        windows = torch.tensor([1, 2], device="cuda")
        loss = f(inp, tgt, cu, windows, torch.tensor([1.0, 0.5], device="cuda"))
        loss.backward()
        st = m._fp8
        results[mode] = (
            loss.detach(),
            [p.grad.float() for p in m.parameters() if p.grad is not None],
            st.clip_counts() if st is not None else None,
        )
        if st is not None:
            assert (
                torch.stack(st.mlp["post_amax"]).gt(0).any() and torch.stack(st.mlp["dpre_amax"]).gt(0).any()
            )  # the graphs' mutations landed
    (_, gb, _), (le, ge, ce), (lc, gc, cc) = results["bf16"], results["eager"], results["compiled"]
    # Inductor fuses the quantises into other kernels and keeps in fp32 some intermediates that eager rounds
    # to bf16 (pre, post), so some values land on the neighbouring FP8 number: compiled and eager are two
    # realisations of the same FP8 error (one e4m3 step is 2^-3 relative, an e5m2 step 2^-2), not one
    # another's copy; on an H100 one gradient of the two differed by 8.4% of its norm. What must hold: the
    # loss within 1e-3 relative, and each compiled gradient as close to the bf16 model's as the eager one's
    # is, within a margin of half that error for the realisation's spread.
    assert torch.isfinite(lc) and abs(lc - le) <= 1e-3 * abs(le)
    for ref, e, c in zip(gb, ge, gc):
        err_e, err_c = (e - ref).norm(), (c - ref).norm()
        assert err_c <= 1.5 * err_e + 1e-6 * ref.norm(), (err_c / ref.norm(), err_e / ref.norm())
    assert torch.equal(ce[1], cc[1])  # the same operands were counted


def test_a_graph_break_between_fp8_layers_leaves_their_compiled_backwards_intact():
    # Each compiled graph's backward checks the versions of the tensors it saved; the counters and amaxes a
    # backward writes are per slot, so a later slot's graph writing its own never trips an earlier one's.
    x, w1, w2, g = _data(seed=18)
    bank = torch.stack((torch.stack((w1, w2)), torch.stack((w1, w2)) * 0.5))  # two slots
    results = []
    for compiled in (False, True):
        st = FP8State(FP8Config(mlp=True))
        st.refresh(bank, None, None)
        ws = [t.clone().requires_grad_() for t in (w1, w2, w1 * 0.5, w2 * 0.5)]

        def two_layers(x, st=st, ws=ws):
            h = st.mlp_forward(x, 0, ws[0], ws[1])
            torch._dynamo.graph_break()
            return st.mlp_forward(F.rms_norm(h, (h.size(-1),)), 1, ws[2], ws[3])

        fn = torch.compile(two_layers, backend="aot_eager", dynamic=False) if compiled else two_layers
        xg = x.clone().requires_grad_()
        fn(xg).backward(g)
        results.append((xg.grad, *(w.grad for w in ws), st.clip_counts(), *st.mlp["dpre_amax"]))
    for a, b in zip(*results):
        assert torch.equal(a, b)
