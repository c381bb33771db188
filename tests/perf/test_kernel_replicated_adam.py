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


def test_two_group_launch_equals_one_launch_per_group_and_leaves_gradients_alone():
    cases = [_case(torch.bfloat16, seed=1), _case(torch.float32, seed=2)]
    steps = cases[0][1]
    table = _table(steps)
    seg = _segments()
    singles, pairs = [], []
    for (params, grads, m, v), _ in cases:
        singles.append([_flat(params), _flat(grads), _flat(m), _flat(v), seg])
        pairs.append([t.clone() for t in singles[-1]])
    for group in singles:
        K.fused_adam_(*group, table, block=BLOCK)
    grads = [pair[1].clone() for pair in pairs]
    K.fused_adam_groups_([tuple(g) for g in pairs], table, block=BLOCK)
    for single, pair, grad in zip(singles, pairs, grads):
        for what, a, b in zip(
            ("param", "exp_avg", "exp_avg_sq"), (single[0], single[2], single[3]), (pair[0], pair[2], pair[3])
        ):
            assert_bitwise(a, b, what)
        assert_bitwise(pair[1], grad, "gradients after the launch")  # read, never written


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


def test_groups_launch_takes_one_or_two_groups():
    b = _valid_buffers()
    with pytest.raises(ValueError, match="one or two groups"):
        K.fused_adam_groups_([tuple(b[:5])] * 3, b[5])


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


@pytest.mark.parametrize("launch", ["one group", "two groups"])
def test_kernel_never_touches_memory_past_its_buffers(launch):
    group0, wholes0, steps = _canary_group(torch.bfloat16, seed=6)
    group1, wholes1, _ = _canary_group(torch.float32, seed=7)
    table_view, table_whole = _with_canaries(_table(steps).reshape(-1), 1.0)
    table = table_view.view(len(SIZES), K.ROW_STRIDE)
    wholes = wholes0 + wholes1 + [table_whole]
    tails = [w[-CANARY:].clone() for w in wholes]
    assert group0[0].numel() % BLOCK != 0  # the last block is partial: its mask decides
    if launch == "one group":
        K.fused_adam_(*group0, table, block=BLOCK)
        K.fused_adam_(*group1, table, block=BLOCK)
    else:
        K.fused_adam_groups_([group0, group1], table, block=BLOCK)
    assert not torch.equal(bits(group0[0]), bits(_flat(_case(torch.bfloat16, seed=6)[0][0])))  # it ran
    for k, (whole, tail) in enumerate(zip(wholes, tails)):
        assert_bitwise(whole[-CANARY:], tail, f"canary after buffer {k}")


# ---- the gradient gather ----------------------------------------------------------------------------------


def _gather_case(device="cpu"):
    """Two flat buffers (bf16 segments 0, 2, 3; fp32 segments 1, 4), one parameter without a gradient (3), and
    bf16 gradients holding every odd bit pattern (NaN payloads, -0.0, subnormals, infinities). The gradients
    come back too: the addresses are only integers, and the caller must keep what they point to alive."""
    gen = torch.Generator().manual_seed(40)
    sizes = {0: 37, 1: 1, 2: 130, 3: 5, 4: 64}
    grads = {
        0: torch.randint(-(2**15), 2**15, (37,), generator=gen, dtype=torch.int16).view(torch.bfloat16),
        1: torch.tensor([-0.0]),
        2: torch.randint(-(2**15), 2**15, (130,), generator=gen, dtype=torch.int16).view(torch.bfloat16),
        3: None,
        4: torch.randn(64, generator=gen),
    }
    grads = {i: g.to(device) if g is not None else None for i, g in grads.items()}
    members = {torch.bfloat16: [0, 2, 3], torch.float32: [1, 4]}
    groups, starts = [], [0] * len(sizes)
    for dtype, indices in members.items():
        offset, segment = 0, []
        for i in indices:
            starts[i] = offset
            offset += sizes[i]
            segment += [i] * sizes[i]
        flat = torch.full((offset,), float("nan"), dtype=dtype, device=device)
        groups.append((flat, torch.tensor(segment, dtype=torch.int32, device=device)))
    addresses = torch.tensor(
        [0 if grads[i] is None else grads[i].data_ptr() for i in range(5)], device=device
    )
    starts = torch.tensor(starts, dtype=torch.int64, device=device)
    expected = [
        torch.cat(
            [
                grads[i] if grads[i] is not None else torch.zeros(sizes[i], dtype=d, device=device)
                for i in indices
            ]
        )
        for d, indices in members.items()
    ]
    return groups, addresses, starts, expected, grads


def test_gather_copies_every_gradient_bit_for_bit_and_zeroes_a_missing_one_in_one_launch():
    groups, addresses, starts, expected, _grads = _gather_case()
    K.gather_grads_(groups, addresses, starts, block=BLOCK)
    for (flat, _), want in zip(groups, expected):
        assert torch.equal(bits(flat), bits(want))


@pytest.mark.gpu
def test_gather_copies_every_gradient_bit_for_bit_on_cuda():
    groups, addresses, starts, expected, _grads = _gather_case("cuda")
    K.gather_grads_(groups, addresses, starts)
    torch.cuda.synchronize()
    for (flat, _), want in zip(groups, expected):
        assert torch.equal(bits(flat), bits(want))


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda g, a, s: ([(g[0][0].view(1, -1), g[0][1])], a, s), "contiguous 1-D bf16 or fp32"),
        (lambda g, a, s: ([(g[0][0], g[0][1].long())], a, s), "segment must be a contiguous int32"),
        (lambda g, a, s: (g, a.int(), s), "addresses must be a 1-D int64"),
        (lambda g, a, s: (g, a, s[:3]), "one entry per parameter"),
        (lambda g, a, s: (g * 2, a, s), "one or two groups"),
    ],
)
def test_gather_refuses_bad_buffers_before_it_writes(corrupt, match):
    groups, addresses, starts, _, _grads = _gather_case()
    before = [bits(flat).clone() for flat, _ in groups]
    with pytest.raises(ValueError, match=match):
        K.gather_grads_(*corrupt(groups, addresses, starts))
    assert all(torch.equal(bits(flat), b) for (flat, _), b in zip(groups, before))


# ---- the one-launch device step ---------------------------------------------------------------------------


def _device_step_case(device="cpu"):
    """The eight parameters of CFGS split by dtype (even: bf16, odd: fp32) into two flat groups indexed by one
    table, their gradients where autograd would leave them (INACTIVE's missing), and device_step_'s inputs."""
    from track_1_short.optim.adam import first_moment_correction, second_moment_correction
    from track_1_short.perf.replicated_adam_device import correction_table

    (params_bf16, grads_bf16, m_bf16, v_bf16), steps = _case(torch.bfloat16, seed=3)
    (params_fp32, grads_fp32, m_fp32, v_fp32), _ = _case(torch.float32, seed=4)
    n = len(SIZES)
    members = {torch.bfloat16: range(0, n, 2), torch.float32: range(1, n, 2)}
    source = {
        torch.bfloat16: (params_bf16, m_bf16, v_bf16, grads_bf16),
        torch.float32: (params_fp32, m_fp32, v_fp32, grads_fp32),
    }
    groups, starts, grads = [], [0] * n, {}
    for dtype, indices in members.items():
        params, m, v, g = source[dtype]
        offset, segment = 0, []
        for i in indices:
            starts[i] = offset
            offset += params[i].numel()
            segment += [i] * params[i].numel()
            grads[i] = None if i in INACTIVE else g[i].reshape(-1).contiguous().to(device)
        flat_grad = torch.full((offset,), float("nan"), dtype=dtype, device=device)
        groups.append(
            tuple(_flat([t[i] for i in indices]).to(device) for t in (params,))
            + (flat_grad,)
            + tuple(_flat([t[i] for i in indices]).to(device) for t in (m, v))
            + (torch.tensor(segment, dtype=torch.int32, device=device),)
        )
    addresses = torch.tensor(
        [0 if grads[i] is None else grads[i].data_ptr() for i in range(n)], device=device
    )
    inputs = torch.tensor(
        [
            [0.0123 * (1 + i / 7) for i in range(n)],
            [c.lr_mul for c in CFGS],
            [c.weight_decay for c in CFGS],
            [c.wd_mul for c in CFGS],
            [float(t) for t in steps],
            [0.0 if i in INACTIVE else 1.0 for i in range(n)],
        ],
        dtype=torch.float64,
        device=device,
    )
    values, index = [], [[0] * n for _ in range(4)]
    for i, cfg in enumerate(CFGS):
        for slot, (beta, fn) in enumerate(
            ((cfg.adam_betas[0], first_moment_correction), (cfg.adam_betas[1], second_moment_correction))
        ):
            table = correction_table(beta, fn)
            index[2 * slot][i], index[2 * slot + 1][i] = len(values), len(table) - 1
            values += table
    table = _table(steps, device)
    table[:, 5:] = float("nan")  # the per-step columns: whatever the launch does not write stays NaN
    return dict(
        groups=groups,
        table=table,
        addresses=addresses,
        starts=torch.tensor(starts, dtype=torch.int64, device=device),
        inputs=inputs,
        corrections=torch.tensor(values, dtype=torch.float64, device=device),
        correction_index=torch.tensor(index, dtype=torch.int32, device=device),
        grads=grads,  # keeps the gradients that addresses point at alive
    )


def _clone_case(case):
    out = dict(case)
    out["groups"] = [tuple(t.clone() for t in g) for g in case["groups"]]
    out["table"] = case["table"].clone()
    return out


def _three_launches(case, block):
    K.gather_grads_([(g[1], g[4]) for g in case["groups"]], case["addresses"], case["starts"], block=block)
    K.device_scalar_table_(case["table"], case["inputs"], case["corrections"], case["correction_index"])
    K.fused_adam_groups_(case["groups"], case["table"], block=block)


_STEP_ARGS = ("groups", "table", "addresses", "starts", "inputs", "corrections", "correction_index")


def _one_launch(case, block, gather):
    K.device_step_(*(case[k] for k in _STEP_ARGS), gather=gather, block=block)


def _assert_same_step(a, b):
    for k, (ga, gb) in enumerate(zip(a["groups"], b["groups"])):
        for what, x, y in zip(("param", "grad", "exp_avg", "exp_avg_sq"), ga[:4], gb[:4]):
            assert_bitwise(x, y, f"group {k} {what}")
    assert_bitwise(a["table"], b["table"], "table")


def _check_one_launch_against_three(device, block):
    reference = _device_step_case(device)
    gathered, flat = _clone_case(reference), _clone_case(reference)
    before = [g[0].clone() for g in reference["groups"]]
    _three_launches(reference, block)
    assert not torch.isnan(reference["table"]).any()
    assert any(not torch.equal(bits(g[0]), b) for g, b in zip(reference["groups"], before)), "nothing moved"
    _one_launch(gathered, block, gather=True)
    _assert_same_step(reference, gathered)
    # Without the gather the launch reads the flat buffer: give it the gathered gradients.
    for g, r in zip(flat["groups"], reference["groups"]):
        g[1].copy_(r[1])
    _one_launch(flat, block, gather=False)
    _assert_same_step(reference, flat)


def test_one_launch_device_step_equals_gather_table_and_adam_launches_bitwise():
    _check_one_launch_against_three("cpu", BLOCK)


@pytest.mark.gpu
def test_one_launch_device_step_equals_gather_table_and_adam_launches_bitwise_on_cuda():
    _check_one_launch_against_three("cuda", K.DEFAULT_BLOCK)


@pytest.mark.gpu
def test_one_launch_device_step_reads_pinned_rows_in_place_with_the_same_bits():
    reference = _device_step_case("cuda")
    pinned = _clone_case(reference)
    pinned["addresses"] = reference["addresses"].cpu().pin_memory()
    pinned["inputs"] = reference["inputs"].cpu().pin_memory()
    _three_launches(reference, K.DEFAULT_BLOCK)
    _one_launch(pinned, K.DEFAULT_BLOCK, gather=True)
    torch.cuda.synchronize()
    _assert_same_step(reference, pinned)


@pytest.mark.parametrize(
    "key, corrupt, match",
    [
        ("inputs", lambda t: t[:5], r"inputs must be a contiguous torch.float64 tensor of shape \[6, 8\]"),
        ("addresses", lambda t: t.int(), "addresses must be a contiguous torch.int64"),
        ("correction_index", lambda t: t.long(), "correction_index must be a contiguous torch.int32"),
        ("corrections", lambda t: t.float(), "corrections must be a float64"),
        ("groups", lambda g: g * 2, "one or two groups"),
    ],
)
def test_one_launch_device_step_refuses_bad_buffers_before_it_writes(key, corrupt, match):
    case = _device_step_case()
    before = [bits(t).clone() for g in case["groups"] for t in g[:4]]
    case[key] = corrupt(case[key])
    with pytest.raises(ValueError, match=match):
        _one_launch(case, BLOCK, gather=True)
    assert all(torch.equal(bits(t), b) for t, b in zip((t for g in case["groups"] for t in g[:4]), before))


def test_one_launch_device_step_signals_a_fence_once_per_launch_with_the_same_bits():
    from track_1_short.perf.graph_fence import GraphFence

    signalled, plain = _device_step_case(), _device_step_case()
    fence = GraphFence(torch.device("cpu"))
    for launch in range(1, 4):
        K.launch_device_step(*(plain[k] for k in _STEP_ARGS), BLOCK, True)
        K.launch_device_step(*(signalled[k] for k in _STEP_ARGS), BLOCK, True, fence=fence.signal_targets())
        fence.count()
        # The device counter and its host copy both moved by one: the fence has seen every launch.
        assert fence.arrived == launch == int(fence.signal_targets()[0].item())
        fence.wait()
    _assert_same_step(plain, signalled)
