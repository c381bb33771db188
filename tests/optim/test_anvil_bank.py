"""ANVIL's per-bank update: the fp32 master split into bf16 + mantissa, the lane equaliser, the rails, the
sign-gated decay, and the whole update against a float64 reference written from the formulas."""

from __future__ import annotations

import math

import pytest
import torch

from track_1_short.optim.anvil_bank import (
    AnvilBank,
    equalise_lanes_,
    join_master,
    sign_gated_step_,
    split_master,
    twin_rails_,
)
from track_1_short.optim.polar_express import ANVIL_MAPS


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def special_fp32() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
    extremes = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, float("inf"), float("-inf")])
    return torch.cat([values, extremes])


def test_master_round_trip_is_exact():
    p32 = special_fp32()
    high, low = split_master(p32)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.uint16
    assert torch.equal(bits(join_master(high, low)), bits(p32))
    # And the other way: any (bf16, uint16) pair survives join then split.
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1000, generator=gen).bfloat16()
    m = torch.randint(0, 1 << 16, (1000,), generator=gen, dtype=torch.int32).to(torch.uint16)
    w2, m2 = split_master(join_master(w, m))
    assert torch.equal(bits(w2), bits(w)) and torch.equal(m2.to(torch.int32), m.to(torch.int32))


def test_master_weight_is_the_truncated_fp32_and_a_zero_mantissa_is_the_bf16_value():
    p32 = special_fp32()[:-2]  # finite values
    high, _ = split_master(p32)
    assert bool((high.float().abs() <= p32.abs()).all())  # truncation: toward zero, never rounded up
    assert torch.equal(
        bits(join_master(high, torch.zeros(p32.shape, dtype=torch.uint16))), bits(high.float())
    )


def test_mantissa_keeps_steps_smaller_than_a_bf16_ulp():
    # Steps of 1e-4 on weights near 1 (bf16 ulp there: 2^-7 = 7.8e-3) vanish if the weight is rounded to bf16
    # each step; with the mantissa the master is exactly an fp32 accumulation of the same steps.
    w = torch.ones(1, 2, 2, dtype=torch.bfloat16)
    m = torch.zeros(1, 2, 2, dtype=torch.uint16)
    upd = torch.full((1, 2, 2), 1e-4)
    lr, wd = torch.ones(1, 1, 1), torch.tensor(0.0)
    p32 = torch.ones(1, 2, 2)
    for _ in range(200):
        sign_gated_step_(w, m, upd, torch.zeros(1, 2, 2), lr, wd)
        p32 = p32 - torch.zeros(()) - upd * lr  # the same fp32 operations, no decay
    assert torch.equal(bits(join_master(w, m)), bits(p32))
    assert float(w[0, 0, 0]) < 1.0  # the bf16 weight moved, although each step is 1/78 of its ulp
    rounded = torch.ones(1, 2, 2, dtype=torch.bfloat16)
    for _ in range(200):
        rounded = (rounded.float() - 1e-4).bfloat16()
    assert float(rounded[0, 0, 0]) == 1.0


def test_decay_is_gated_by_the_slow_rail_sign_with_zero_counting_as_aligned():
    p32 = torch.tensor([[[0.5, 0.5, -0.5, -0.5, 0.5, 0.25]]])
    slow = torch.tensor([[[1.0, -1.0, -1.0, 1.0, 0.0, 2.0]]])
    w, m = split_master(p32)
    lr, wd = torch.full((1, 1, 1), 0.5), torch.tensor(0.25)
    sign_gated_step_(w, m, torch.zeros_like(p32), slow, lr, wd)
    got = join_master(w, m)
    aligned = torch.tensor([[[True, False, True, False, True, True]]])
    expected = torch.where(aligned, p32 * (1 - 0.5 * 0.25), p32)
    assert torch.equal(got, expected)  # exact: powers of two


def test_equaliser_keeps_each_matrix_frobenius_norm_and_evens_out_lanes():
    gen = torch.Generator().manual_seed(2)
    for shape in [(3, 24, 8), (3, 8, 24), (2, 16, 16)]:
        red_dim = -1 if shape[1] >= shape[2] else -2
        lanes = (shape[0], shape[1], 1) if red_dim == -1 else (shape[0], 1, shape[2])
        # Lanes of very different scales.
        scale = torch.logspace(-2, 2, shape[1] if red_dim == -1 else shape[2])
        scale = scale.view(1, -1, 1) if red_dim == -1 else scale.view(1, 1, -1)
        v = torch.randn(shape, generator=gen) * scale
        energy = torch.zeros(lanes)
        norm_before = v.norm(dim=(-2, -1))
        out = equalise_lanes_(v.clone(), energy, 0.9, red_dim)
        # fp32 sums of at most a few hundred squares: 1e-5 relative is ~100 ulp of headroom.
        torch.testing.assert_close(out.norm(dim=(-2, -1)), norm_before, rtol=1e-5, atol=0)
        # From zero history the gain is 1/RMS of the lane itself: every lane ends with the same RMS.
        lane_rms = out.square().mean(dim=red_dim).sqrt()
        torch.testing.assert_close(
            lane_rms, lane_rms.mean(dim=-1, keepdim=True).expand_as(lane_rms), rtol=1e-5, atol=0
        )
        # The history moved 0.1 of the way to this step's mean squares.
        torch.testing.assert_close(
            energy, 0.1 * v.square().mean(dim=red_dim, keepdim=True), rtol=1e-6, atol=0
        )


def test_equaliser_maps_a_zero_matrix_to_zero():
    v = torch.zeros(2, 8, 24)
    out = equalise_lanes_(v, torch.zeros(2, 1, 24), 0.9, -2)
    assert not out.any() and not torch.isnan(out).any()


def test_twin_rails_follow_their_formulas():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(2, 4, 5, generator=gen)
    vel = torch.randn(2, 2, 4, 5, generator=gen)
    fast0, slow0 = vel[0].double(), vel[1].double()
    mu, fb, fw, sb = 0.9, 0.85, 0.4385, 0.98
    u = twin_rails_(vel, g, torch.tensor(mu), torch.tensor(fb), torch.tensor(fw), sb)
    gd = g.double()
    fast = fb * fast0 + (1 - fb) * gd
    slow = sb * slow0 + (1 - sb) * gd
    blend = fw * fast + (1 - fw) * slow
    # fp32 lerps of O(1) values: a few ulp.
    torch.testing.assert_close(vel[0].double(), fast, rtol=0, atol=1e-6)
    torch.testing.assert_close(vel[1].double(), slow, rtol=0, atol=1e-6)
    torch.testing.assert_close(u.double(), gd + mu * (blend - gd), rtol=0, atol=2e-6)


# -- the whole update against float64 --
def cascade64(x: torch.Tensor) -> torch.Tensor:
    """The same six maps in float64 on one matrix, always in the X X^T form (no tall/wide dispatch)."""
    x = x / (1.05 * x.norm() + 1e-6)
    for a, b, c in ANVIL_MAPS:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


class Reference64:
    """ANVIL for one bank written from the formulas, in float64, matrix by matrix."""

    def __init__(self, weight: torch.Tensor):
        self.p = weight.double().clone()
        n, rows, cols = weight.shape
        self.fast = torch.zeros(n, rows, cols, dtype=torch.float64)
        self.slow = torch.zeros_like(self.fast)
        self.energy = [None] * n

    def step(self, grad, momentum, fast_beta, fast_weight, eff_lr, eff_wd, slow_beta=0.98, beta2=0.9):
        g = grad.double()
        self.fast = fast_beta * self.fast + (1 - fast_beta) * g
        self.slow = slow_beta * self.slow + (1 - slow_beta) * g
        u = g + momentum * (fast_weight * self.fast + (1 - fast_weight) * self.slow - g)
        for j in range(g.shape[0]):
            v = cascade64(u[j].bfloat16().double())
            lanes_are_rows = v.shape[0] >= v.shape[1]
            power = (v**2).mean(dim=1) if lanes_are_rows else (v**2).mean(dim=0)
            e = (
                power * (1 - beta2)
                if self.energy[j] is None
                else beta2 * self.energy[j] + (1 - beta2) * power
            )
            self.energy[j] = e
            gain = 1 / e.clamp_min(1e-10).sqrt()
            w = v * (gain[:, None] if lanes_are_rows else gain[None, :])
            w = w * (v.norm() / w.norm().clamp_min(1e-10))
            decay = torch.where(self.slow[j] * self.p[j] >= 0, eff_wd * eff_lr[j] * self.p[j], 0.0)
            self.p[j] = self.p[j] - decay - eff_lr[j] * w


@pytest.mark.parametrize("shape", [(3, 24, 8), (3, 8, 24), (2, 16, 16)], ids=["tall", "wide", "square"])
def test_bank_update_matches_a_float64_reference_over_several_steps(shape):
    gen = torch.Generator().manual_seed(4)
    n = shape[0]
    weight = (torch.randn(shape, generator=gen) * 0.5).bfloat16()
    grad = torch.zeros(shape, dtype=torch.bfloat16)
    bank = AnvilBank("bank", grad, weight, beta2=0.9, slow_beta=0.98, margin=1.05)
    ref = Reference64(weight)
    eff_lr = [0.05 * (j + 1) for j in range(n - 1)] + [0.0]  # the last matrix frozen
    eff_wd = 0.5
    for step in range(4):
        mom, fb, fw = (0.9, 0.9, 1.0) if step < 2 else (0.93, 0.85, 0.4385)
        g = torch.randn(shape, generator=gen).bfloat16()
        grad.copy_(g)
        before = join_master(bank.weight, bank.mantissa).double()
        bank.stage(mom, eff_wd, fb, fw, eff_lr)
        bank.update()
        ref_before = ref.p.clone()
        ref.step(g, mom, fb, fw, eff_lr, eff_wd)
        got = join_master(bank.weight, bank.mantissa).double()
        # The rails are plain fp32 arithmetic: within a few fp32 ulp of float64.
        torch.testing.assert_close(bank.velocity[1].double(), ref.slow, rtol=1e-5, atol=1e-6)
        for j in range(n):
            delta, ref_delta = got[j] - before[j], ref.p[j] - ref_before[j]
            if eff_lr[j] == 0.0:
                assert torch.equal(got[j], before[j])  # frozen: not a bit moves
                continue
            # The cascade's matmuls are bf16 (8-bit significands, 2^-9 relative per rounding) against float64
            # here; the steps agree to 0.6% in Frobenius norm at worst on these seeds, so 1% is the bound (a
            # wrong formula, lane axis or gate is off by O(1)).
            err = (delta - ref_delta).norm() / ref_delta.norm()
            assert err < 1e-2, (step, j, float(err))
        ref.p = got.clone()  # keep comparing single steps from the same master


def test_bank_reset_zeroes_state_in_place():
    grad = torch.randn(2, 4, 6).bfloat16()
    bank = AnvilBank("b", grad, torch.randn(2, 4, 6).bfloat16(), beta2=0.9, slow_beta=0.98, margin=1.05)
    bank.stage(0.9, 0.1, 0.9, 1.0, [0.1, 0.1])
    bank.update()
    before = {k: t.data_ptr() for k, t in bank.tensors().items()}
    assert bank.velocity.any() and bank.lane_energy.any()
    bank.reset()
    assert not bank.velocity.any() and not bank.lane_energy.any()
    assert not bank.mantissa.to(torch.int32).any()
    assert {k: t.data_ptr() for k, t in bank.tensors().items()} == before
    assert math.isclose(float(bank.eff_lr[0]), 0.1, rel_tol=1e-7)
