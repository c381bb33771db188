"""The fused replicated-Adam kernel against the per-parameter reference, bit for bit.

On the CPU the kernel runs in Triton's interpreter and the reference eagerly; both round every fp32 operation
once and take IEEE square roots and divisions, so they agree bitwise (no ulp tolerance is needed anywhere
here). On CUDA (tests marked gpu) the claim is bitwise equality with the compiled reference.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tests.perf.replicated_adam_cases import AdamCfg, assert_bitwise, bits
from track_1_short.optim.adam import adam_step_, adam_step_scalars
from track_1_short.perf.kernels import replicated_adam as K

# Segment sizes: single elements, a 0-D parameter (None), and a total that is not a multiple of BLOCK = 64.
SIZES = [1, 37, None, 1, 130, 5, 200, 64]
INACTIVE = {5}
CFGS = [
    AdamCfg([0.9, 0.99], lr_mul=5.0, wd_mul=0.0),
    AdamCfg([0.9, 0.95], lr_mul=0.01, wd_mul=1.0),
    AdamCfg([0.5, 0.95], lr_mul=25.0, weight_decay=0.5, wd_mul=150.0),
    AdamCfg([0.9, 0.99], lr_mul=1.0, wd_mul=1.0),
    AdamCfg([0.75, 0.95], lr_mul=70.0, weight_decay=0.5, wd_mul=10.0),
    AdamCfg([0.9, 0.99], lr_mul=1.0, wd_mul=1.0),
    AdamCfg([0.0, 0.9], lr_mul=3.0, weight_decay=2.0, wd_mul=1.0),
    AdamCfg([0.9, 0.999], lr_mul=0.25, weight_decay=5.0, wd_mul=1.0),
]
BLOCK = 64


def _case(dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [() if n is None else (n,) for n in SIZES]
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 0.3).to(dtype) for s in shapes]
    m = [torch.randn(s, generator=gen) * 0.01 for s in shapes]
    v = [torch.rand(s, generator=gen) * 1e-3 for s in shapes]
    steps = torch.randint(1, 60, (len(SIZES),), generator=gen).tolist()
    return [[t.to(device) for t in ts] for ts in (params, grads, m, v)], steps


def _table(steps, device="cpu"):
    rows = []
    for i, (cfg, t) in enumerate(zip(CFGS, steps)):
        b1, b2 = cfg.adam_betas
        step_size, eff_wd = adam_step_scalars(cfg, t)
        active = i not in INACTIVE
        rows.append(
            [b1, 1 - b1, b2, 1 - b2, cfg.eps, step_size if active else 0.0, eff_wd if active else 0.0, active]
        )
    return torch.tensor(np.array(rows, dtype=np.float64).astype(np.float32), device=device)


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _segments(device="cpu"):
    return torch.cat(
        [torch.full((1 if n is None else n,), i, dtype=torch.int32) for i, n in enumerate(SIZES)]
    ).to(device)


def _reference(params, grads, m, v, steps):
    for i, cfg in enumerate(CFGS):
        if i in INACTIVE:
            continue
        step_size, eff_wd = (torch.tensor(x, dtype=torch.float32) for x in adam_step_scalars(cfg, steps[i]))
        adam_step_(params[i], grads[i], m[i], v[i], *cfg.adam_betas, cfg.eps, step_size, eff_wd)


def _check_against_reference(dtype, device):
    (params, grads, m, v), steps = _case(dtype, seed=0, device=device)
    P, G, M, V = _flat(params), _flat(grads), _flat(m), _flat(v)
    before = [P.clone(), M.clone(), V.clone()]
    assert P.numel() % BLOCK != 0
    K.fused_adam_(P, G, M, V, _segments(device), _table(steps, device), block=BLOCK)
    _reference(params, grads, m, v, steps)
    assert_bitwise(P, _flat(params), "param")
    assert_bitwise(M, _flat(m), "exp_avg")
    assert_bitwise(V, _flat(v), "exp_avg_sq")
    # The inactive segment is skipped whole, moments included.
    seg = _segments(device)
    for name, now, then in zip(("param", "exp_avg", "exp_avg_sq"), (P, M, V), before):
        assert torch.equal(bits(now[seg == 5]), bits(then[seg == 5])), f"inactive {name} changed"
    assert not torch.equal(bits(P), bits(before[0])), "the step moved nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference_bitwise_on_the_interpreter(dtype):
    _check_against_reference(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_compiled_reference_bitwise_on_cuda(dtype):
    _check_against_reference(dtype, "cuda")


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, K._round_to_bf16_bits(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def _round_with_kernel(x):
    out = torch.empty(x.numel(), dtype=torch.int16, device=x.device)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def _rounding_inputs():
    gen = torch.Generator().manual_seed(5)
    high = torch.randint(0, 1 << 16, (4096,), generator=gen, dtype=torch.int64)
    # Exact ties (low half 0x8000) with even and odd kept halves, one below and one above each tie.
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF]).repeat(4096 // 5 + 1)[:4096]
    tie_bits = (high << 16) | low
    special = torch.tensor([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x00000001, 0x80008000, 0])
    x = torch.cat([tie_bits, special]).to(torch.int64)
    x = torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32).view(torch.float32)
    return torch.cat([x[~torch.isnan(x)], torch.randn(4096, generator=gen) * 1e3])


def _bound_against_jit(dtype, device, steps):
    """Run ``steps`` Adam steps twice from the same buffers: bound replays, and JIT launches; both results."""
    (params, grads, m, v), t = _case(dtype, seed=4, device=device)
    buffers = [_flat(params), _flat(grads), _flat(m), _flat(v), _segments(device), _table(t, device)]
    copies = [b.clone() for b in buffers]
    launch = K.bind_fused_adam(*buffers, block=BLOCK)
    for _ in range(steps):
        launch()
        K.launch_fused_adam(*copies, block=BLOCK)
    return launch, buffers, copies


def _assert_same_buffers(buffers, copies):
    for what, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), buffers, copies):
        assert_bitwise(a, b, what)


def test_a_bound_launch_under_the_interpreter_takes_the_jit_path_every_call_with_the_same_bits():
    launch, buffers, copies = _bound_against_jit(torch.bfloat16, "cpu", steps=3)
    assert launch.jit_launches == 3  # the interpreter returns no compiled kernel to bind
    _assert_same_buffers(buffers, copies)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_bound_launch_replays_the_compiled_kernel_with_the_jits_bits(dtype):
    launch, buffers, copies = _bound_against_jit(dtype, "cuda", steps=5)
    assert launch.jit_launches == 1 and launch._runner is not None  # four replays bypassed the JIT
    _assert_same_buffers(buffers, copies)


class _FakeCompiled:
    """Triton's CompiledKernel contract as BoundLaunch uses it: ``compiled[grid]`` indexes grid[0], grid[1]
    and grid[2], and its runner takes every parameter in signature order, constexprs included."""

    packed_metadata = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        dims = (grid[0], grid[1], grid[2])
        return lambda *values: self.log.append(("replay", dims, values))


class _FakeJit:
    arg_names = ["x_ptr", "n", "FLAG", "BLOCK"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _FakeCompiled(self.log)

        return launch


def test_a_bound_launch_compiles_once_then_replays_with_a_3d_grid_and_every_argument_in_order():
    kernel = _FakeJit()
    launch = K.BoundLaunch(kernel, (5,), ("x", 7), {"BLOCK": 64, "FLAG": True}, {"num_warps": 4})
    for _ in range(3):
        launch()
    assert kernel.log[0] == ("jit", (5,), ("x", 7), {"BLOCK": 64, "FLAG": True, "num_warps": 4})
    assert kernel.log[1:] == [("replay", (5, 1, 1), ("x", 7, True, 64))] * 2
    assert launch.jit_launches == 1


def test_a_bound_launch_with_arguments_that_do_not_fit_the_kernel_is_refused():
    (params, grads, m, v), t = _case(torch.float32, seed=4)
    args = (_flat(params), _flat(grads), _flat(m), _flat(v), _segments(), _table(t), 7)
    with pytest.raises(TypeError, match="do not match its parameters"):
        K.BoundLaunch(K._fused_adam_kernel, (1,), args, {"PARAM_BF16": False, "BLOCK": BLOCK}, {})


def test_bf16_store_rounds_to_nearest_even_like_torch():
    x = _rounding_inputs()
    assert_bitwise(_round_with_kernel(x), x.to(torch.bfloat16).view(torch.int16), "bf16 rounding")


def test_bf16_store_turns_nan_into_the_canonical_gpu_nan():
    x = torch.tensor([float("nan"), -float("nan"), 1.0])
    one = torch.tensor(1.0).to(torch.bfloat16).view(torch.int16).item()
    assert _round_with_kernel(x).tolist() == [0x7FFF, 0x7FFF, one]


@pytest.mark.gpu
def test_bf16_store_rounds_like_the_gpu_conversion():
    x = _rounding_inputs().cuda()
    assert_bitwise(_round_with_kernel(x), x.to(torch.bfloat16).view(torch.int16), "bf16 rounding on CUDA")


def _valid_buffers():
    (params, grads, m, v), steps = _case(torch.float32, seed=3)
    return [_flat(params), _flat(grads), _flat(m), _flat(v), _segments(), _table(steps)]


@pytest.mark.parametrize(
    "corrupt, error, match",
    [
        (lambda b: b.__setitem__(2, b[2].double()), TypeError, "exp_avg"),
        (lambda b: b.__setitem__(1, b[1].to(torch.bfloat16)), TypeError, "grad"),
        (lambda b: b.__setitem__(3, b[3][:-1]), ValueError, "exp_avg_sq"),
        (lambda b: b.__setitem__(0, b[0].half()), TypeError, "param"),
        (lambda b: b.__setitem__(4, b[4].long()), TypeError, "segment"),
        (lambda b: b.__setitem__(5, b[5][:, :7].contiguous()), ValueError, "scalars"),
        (lambda b: b.__setitem__(0, torch.stack([b[0], b[0]], 1).reshape(-1)[::2]), ValueError, "param"),
    ],
)
def test_bad_buffers_raise_before_the_kernel_touches_anything(corrupt, error, match):
    buffers = _valid_buffers()
    corrupt(buffers)
    snapshot = [t.clone() for t in buffers]
    with pytest.raises(error, match=match):
        K.fused_adam_(*buffers, block=BLOCK)
    assert all(torch.equal(a, b) for a, b in zip(buffers, snapshot))


def test_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        K.fused_adam_(*_valid_buffers(), block=96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_cautious_decay_is_strict_where_the_update_is_exactly_zero(dtype):
    # As tests/optim/test_adam.py checks the reference: zero gradient and first moment make u = 0 exactly, so
    # no decay may reach these nonzero parameters; segment 1 (gradients of p's sign) is the decaying control.
    p = torch.tensor([1.5, -0.75, 3.0, -2.0, 1.5, -0.75]).to(dtype)
    g = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0]).to(dtype)
    segment = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.int32)
    row = [0.9, 1 - 0.9, 0.99, 1 - 0.99, 1e-10, 1e-2, 0.1, 1.0]
    no_decay = row[:6] + [0.0, 1.0]
    before = p.clone()
    K.fused_adam_(p, g, torch.zeros(6), torch.full((6,), 1e-4), segment, torch.tensor([row, row]), block=16)
    assert_bitwise(p[:4], before[:4], "param with u = 0")
    control = before.clone()
    table = torch.tensor([row, no_decay])
    K.fused_adam_(control, g, torch.zeros(6), torch.full((6,), 1e-4), segment, table, block=16)
    assert ((p[4:].float() - control[4:].float()).abs() > 0).all()  # decay applied where u * p > 0


CANARY = 5  # elements after each buffer: more than the one-element overrun a wrong tail mask makes


def _with_canaries(t: torch.Tensor, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """(view of the first t.numel() elements of a longer buffer holding t, the whole buffer)."""
    whole = torch.empty(t.numel() + CANARY, dtype=t.dtype)
    whole[: t.numel()] = t
    whole[t.numel() :] = fill
    return whole[: t.numel()], whole


def _canary_group(dtype, seed):
    (params, grads, m, v), steps = _case(dtype, seed=seed)
    # Canary segment ids name an active row (0): an element read past the end would be updated and stored.
    fills = (3.0, 1.0, 0.5, 0.25, 0)
    pairs = [
        _with_canaries(t, f)
        for t, f in zip((_flat(params), _flat(grads), _flat(m), _flat(v), _segments()), fills)
    ]
    return tuple(view for view, _ in pairs), [whole for _, whole in pairs], steps


def test_kernel_never_touches_memory_past_its_buffers():
    group0, wholes0, steps = _canary_group(torch.bfloat16, seed=6)
    group1, wholes1, _ = _canary_group(torch.float32, seed=7)
    table_view, table_whole = _with_canaries(_table(steps).reshape(-1), 1.0)
    table = table_view.view(len(SIZES), K.ROW_STRIDE)
    wholes = wholes0 + wholes1 + [table_whole]
    tails = [w[-CANARY:].clone() for w in wholes]
    assert group0[0].numel() % BLOCK != 0  # the last block is partial: its mask decides
    K.fused_adam_(*group0, table, block=BLOCK)
    K.fused_adam_(*group1, table, block=BLOCK)
    assert not torch.equal(bits(group0[0]), bits(_flat(_case(torch.bfloat16, seed=6)[0][0])))  # it ran
    for k, (whole, tail) in enumerate(zip(wholes, tails)):
        assert_bitwise(whole[-CANARY:], tail, f"canary after buffer {k}")
