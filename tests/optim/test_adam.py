"""The per-parameter Adam reference (track_1_short/optim/adam.py): its arithmetic, scalars and rounding."""

import math

import numpy as np
import pytest
import torch

from tests.perf.replicated_adam_cases import AdamCfg, assert_bitwise
from track_1_short.optim import adam


def _state(shape, gen):
    return {
        "step": 0,
        "exp_avg": torch.randn(shape, generator=gen) * 0.01,
        "exp_avg_sq": torch.rand(shape, generator=gen) * 1e-4,
    }


def _float64_adam(p, g, m, v, cfg, step):
    """An independent float64 Adam with the same definition (no shared code with adam.py)."""
    b1, b2 = cfg.adam_betas
    lr = cfg.lr * cfg.lr_mul
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (v.sqrt() + cfg.eps) * (lr * math.sqrt(1 - b2**step) / (1 - b1**step))
    u = torch.where(u * p > 0, u + lr**2 * cfg.weight_decay * cfg.wd_mul * p, u)
    return p - u, m, v


def test_fp32_step_agrees_with_an_independent_float64_adam_to_fp32_rounding():
    gen = torch.Generator().manual_seed(0)
    cfg = AdamCfg(adam_betas=[0.8, 0.95], lr_mul=3.0, weight_decay=2.0, wd_mul=5.0)
    p = torch.randn(4096, generator=gen)
    g = torch.randn(4096, generator=gen)
    state = _state(4096, gen)
    state["step"] = 6
    ref_p, ref_m, ref_v = _float64_adam(
        p.double(), g.double(), state["exp_avg"].double(), state["exp_avg_sq"].double(), cfg, 7
    )
    adam.adam_update_(p, g, state, cfg)
    assert state["step"] == 7
    # A few fp32 roundings of terms of size <= 1 per element (|g| ~ 1, |p| ~ 1): absolute errors of a few
    # 1e-8, where a wrong bias correction, beta or decay would move values by 1e-3 or more.
    torch.testing.assert_close(state["exp_avg"].double(), ref_m, rtol=1e-6, atol=5e-8)
    torch.testing.assert_close(state["exp_avg_sq"].double(), ref_v, rtol=1e-6, atol=5e-8)
    torch.testing.assert_close(p.double(), ref_p, rtol=1e-6, atol=2e-7)


def test_first_step_moves_each_element_by_lr_times_lr_mul():
    # With zero moments, step 1 gives m = (1-b1) g, sqrt(v) = sqrt(1-b2) |g|, and step_size folds both
    # corrections, so |u| = lr * lr_mul for every element (eps is negligible against |g| ~ 1), any betas.
    gen = torch.Generator().manual_seed(1)
    cfg = AdamCfg(adam_betas=[0.5, 0.9], lr_mul=2.5, wd_mul=0.0)
    p = torch.randn(512, generator=gen)
    g = torch.randn(512, generator=gen).sign() * (1 + torch.rand(512, generator=gen))
    state = {"step": 0, "exp_avg": torch.zeros(512), "exp_avg_sq": torch.zeros(512)}
    before = p.clone()
    adam.adam_update_(p, g, state, cfg)
    torch.testing.assert_close((before - p).abs(), torch.full((512,), cfg.lr * cfg.lr_mul), rtol=1e-5, atol=0)
    assert torch.equal(torch.sign(before - p), torch.sign(g))


def test_cautious_decay_applies_only_where_update_and_param_share_a_strict_sign():
    cfg = AdamCfg(adam_betas=[0.9, 0.99], lr_mul=1.0, weight_decay=1000.0, wd_mul=1.0)
    # u has the sign of g at step 1; p = 0 makes u * p == 0 (no decay: the gate is strict).
    p = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0])
    g = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    state = {"step": 0, "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
    eff_wd = np.float32(adam.adam_step_scalars(cfg, 1)[1])
    u = np.float32(cfg.lr) * np.sign(g.numpy())  # |u| = lr at step 1 (see the test above)
    decayed = torch.from_numpy(p.numpy() - (u + eff_wd * p.numpy()))
    plain = torch.from_numpy(p.numpy() - u)
    adam.adam_update_(p, g, state, cfg)
    same_sign = torch.tensor([True, True, False, False, False])
    torch.testing.assert_close(p[same_sign], decayed[same_sign], rtol=1e-5, atol=0)
    torch.testing.assert_close(p[~same_sign], plain[~same_sign], rtol=1e-5, atol=0)
    assert (p[same_sign] - plain[same_sign]).abs().min() > 1e-3  # the decay term is visible


def test_bf16_param_takes_the_fp32_result_rounded_to_nearest_even():
    gen = torch.Generator().manual_seed(2)
    cfg = AdamCfg(lr_mul=7.0, weight_decay=3.0)
    p16 = torch.randn(2048, generator=gen).to(torch.bfloat16)
    g16 = torch.randn(2048, generator=gen).to(torch.bfloat16)
    s16 = _state(2048, gen)
    p32, g32 = p16.float(), g16.float()
    s32 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s16.items()}
    adam.adam_update_(p16, g16, s16, cfg)
    adam.adam_update_(p32, g32, s32, cfg)
    assert_bitwise(p16, p32.to(torch.bfloat16), "bf16 param vs fp32 result rounded")  # torch CPU rounds RNE
    assert_bitwise(s16["exp_avg"], s32["exp_avg"], "exp_avg")
    assert_bitwise(s16["exp_avg_sq"], s32["exp_avg_sq"], "exp_avg_sq")


def test_step_scalars_are_doubles_rounded_once_into_the_fp32_buffers():
    cfg = AdamCfg(lr=0.0123, lr_mul=0.3, weight_decay=0.07, wd_mul=11.0)
    buffers = adam.new_scalar_buffers()
    state = {"step": 41, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    adam.adam_update_(torch.zeros(3), torch.ones(3), state, cfg, buffers)
    step_size, eff_wd = adam.adam_step_scalars(cfg, 42)
    lr = 0.0123 * 0.3
    assert step_size == lr * math.sqrt(1 - 0.99**42) / (1 - 0.9**42)
    assert eff_wd == lr * lr * 0.07 * 11.0
    assert buffers[0].item() == float(np.float32(step_size))
    assert buffers[1].item() == float(np.float32(eff_wd))


def test_reference_square_root_is_the_ieee_fp32_root_on_the_cpu():
    # numpy's float32 sqrt is correctly rounded; the reference must agree bit for bit (eager torch does not).
    v = torch.rand(100_000, generator=torch.Generator().manual_seed(3)) * 1e-3
    expected = torch.from_numpy(np.sqrt(v.numpy()))
    assert_bitwise(adam._sqrt_rn(v), expected, "sqrt")


def test_non_fp32_moments_are_rejected_before_the_step():
    p = torch.ones(4)
    state = {"step": 0, "exp_avg": torch.zeros(4, dtype=torch.bfloat16), "exp_avg_sq": torch.zeros(4)}
    with pytest.raises(TypeError, match="float32"):
        adam.adam_update_(p, torch.ones(4), state, AdamCfg())
    assert state["step"] == 0 and torch.equal(p, torch.ones(4))


@pytest.mark.gpu
def test_compiled_cuda_step_agrees_with_the_cpu_reference_to_a_few_ulps():
    # Not bitwise by design: compiled CUDA code fuses mul-adds into fma and Inductor divides with div.full.f32
    # (<= 2 ulp), while eager CPU rounds every operation. The fused kernel matches the compiled step bitwise
    # (tests/perf/test_kernel_replicated_adam.py); this checks the compiled path computes the same Adam.
    gen = torch.Generator().manual_seed(4)
    cfg = AdamCfg(lr_mul=2.0, weight_decay=1.0)
    p = torch.randn(8192, generator=gen)
    g = torch.randn(8192, generator=gen)
    s_cpu = _state(8192, gen)
    s_gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in s_cpu.items()}
    s_before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s_cpu.items()}
    p_gpu = p.cuda()
    adam.adam_update_(p, g, s_cpu, cfg)
    adam.adam_update_(p_gpu, g.cuda(), s_gpu, cfg)
    torch.testing.assert_close(p_gpu.cpu(), p, rtol=1e-6, atol=1e-9)
    # The moments are sums of two products that can nearly cancel, so the bound is on the terms, not on the
    # result: fma skips one rounding of one product, at most half an ulp of each term apart (2 eps to spare).
    beta1, beta2 = cfg.adam_betas
    m0, v0 = s_before["exp_avg"], s_before["exp_avg_sq"]
    eps32 = torch.finfo(torch.float32).eps
    m_terms = (beta1 * m0).abs() + ((1 - beta1) * g).abs()
    v_terms = (beta2 * v0).abs() + ((1 - beta2) * g * g).abs()
    assert ((s_gpu["exp_avg"].cpu() - s_cpu["exp_avg"]).abs() <= 2 * eps32 * m_terms).all()
    assert ((s_gpu["exp_avg_sq"].cpu() - s_cpu["exp_avg_sq"]).abs() <= 2 * eps32 * v_terms).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cautious_decay_is_strict_where_the_update_is_exactly_zero(dtype):
    # u = 0 exactly (zero gradient and zero first moment) on nonzero parameters of both signs: u * p = 0,
    # so the strict gate applies no decay and p stays bitwise; a gate of u * p >= 0 would shrink every one.
    p = torch.tensor([1.5, -0.75, 3.0, -2.0]).to(dtype)
    before = p.clone()
    m, v = torch.zeros(4), torch.full((4,), 1e-4)
    step_size, eff_wd = torch.tensor(1e-2), torch.tensor(0.1)
    adam.adam_step_(p, torch.zeros(4, dtype=dtype), m, v, 0.9, 0.99, 1e-10, step_size, eff_wd)
    assert_bitwise(p, before, "param with u = 0")
    # The control: with gradients of p's sign the same decay does apply (u * p > 0).
    q = before.clone()
    adam.adam_step_(q, before.sign(), torch.zeros(4), torch.zeros(4), 0.9, 0.99, 1e-10, step_size, eff_wd)
    undecayed = before.clone()
    adam.adam_step_(
        undecayed,
        before.sign(),
        torch.zeros(4),
        torch.zeros(4),
        0.9,
        0.99,
        1e-10,
        step_size,
        torch.tensor(0.0),
    )
    assert ((q.float() - undecayed.float()).abs() > 0).all()
