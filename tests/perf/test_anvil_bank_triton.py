"""optim.bank_update=triton (track_1_short/perf/kernels/anvil_bank.py, run by optim/anvil_bank.py): the
update's phases outside the cascade as Triton kernels, against the eager update they replace.

Kernel A (rails, lookahead) and kernel C (master step, given the scale) round every operation as eager does,
so they are compared bit for bit. Kernel B (lane power) sums in its own order, so the lane power, the lane
energy and the step agree within the fp32 summation bounds derived in :func:`scale_bound`. On the CPU the
kernels run in Triton's interpreter; the ``gpu`` tests run them compiled at the track-1 bank shapes.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.optim import fake_model as fm
from tests.optim.test_anvil import lr_multiplier, snapshot
from tests.perf.compile_sm90 import compile_outside_the_interpreter
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig
from track_1_short.optim.anvil_bank import (
    AnvilBank,
    bank_update_,
    join_master,
    scalar_row,
    sign_gated_step_,
    triton_bank_update_,
    twin_rails_,
)
from track_1_short.perf.kernels import anvil_bank as kernels

gpu = pytest.mark.gpu


def twin_banks(shape, device, seed, update_fn, gram="bmm"):
    """(generator, eager bank, bank stepping through ``update_fn``): the same random weights, zero gradients,
    the record's constants; the generator goes on to draw the gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(shape, generator=gen, device=device) * 0.02).bfloat16()
    eager = AnvilBank("b", torch.zeros_like(weight), weight.clone(), 0.9, 0.98, 1.05, gram=gram)
    other = AnvilBank(
        "b", torch.zeros_like(weight), weight.clone(), 0.9, 0.98, 1.05, update_fn=update_fn, gram=gram
    )
    return gen, eager, other


U = 2.0**-24  # unit roundoff of fp32
STEPS = 6
ENGAGE = 3

# Tall (lanes are rows) and wide (lanes are columns); 3 moving matrices, then a frozen one (a gradient, eff_lr
# 0) and a pad (zero gradient, eff_lr 0).
SHAPES = {"tall": (5, 40, 24), "wide": (5, 24, 40)}


def red_dim_of(shape) -> int:
    return -1 if shape[1] >= shape[2] else -2


def scale_bound(length: int, lanes: int, steps: int = 1) -> float:
    """Relative bound between eager's and the kernels' equaliser scale (gain * pre / post) after ``steps``
    steps from the same state, when only the lane power's summation order differs.

    Each lane power is a mean of ``length`` squares: two fp32 sums of the same non-negative terms in different
    orders are each within (length - 1) u of the exact sum, so they differ by at most 2 length u (with the
    division's rounding). Everything downstream is sums, products, quotients, square roots and reciprocal
    square roots of non-negative values, computed by the same torch ops on both sides: a product or quotient
    adds its operands' relative differences, a square root halves them, each rounding adds u on each side, and
    a sum over the lanes of slightly different terms is within (lanes - 1) u of its exact value on each side.
    The energy EMA averages relative differences (non-negative terms), adding its roundings each step."""
    power = 2 * length * U
    energy = power + 2 * U * steps
    gain = energy / 2 + 2 * U
    lane_sum = 2 * lanes * U
    pre = (power + lane_sum) / 2 + 4 * U
    post = (power + 2 * gain + lane_sum + 2 * U) / 2 + 4 * U
    return gain + pre + post + 4 * U


def lane_geometry(shape) -> tuple[int, int]:
    """(length, lanes) of a bank of ``shape``: lanes along the longer side."""
    _, rows, cols = shape
    return (cols, rows) if red_dim_of(shape) == -1 else (rows, cols)


def make_scalars(chunk, s, device="cpu", eff_lr=None):
    """Step ``s``'s scalars; rails engage at ENGAGE. Weights cover both forms of torch.lerp (|w| < 0.5 and
    not): 1 - fast_beta = 0.15 and 0.6, fast_weight 1 and 0.4385, momentum 0.95 and 0.3."""
    engaged = s >= ENGAGE
    momentum = 0.3 if s == 1 else 0.95
    fast_beta = 0.85 if engaged else (0.4 if s == 2 else 0.9 + 0.01 * s)
    fast_weight = 0.4385 if engaged else 1.0
    if eff_lr is None:
        eff_lr = [0.023 * (1.0 + 0.5 * j) * (1.0 - 0.1 * s) for j in range(chunk - 2)] + [0.0, 0.0]
    row = scalar_row(momentum, 0.023 * 2.25 * (1.0 - 0.1 * s), fast_beta, fast_weight, eff_lr)
    return torch.tensor(row, dtype=torch.float32, device=device)


def gradient(shape, gen, device="cpu"):
    g = torch.randn(shape, generator=gen, device=device).bfloat16()
    g[-1] = 0  # the pad
    return g


@pytest.mark.parametrize("kind", list(SHAPES))
def test_rails_kernel_is_bitwise_the_eager_rails_and_lookahead_over_consecutive_steps(kind):
    # Kernel A computes each lerp as torch does (one fused multiply-add, the same weights in fp32) and rounds
    # u to nearest even: velocity and u must not differ by a bit, step after step.
    shape = SHAPES[kind]
    gen = torch.Generator().manual_seed(1)
    eager_vel = torch.zeros((2, *shape))
    kernel_vel = torch.zeros((2, *shape))
    for s in range(STEPS):
        g = gradient(shape, gen)
        scalars = make_scalars(shape[0], s)
        momentum, _, fast_beta, fast_weight = scalars[:4].unbind()
        want = twin_rails_(eager_vel, g.float(), momentum, fast_beta, fast_weight, 0.98).bfloat16()
        got = kernels.rails_(g, kernel_vel, scalars, 0.98)
        assert torch.equal(kernel_vel.view(torch.int32), eager_vel.view(torch.int32)), (kind, s)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (kind, s)
    assert eager_vel.abs().sum() > 0 and torch.equal(eager_vel[:, -1], torch.zeros_like(eager_vel[:, -1]))


@pytest.mark.parametrize("kind", list(SHAPES))
def test_lane_power_kernel_agrees_with_the_eager_mean_square_within_summation_bounds(kind):
    # Two fp32 sums of the same `length` non-negative squares in different orders: each within (length - 1) u
    # of the exact sum, then one division each (scale_bound's first term).
    shape = SHAPES[kind]
    red_dim = red_dim_of(shape)
    length, _ = lane_geometry(shape)
    v = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    v[-1] = 0
    want = v.square().mean(dim=red_dim, keepdim=True)
    got = kernels.lane_power(v, red_dim)
    assert got.shape == want.shape
    assert torch.all((got - want).abs() <= 2 * length * U * want), (got - want).abs().max()
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


@pytest.mark.parametrize("kind", list(SHAPES))
def test_master_step_kernel_is_bitwise_eager_given_the_same_scale(kind):
    # Kernel C's operations and roundings are sign_gated_step_'s (no contraction): the same scale gives the
    # same bits. Slow-rail signs are mixed, with zeros (aligned); the last two matrices have eff_lr 0.
    shape = SHAPES[kind]
    red_dim = red_dim_of(shape)
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(shape, generator=gen) * 0.02).bfloat16()
    mantissa = torch.randint(0, 1 << 16, shape, generator=gen, dtype=torch.int32).to(torch.uint16)
    v = torch.randn(shape, generator=gen)
    slow = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.1)
    scale = torch.rand(kernels.lane_power(v, red_dim).shape, generator=gen) + 0.5
    scalars = make_scalars(shape[0], 0)
    eff_lr = scalars[4:].view(-1, 1, 1)
    w0, m0 = weight.clone(), mantissa.clone()
    w_eager, m_eager = weight.clone(), mantissa.clone()
    sign_gated_step_(w_eager, m_eager, v * scale, slow, eff_lr, scalars[1])
    kernels.master_step_(weight, mantissa, v, scale, slow, scalars, red_dim)
    assert torch.equal(weight.view(torch.int16), w_eager.view(torch.int16))
    assert torch.equal(mantissa, m_eager)
    assert not torch.equal(mantissa[0], m0[0])  # the moving matrices moved
    assert torch.equal(weight[-2:].view(torch.int16), w0[-2:].view(torch.int16))
    assert torch.equal(mantissa[-2:], m0[-2:])


def bf16_input_against_fp32_input(shape, device) -> tuple[float, bool]:
    """Kernels B and C fed the cascade's bf16 output against the same kernels fed its fp32 widening (the copy
    the triton update no longer makes): (the lane powers' largest relative difference, master step bitwise).
    """
    red_dim = red_dim_of(shape)
    gen = torch.Generator().manual_seed(4)
    v = (torch.randn(shape, generator=gen) * 3).bfloat16().to(device)
    v[-1] = 0
    power = kernels.lane_power(v, red_dim)
    wide = kernels.lane_power(v.float(), red_dim)
    assert power.dtype == torch.float32 and bool((wide[-1] == 0).all()) and bool((power[-1] == 0).all())
    rel = ((power.double() - wide.double()).abs() / wide.double().clamp_min(1e-300)).max().item()
    weight = (torch.randn(shape, generator=gen) * 0.02).bfloat16().to(device)
    mantissa = torch.randint(0, 1 << 16, shape, generator=gen, dtype=torch.int32).to(torch.uint16).to(device)
    slow = torch.randn(shape, generator=gen).to(device)
    scale = (torch.rand(power.shape, generator=gen) + 0.5).to(device)
    scalars = make_scalars(shape[0], 0, device)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        w, m = weight.clone(), mantissa.clone()
        kernels.master_step_(w, m, v.to(dtype), scale, slow, scalars, red_dim)
        out[dtype] = (w.view(torch.int16), m.view(torch.int16))
    same_step = all(torch.equal(a, b) for a, b in zip(out[torch.bfloat16], out[torch.float32]))
    return rel, same_step


@pytest.mark.parametrize("kind", list(SHAPES))
def test_kernels_read_the_bf16_cascade_output_as_its_exact_fp32_widening(kind):
    # The interpreter sums in one order whatever the element width: the lane powers are equal too.
    assert bf16_input_against_fp32_input(SHAPES[kind], "cpu") == (0.0, True)
    with pytest.raises(ValueError, match="lane_power: v is torch.float16; the kernel reads"):
        kernels.lane_power(torch.zeros(SHAPES[kind], dtype=torch.float16), red_dim_of(SHAPES[kind]))


def step_pair(shape, device, steps, seed=0, gram="bmm"):
    """Eager and Triton banks stepped side by side on the same gradients; before each step the Triton bank
    takes the eager one's master and lane energy (the rails are compared without that: they must stay
    bitwise). Returns per step: (each moving matrix's relative step error, the bound's reference), the lane
    energy's largest relative error, rails bitwise, eff_lr-0 matrices bitwise still."""
    n = shape[0]
    gen, eager, triton_ = twin_banks(shape, device, seed, triton_bank_update_, gram)
    out = []
    for s in range(steps):
        for role in ("weight", "lane_energy", "mantissa"):
            getattr(triton_, role).copy_(getattr(eager, role))
        g = gradient(shape, gen, device)
        before = join_master(eager.weight, eager.mantissa)
        w0, m0 = eager.weight.clone(), eager.mantissa.clone()
        row = make_scalars(n, s, device).tolist()
        for bank in (eager, triton_):
            bank.grad.copy_(g)
            bank.stage(*row[:4], row[4:])
            bank.update()
        de = (join_master(eager.weight, eager.mantissa) - before).double()
        dt = (join_master(triton_.weight, triton_.mantissa) - before).double()
        errs = [float((dt[j] - de[j]).norm() / de[j].norm()) for j in range(n - 2)]
        still = all(
            torch.equal(b.weight[-2:].view(torch.int16), w0[-2:].view(torch.int16))
            and torch.equal(b.mantissa[-2:], m0[-2:])
            for b in (eager, triton_)
        )
        e, t = eager.lane_energy.double(), triton_.lane_energy.double()
        zero = e == 0
        energy_err = float(((t - e).abs() / e.clamp_min(1e-300)).max())
        energy_zero_same = torch.equal(t[zero], e[zero])
        rails = torch.equal(triton_.velocity.view(torch.int32), eager.velocity.view(torch.int32))
        out.append((errs, energy_err, energy_zero_same, rails, still))
    return out


@pytest.mark.parametrize("kind,gram", [("tall", "bmm"), ("wide", "bmm"), ("wide", "squared")])
def test_triton_bank_update_agrees_with_eager_over_several_steps(kind, gram):
    # The step's difference comes only through the scale (the cascade sees bitwise the same u, kernel C rounds
    # as eager), so each matrix's step moves by at most the scale's bound relative to its update term; the
    # decay term is the same in both (0.05 * eff_lr * |p|, far below the update term), hence the factor 2.
    # The masters themselves are rounded to fp32 in both (half an ulp of a master ~0.02 against a step
    # ~1e-3 an entry): 2^-24 * 20 more. The eff_lr-0 matrices must not move at all.
    shape = SHAPES[kind]
    length, lanes = lane_geometry(shape)
    bound = 2 * scale_bound(length, lanes) + 20 * U
    # gram: the cascade's Gram route (optim.cascade_gram), the same on both sides; the kernels work with both.
    steps = step_pair(shape, "cpu", STEPS, gram=gram)
    for s, (errs, energy_err, energy_zero_same, rails, still) in enumerate(steps):
        assert rails, (kind, s)
        assert max(errs) <= bound, (kind, s, errs, bound)
        assert energy_err <= scale_bound(length, lanes) and energy_zero_same, (kind, s, energy_err)
        assert still, (kind, s)


def build(bank_update: str, device="cpu"):
    named = fm.make_params(device=device)
    cfg = OptimConfig(replicated_impl="reference", rail_engage_step=ENGAGE, bank_update=bank_update)
    return named, AnvilAndAdam(named, fm.param_table(), fm.SCATTER_ORDER, fm.WORK_ORDER, cfg)


def train(named, opt, steps) -> None:
    for s in steps:
        opt.set_schedule(lr_multiplier(s), 0.85 + 0.01 * (s % 8), s)
        fm.accumulate(named, fm.rank_grads(s))
        opt.step(do_adam=s % 2 == 1)


def test_the_switch_selects_the_kernels_and_is_validated():
    named, opt = build("triton")
    assert opt.banks and all(b.update_fn is triton_bank_update_ for b in opt.banks.values())
    assert all(b.update_fn is bank_update_ for b in build("eager")[1].banks.values())
    with pytest.raises(ValueError, match=r"optim\.bank_update='fused'.*'triton'"):
        OptimConfig(bank_update="fused")


def test_without_cuda_or_the_interpreter_the_switch_is_refused_when_the_optimizer_is_built(monkeypatch):
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match=r"optim\.bank_update=triton.*Use optim\.bank_update=eager"):
        build("triton")


def test_misshapen_operands_are_refused_with_the_role_named():
    bank = AnvilBank("b", torch.zeros(2, 8, 4).bfloat16(), torch.zeros(2, 8, 4).bfloat16(), 0.9, 0.98, 1.05)
    args = [bank.grad, bank.weight, bank.velocity, bank.lane_energy, bank.mantissa, bank.scalars]
    args[2] = bank.velocity.transpose(-1, -2)
    with pytest.raises(ValueError, match="velocity .*contiguous"):
        triton_bank_update_(*args, **bank.constants)


def test_the_optimizer_trains_like_the_eager_one_within_the_bound():
    # Both optimizers see the same gradients and scalars. Adam's parameters and the rails are bitwise equal;
    # each bank's master differs from eager by at most the per-step bound times the sum of its step sizes
    # (the differences add up; nothing the kernels change feeds the cascade, whose input u stays bitwise).
    runs = {mode: build(mode) for mode in ("eager", "triton")}
    masters = {
        mode: [{k: join_master(b.weight, b.mantissa).double() for k, b in opt.banks.items()}]
        for mode, (_, opt) in runs.items()
    }
    for s in range(STEPS):
        for mode, (named, opt) in runs.items():
            train(named, opt, [s])
            masters[mode].append(
                {k: join_master(b.weight, b.mantissa).double() for k, b in opt.banks.items()}
            )
    (en, eo), (tn, to) = runs["eager"], runs["triton"]
    pe, pt = snapshot(en), snapshot(tn)
    for label in pe:
        if label not in eo.banks:
            assert torch.equal(pe[label], pt[label]), label
    for label, bank in eo.banks.items():
        assert torch.equal(bank.velocity, to.banks[label].velocity), label
        length, lanes = lane_geometry(tuple(bank.grad.shape))
        bound = 2 * scale_bound(length, lanes, STEPS) + 20 * U
        path = sum(
            float((b[label] - a[label]).norm()) for a, b in zip(masters["eager"], masters["eager"][1:])
        )
        diff = float((masters["triton"][-1][label] - masters["eager"][-1][label]).norm())
        assert diff <= bound * path, (label, diff, path, bound)
        assert path > 0
        # The energy EMA averages the lane powers' relative differences and adds its roundings each step.
        e, t = bank.lane_energy.double(), to.banks[label].lane_energy.double()
        assert torch.all((t - e).abs() <= (2 * length * U + 2 * STEPS * U) * e), label
    frozen = fm.param_table()["qk_bank"]["matrix_lr_mul"].index(0.0)
    start = {p.label: p.detach() for _, p in fm.make_params()}
    assert torch.equal(pe["qk_bank"][frozen], start["qk_bank"][frozen])
    assert torch.equal(pt["qk_bank"][frozen], pe["qk_bank"][frozen])


# The track-1 banks at world size 1 (perf/bench_optimizer.py's TRACK1_BANKS), 2 of each marked eff_lr 0.
TRACK1 = {"qk_bank": (48, 256, 768), "vo_bank": (16, 768, 768), "mlp_bank": (24, 2816, 768)}


@gpu
@pytest.mark.parametrize("label", list(TRACK1))
def test_on_cuda_kernel_c_reads_the_bf16_cascade_output_bitwise_and_b_within_its_summation_bound(label):
    # The master step reads the same values either way: bitwise. The lane power's tl.sum reduces in an order
    # set by the compiled layout, which follows the width of the loaded element (16-byte vectors hold 8 bf16
    # or 4 fp32), so the two sum the same squares in different orders: within 2 (length - 1) u of each other
    # (each within (length - 1) u of the exact sum of non-negative terms), plus the division's rounding.
    shape = TRACK1[label]
    length = shape[2] if red_dim_of(shape) == -1 else shape[1]
    rel, same_step = bf16_input_against_fp32_input(shape, "cuda")
    assert same_step, label
    assert rel <= 2 * length * U, (label, rel, 2 * length * U)


@gpu
@pytest.mark.parametrize("label", list(TRACK1))
def test_on_cuda_the_kernels_agree_with_eager_at_the_track1_bank_shapes(label):
    # On the GPU kernel A uses the hardware fused multiply-add, which is what torch's CUDA lerp compiles to
    # (nvcc contracts its multiply-add), so the rails stay bitwise; u, and so the cascade's output, too. The
    # step and lane energies differ only through the lane power's summation order: the same bounds as on
    # the CPU, at these lengths.
    shape = TRACK1[label]
    length, lanes = lane_geometry(shape)
    bound = 2 * scale_bound(length, lanes) + 20 * U
    for s, (errs, energy_err, energy_zero_same, rails, still) in enumerate(step_pair(shape, "cuda", 4)):
        assert rails, (label, s)
        assert max(errs) <= bound, (label, s, max(errs), bound)
        assert energy_err <= scale_bound(length, lanes) and energy_zero_same, (label, s, energy_err)
        assert still, (label, s)


_COMPILE_FOR_H200 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from track_1_short.optim.bank_layout import N_SCALARS
    from track_1_short.perf.kernels import anvil_bank as k

    kernels = [
        (k._rails_kernel,
         {"grad_ptr": "*i16", "velocity_ptr": "*fp32", "u_ptr": "*i16", "scalars_ptr": "*fp32", "n": "i32",
          "slow_weight": "fp32"},
         [{"FMA_VIA_FP64": False, "BLOCK": k.ELEMENTWISE_BLOCK}], k.ELEMENTWISE_WARPS),
        (k._lane_power_kernel,
         {"power_ptr": "*fp32", "lanes": "i32", "length": "i32", "matrix_stride": "i32",
          "lane_stride": "i32", "red_stride": "i32"},
         [{"V_BF16": bf16, "BLOCK_LANES": k.LANE_BLOCK, "BLOCK_R": k.REDUCE_BLOCK} for bf16 in (True, False)],
         4),
        (k._master_step_kernel,
         {"scale_ptr": "*fp32", "slow_ptr": "*fp32", "weight_ptr": "*i16",
          "mantissa_ptr": "*i16", "scalars_ptr": "*fp32", "n": "i32", "rows": "i32", "cols": "i32",
          "lanes": "i32"},
         [{"LANES_ARE_ROWS": rows, "N_SCALARS": N_SCALARS, "V_BF16": bf16, "BLOCK": k.ELEMENTWISE_BLOCK}
          for rows in (True, False) for bf16 in (True, False)], k.ELEMENTWISE_WARPS),
    ]
    count = 0
    for fn, sig, variants, warps in kernels:
        for consts in variants:
            args = dict(sig)
            if "V_BF16" in consts:  # the cascade output as bf16 bits (the update's route) or fp32
                args = {"v_ptr": "*i16" if consts["V_BF16"] else "*fp32", **sig}
            # Every parameter of the kernel is given: one missing would compile as None, silently.
            missing = set(fn.arg_names) - set(args) - set(consts)
            assert not missing, (fn.__name__, missing)
            signature = {**args, **dict.fromkeys(consts, "constexpr")}
            src = ASTSource(fn=fn, signature=signature, constexprs=consts)
            opts = {"num_warps": warps, "enable_fp_fusion": False}
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            assert compiled.asm["cubin"], fn.__name__
            count += 1
    print(f"compiled {count} kernels")
    """
)


def test_the_kernels_compile_for_the_h200_on_this_machine():
    # The interpreter runs the FMA_VIA_FP64 variant of the rails; the GPU's (tl.fma) and the other two kernels
    # are compiled here to sm_90 cubins with the wheel's own ptxas, as the trainer launches them.
    proc = compile_outside_the_interpreter(_COMPILE_FOR_H200)
    assert proc.returncode == 0 and "compiled 7 kernels" in proc.stdout, proc.stderr[-3000:]
