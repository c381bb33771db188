"""Triton kernels of the replicated-Adam fast path: Adam over flat buffers, hyperparameters by segment.

``fused_adam_`` runs the Adam step of track_1_short/optim/adam.py over every element of one flat buffer (many
small parameters laid end to end). Each element finds its parameter's row of an fp32 scalar table through an
int32 segment id; the columns are SCALAR_COLUMNS. ``fused_adam_groups_`` does the same for up to two buffers
(bf16 and fp32) in one launch, ``device_scalar_table_`` fills the per-step columns of the table on the
device from uploaded per-parameter inputs, and ``gather_grads_`` copies each parameter's gradient into its
flat buffer from a table of addresses read on the device. ``device_step_`` is those three in one launch
(the no-host-work mode of perf/replicated_adam_device.py; with several processes its gather stays a launch
of its own, before the reduce): the three separate kernels are the reference it is tested against bit for
bit, and each is tested against the host's own arithmetic.

Numerics: the claim is bitwise equality with the reference step (compiled on CUDA, eager on the CPU).
- fp32 throughout, one kernel statement per reference statement, operands in the reference's order; bf16
  parameters and gradients are widened exactly (bits << 16) right after the load.
- No contractions: every multiply and add is rounded on its own, on every backend. On CUDA the kernel is
  launched with enable_fp_fusion=False and the compiled reference is built with Inductor's
  emulate_precision_casts (which turns fp fusion off in its Triton kernels). Leaving fusion on does not
  work: LLVM's choice of which product of ``a*b + c*d`` goes into the fma depends on the constants (seen on an
  H200: the compiled reference fused (1 - beta2) * g^2 for beta2 = 0.95 and beta2 * v for beta2 = 0.99),
  while our betas are loaded from the table. The interpreter (numpy) and eager CPU torch fuse nothing.
- sqrt is tl.sqrt_rn (IEEE), as Inductor emits for torch.sqrt. Division mirrors Inductor: its fp32 ``/`` is
  Triton's ``/`` (div.full.f32, approximate) unless Inductor's division-rounding switch is on, then div_rn;
  the kernel reads the same switch (DIV_RN). The interpreter divides in IEEE either way, as eager CPU torch
  does.
- bf16 stores round to nearest even in integer arithmetic on the fp32 bits ((bits + 0x7FFF + lsb) >> 16; NaN
  becomes 0x7FFF as cvt.rn.bf16.f32 makes it). Triton's interpreter converts fp32 to bf16 toward zero whatever
  rounding is asked for, while the GPU rounds to nearest even; the integer form is the same on both.
- An inactive segment (active == 0) is skipped whole: its elements are neither loaded nor stored, so its
  moments do not decay and its parameter does not move.
- The device table computes step_size and eff_wd in fp64 with IEEE multiplies and div.rn, from bias
  corrections that the host computed in Python doubles, then rounds once to fp32: equal to the host table bit
  for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import round_to_bf16_bits as _round_to_bf16_bits
from track_1_short.perf.kernels.bf16_bits import widen_bf16 as _widen_bf16

SCALAR_COLUMNS = (
    "beta1",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "eps",
    "step_size",
    "eff_wd",
    "active",
)
# The kernels address a row as table_ptr + segment * ROW_STRIDE + column: the literal column offsets below
# follow SCALAR_COLUMNS' order.
ROW_STRIDE = 8
assert len(SCALAR_COLUMNS) == ROW_STRIDE
COLUMN = {name: index for index, name in enumerate(SCALAR_COLUMNS)}

# Per-step inputs of device_scalar_table_, one row of n parameters each (fp64 [len(STEP_INPUTS), n]).
STEP_INPUTS = ("lr", "lr_mul", "weight_decay", "wd_mul", "step", "active")

DEFAULT_BLOCK = 1024  # elements per program on the GPU (upstream's choice; 4 warps)
_NUM_WARPS = 4


@triton.jit
def _adam_update(
    offs,
    mask,
    g_bits,
    param_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    row,
    step_size,
    eff_wd,
    PARAM_BF16: tl.constexpr,
    DIV_RN: tl.constexpr,
):
    # The Adam step of the elements in ``mask``: g_bits is their gradient as loaded (bf16: its int16 bits),
    # row their table rows (the static columns), step_size and eff_wd their per-step scalars in fp32.
    beta1 = tl.load(row + 0, mask=mask, other=0.0)
    one_minus_beta1 = tl.load(row + 1, mask=mask, other=0.0)
    beta2 = tl.load(row + 2, mask=mask, other=0.0)
    one_minus_beta2 = tl.load(row + 3, mask=mask, other=0.0)
    eps = tl.load(row + 4, mask=mask, other=1.0)
    if PARAM_BF16:
        g = _widen_bf16(g_bits)  # grad.float()
        p = _widen_bf16(tl.load(param_ptr + offs, mask=mask, other=0))  # param.float()
    else:
        g = g_bits
        p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

    # Every multiply and add rounded on its own (launched with enable_fp_fusion=False, see the docstring).
    m = beta1 * m + one_minus_beta1 * g  # beta1 * exp_avg + (1 - beta1) * g
    v = beta2 * v + one_minus_beta2 * (g * g)  # beta2 * exp_avg_sq + (1 - beta2) * (g * g)
    denom = tl.sqrt_rn(v) + eps  # v.sqrt() + eps
    if DIV_RN:
        ratio = tl.math.div_rn(m, denom)  # m / (...), Inductor with division rounding on
    else:
        ratio = m / denom  # m / (...), Inductor's default lowering
    u = ratio * step_size  # ... * step_size
    u = tl.where(u * p > 0.0, u + eff_wd * p, u)  # torch.where(u * p > 0, u + eff_wd * p, u)
    p = p - u  # param.copy_(p - u)

    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if PARAM_BF16:
        tl.store(param_ptr + offs, _round_to_bf16_bits(p), mask=mask)
    else:
        tl.store(param_ptr + offs, p, mask=mask)


@triton.jit
def _adam_block(
    offs,
    in_bounds,
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    segment_ptr,
    table_ptr,
    PARAM_BF16: tl.constexpr,
    DIV_RN: tl.constexpr,
):
    seg = tl.load(segment_ptr + offs, mask=in_bounds, other=0)
    row = table_ptr + seg * 8  # ROW_STRIDE
    active = tl.load(row + 7, mask=in_bounds, other=0.0) != 0.0
    mask = in_bounds & active
    step_size = tl.load(row + 5, mask=mask, other=0.0)
    eff_wd = tl.load(row + 6, mask=mask, other=0.0)
    g_bits = tl.load(grad_ptr + offs, mask=mask, other=0)
    _adam_update(
        offs, mask, g_bits, param_ptr, exp_avg_ptr, exp_avg_sq_ptr, row, step_size, eff_wd, PARAM_BF16, DIV_RN
    )


@triton.jit
def _fused_adam_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    segment_ptr,
    table_ptr,
    n_elements,
    PARAM_BF16: tl.constexpr,
    DIV_RN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _adam_block(
        offs,
        offs < n_elements,
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        segment_ptr,
        table_ptr,
        PARAM_BF16,
        DIV_RN,
    )


@triton.jit
def _fused_adam_two_groups_kernel(
    param0_ptr,
    grad0_ptr,
    exp_avg0_ptr,
    exp_avg_sq0_ptr,
    segment0_ptr,
    n0,
    blocks0,
    param1_ptr,
    grad1_ptr,
    exp_avg1_ptr,
    exp_avg_sq1_ptr,
    segment1_ptr,
    n1,
    table_ptr,
    PARAM0_BF16: tl.constexpr,
    PARAM1_BF16: tl.constexpr,
    DIV_RN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Programs [0, blocks0) take group 0, the rest group 1: a block never straddles two buffers.
    pid = tl.program_id(0)
    if pid < blocks0:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        _adam_block(
            offs,
            offs < n0,
            param0_ptr,
            grad0_ptr,
            exp_avg0_ptr,
            exp_avg_sq0_ptr,
            segment0_ptr,
            table_ptr,
            PARAM0_BF16,
            DIV_RN,
        )
    else:
        offs = (pid - blocks0) * BLOCK + tl.arange(0, BLOCK)
        _adam_block(
            offs,
            offs < n1,
            param1_ptr,
            grad1_ptr,
            exp_avg1_ptr,
            exp_avg_sq1_ptr,
            segment1_ptr,
            table_ptr,
            PARAM1_BF16,
            DIV_RN,
        )


@triton.jit
def _gathered(offs, in_bounds, seg, grad_ptr, addresses_ptr, starts_ptr):
    # Element k of the flat buffer is element (k - start) of its parameter's gradient, wherever autograd put
    # that tensor this step: its address comes from the table, as an integer (0: no gradient, zeros).
    address = tl.load(addresses_ptr + seg, mask=in_bounds, other=0)
    start = tl.load(starts_ptr + seg, mask=in_bounds, other=0)
    source = address.to(tl.pointer_type(grad_ptr.dtype.element_ty)) + (offs - start)
    return tl.load(source, mask=in_bounds & (address != 0), other=0)


@triton.jit
def _gather_block(offs, in_bounds, grad_ptr, segment_ptr, addresses_ptr, starts_ptr):
    seg = tl.load(segment_ptr + offs, mask=in_bounds, other=0)
    values = _gathered(offs, in_bounds, seg, grad_ptr, addresses_ptr, starts_ptr)
    tl.store(grad_ptr + offs, values, mask=in_bounds)


@triton.jit
def _gather_grads_kernel(
    grad0_ptr,
    segment0_ptr,
    n0,
    blocks0,
    grad1_ptr,
    segment1_ptr,
    n1,
    addresses_ptr,
    starts_ptr,
    BLOCK: tl.constexpr,
):
    # Programs [0, blocks0) fill buffer 0, the rest buffer 1 (as _fused_adam_two_groups_kernel splits them).
    pid = tl.program_id(0)
    if pid < blocks0:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        _gather_block(offs, offs < n0, grad0_ptr, segment0_ptr, addresses_ptr, starts_ptr)
    else:
        offs = (pid - blocks0) * BLOCK + tl.arange(0, BLOCK)
        _gather_block(offs, offs < n1, grad1_ptr, segment1_ptr, addresses_ptr, starts_ptr)


@triton.jit
def _step_scalars(i, mask, inputs_ptr, corrections_ptr, correction_index_ptr, n):
    # Parameter i's (step_size, eff_wd) in fp32 and whether it is active, from its per-step inputs
    # (STEP_INPUTS rows of n) and its bias-correction tables: fp64 with IEEE multiplies and div.rn, one
    # rounding to fp32.
    lr = tl.load(inputs_ptr + 0 * n + i, mask=mask, other=0.0)
    lr_mul = tl.load(inputs_ptr + 1 * n + i, mask=mask, other=0.0)
    weight_decay = tl.load(inputs_ptr + 2 * n + i, mask=mask, other=0.0)
    wd_mul = tl.load(inputs_ptr + 3 * n + i, mask=mask, other=0.0)
    step = tl.load(inputs_ptr + 4 * n + i, mask=mask, other=0.0).to(tl.int32)
    active = tl.load(inputs_ptr + 5 * n + i, mask=mask, other=0.0) != 0.0
    # Correction tables hold t = 0..last; past `last` the value no longer changes in double precision.
    first_start = tl.load(correction_index_ptr + 0 * n + i, mask=mask, other=0)
    first_last = tl.load(correction_index_ptr + 1 * n + i, mask=mask, other=0)
    second_start = tl.load(correction_index_ptr + 2 * n + i, mask=mask, other=0)
    second_last = tl.load(correction_index_ptr + 3 * n + i, mask=mask, other=0)
    first = tl.load(corrections_ptr + first_start + tl.minimum(step, first_last), mask=mask, other=1.0)
    second = tl.load(corrections_ptr + second_start + tl.minimum(step, second_last), mask=mask, other=0.0)
    first = tl.where(active, first, 1.0)  # an inactive row may sit at t = 0, where 1 - beta1^0 = 0

    lr_eff = lr * lr_mul  # cfg.lr * cfg.lr_mul
    step_size = lr_eff * second / first  # lr * sqrt(1 - beta2^t) / (1 - beta1^t), fp64 div.rn
    eff_wd = ((lr_eff * lr_eff) * weight_decay) * wd_mul  # ((lr * lr) * weight_decay) * wd_mul
    step_size = tl.where(active, step_size, 0.0).to(tl.float32)
    eff_wd = tl.where(active, eff_wd, 0.0).to(tl.float32)
    return step_size, eff_wd, active


@triton.jit
def _write_table_columns(
    table_ptr, inputs_ptr, corrections_ptr, correction_index_ptr, n, BLOCK_N: tl.constexpr
):
    # The per-step columns (step_size, eff_wd, active) of every row of the table.
    i = tl.arange(0, BLOCK_N)
    mask = i < n
    step_size, eff_wd, active = _step_scalars(i, mask, inputs_ptr, corrections_ptr, correction_index_ptr, n)
    row = table_ptr + i * 8  # ROW_STRIDE
    tl.store(row + 5, step_size, mask=mask)
    tl.store(row + 6, eff_wd, mask=mask)
    tl.store(row + 7, tl.where(active, 1.0, 0.0).to(tl.float32), mask=mask)


@triton.jit
def _device_scalar_table_kernel(
    table_ptr,
    inputs_ptr,
    corrections_ptr,
    correction_index_ptr,
    n,
    BLOCK_N: tl.constexpr,
):
    _write_table_columns(table_ptr, inputs_ptr, corrections_ptr, correction_index_ptr, n, BLOCK_N)


@triton.jit
def _device_step_block(
    offs,
    in_bounds,
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    segment_ptr,
    table_ptr,
    addresses_ptr,
    starts_ptr,
    inputs_ptr,
    corrections_ptr,
    correction_index_ptr,
    n_params,
    PARAM_BF16: tl.constexpr,
    GATHER: tl.constexpr,
    DIV_RN: tl.constexpr,
):
    seg = tl.load(segment_ptr + offs, mask=in_bounds, other=0)
    # Each element computes its own row's scalars, the same fp64 arithmetic as the table's: no program waits
    # for another (one launch has no barrier between its programs).
    step_size, eff_wd, active = _step_scalars(
        seg, in_bounds, inputs_ptr, corrections_ptr, correction_index_ptr, n_params
    )
    mask = in_bounds & active
    if GATHER:
        g_bits = _gathered(offs, in_bounds, seg, grad_ptr, addresses_ptr, starts_ptr)
        tl.store(grad_ptr + offs, g_bits, mask=in_bounds)  # the flat buffer holds the gathered gradient
    else:
        g_bits = tl.load(grad_ptr + offs, mask=mask, other=0)
    row = table_ptr + seg * 8  # ROW_STRIDE
    _adam_update(
        offs, mask, g_bits, param_ptr, exp_avg_ptr, exp_avg_sq_ptr, row, step_size, eff_wd, PARAM_BF16, DIV_RN
    )


@triton.jit
def _device_step_kernel(
    param0_ptr,
    grad0_ptr,
    exp_avg0_ptr,
    exp_avg_sq0_ptr,
    segment0_ptr,
    n0,
    blocks0,
    param1_ptr,
    grad1_ptr,
    exp_avg1_ptr,
    exp_avg_sq1_ptr,
    segment1_ptr,
    n1,
    table_ptr,
    addresses_ptr,
    starts_ptr,
    inputs_ptr,
    corrections_ptr,
    correction_index_ptr,
    n_params,
    fence_device_ptr,
    fence_host_ptr,
    PARAM0_BF16: tl.constexpr,
    PARAM1_BF16: tl.constexpr,
    GATHER: tl.constexpr,
    SIGNAL: tl.constexpr,
    DIV_RN: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Programs [0, blocks0) take group 0, the rest group 1 (as _fused_adam_two_groups_kernel splits them);
    # the last program also writes the table's per-step columns, which no program reads.
    pid = tl.program_id(0)
    if SIGNAL:
        if pid == 0:
            # A GraphFence signal: the launch has started, so the copies queued before it on the stream
            # (the rows' upload) have run. One program, so a plain increment: no other program touches it.
            count = tl.load(fence_device_ptr) + 1
            tl.store(fence_device_ptr, count)
            tl.store(fence_host_ptr, count)
    if pid < blocks0:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        _device_step_block(
            offs,
            offs < n0,
            param0_ptr,
            grad0_ptr,
            exp_avg0_ptr,
            exp_avg_sq0_ptr,
            segment0_ptr,
            table_ptr,
            addresses_ptr,
            starts_ptr,
            inputs_ptr,
            corrections_ptr,
            correction_index_ptr,
            n_params,
            PARAM0_BF16,
            GATHER,
            DIV_RN,
        )
    else:
        offs = (pid - blocks0) * BLOCK + tl.arange(0, BLOCK)
        _device_step_block(
            offs,
            offs < n1,
            param1_ptr,
            grad1_ptr,
            exp_avg1_ptr,
            exp_avg_sq1_ptr,
            segment1_ptr,
            table_ptr,
            addresses_ptr,
            starts_ptr,
            inputs_ptr,
            corrections_ptr,
            correction_index_ptr,
            n_params,
            PARAM1_BF16,
            GATHER,
            DIV_RN,
        )
    if pid == tl.num_programs(0) - 1:
        _write_table_columns(table_ptr, inputs_ptr, corrections_ptr, correction_index_ptr, n_params, BLOCK_N)


_inductor_div_rn: bool | None = None


def inductor_divides_rn() -> bool:
    """Whether Inductor lowers fp32 division to div_rn (its division-rounding switch), not Triton's ``/``."""
    global _inductor_div_rn
    if _inductor_div_rn is None:
        from torch._inductor import config

        eager_numerics = getattr(config, "eager_numerics", None)
        if eager_numerics is not None and hasattr(eager_numerics, "division_rounding"):
            _inductor_div_rn = bool(eager_numerics.division_rounding)
        else:  # torch versions before the switch moved (its old name has the typo)
            _inductor_div_rn = bool(getattr(config, "emulate_divison_rounding", False))
    return _inductor_div_rn


def _bits(t: torch.Tensor) -> torch.Tensor:
    # bf16 buffers go to the kernel as their raw 16-bit patterns (see the module docstring). Callers on the
    # hot path may pass those int16 views themselves (made once): a view costs microseconds of host time.
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _check_block(block: int) -> None:
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")


def _check_group(name: str, param, grad, exp_avg, exp_avg_sq, segment) -> None:
    n = param.numel()
    for what, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
            raise ValueError(
                f"{name}: {what} must be a contiguous 1-D buffer of {n} elements, got {tuple(t.shape)}"
            )
        if t.device != param.device:
            raise ValueError(
                f"{name}: {what} is on {t.device}, param on {param.device}; put all on one device"
            )
    if segment.dim() != 1 or not segment.is_contiguous() or segment.numel() != n:
        raise ValueError(f"{name}: segment must be a contiguous 1-D buffer of {n} elements")
    if param.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: param must be bfloat16 or float32, got {param.dtype}")
    if grad.dtype != param.dtype:
        raise TypeError(f"{name}: grad is {grad.dtype} but param is {param.dtype}; they must match")
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise TypeError(f"{name}: exp_avg and exp_avg_sq must be float32")
    if segment.dtype != torch.int32:
        raise TypeError(f"{name}: segment must be int32, got {segment.dtype}")


def _check_table(scalars: torch.Tensor, device: torch.device) -> None:
    if scalars.dtype != torch.float32 or scalars.dim() != 2 or scalars.shape[1] != ROW_STRIDE:
        raise ValueError(f"scalars must be a float32 [n_params, {ROW_STRIDE}] table (SCALAR_COLUMNS)")
    if not scalars.is_contiguous() or scalars.device != device:
        raise ValueError(f"scalars must be contiguous and on {device}")


def _div_rn(device: torch.device) -> bool:
    return device.type == "cuda" and inductor_divides_rn()


def _fused_adam_launch(param, grad, exp_avg, exp_avg_sq, segment, scalars, block: int):
    """(grid, arguments, constexprs, options) of one fused_adam_ launch."""
    n = param.numel()
    args = (_bits(param), _bits(grad), exp_avg, exp_avg_sq, segment, scalars, n)
    constexprs = {
        "PARAM_BF16": param.dtype in (torch.bfloat16, torch.int16),
        "DIV_RN": _div_rn(param.device),
        "BLOCK": block,
    }
    return (triton.cdiv(n, block),), args, constexprs, {"enable_fp_fusion": False, "num_warps": _NUM_WARPS}


def launch_fused_adam(param, grad, exp_avg, exp_avg_sq, segment, scalars, block: int) -> None:
    """The unchecked launch behind fused_adam_ (callers that validated their buffers once at construction)."""
    grid, args, constexprs, options = _fused_adam_launch(
        param, grad, exp_avg, exp_avg_sq, segment, scalars, block
    )
    _fused_adam_kernel[grid](*args, **constexprs, **options)


class BoundLaunch:
    """One Triton launch whose arguments never change, replayed through the compiled kernel's own launcher.

    What it replaces: ``kernel[grid](*args)`` on every step. Triton's JIT call binds the arguments, derives
    each one's specialization (a pointer's 16-byte alignment, an int's value class), builds a cache key and
    looks the compiled kernel up before it launches: host work that is the same every step for buffers that
    never move. Why it is faster: the first call goes through the JIT (compiling if needed) and keeps the
    compiled kernel it returns; every later call goes straight to ``compiled[grid](*arguments)``, Triton's
    entry point for a compiled kernel, which only reads the current stream and launches.

    Invariants (tests/perf/test_kernel_replicated_adam.py; the CUDA ones run under ``pytest -m gpu``): the
    arguments are the same objects every call (the flat buffers of a ReplicatedAdam, allocated once and only
    ever written in place), so the first call's specialization holds for all later ones; a bound replay gives
    the bits of a JIT launch. Constexprs are fixed at binding, Inductor's division-rounding switch included
    (DIV_RN): the compiled reference reads it once too, when it compiles. Under Triton's interpreter (no GPU)
    the JIT call returns no compiled kernel and every call takes the JIT path.

    Provenance: Inductor launches its generated Triton kernels the same way (the compiled binary's launcher,
    with arguments it prepared itself), not through the JIT's binder.
    """

    def __init__(self, kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict):
        named = dict(zip(kernel.arg_names, args))
        named.update(constexprs)
        missing = [name for name in kernel.arg_names if name not in named]
        if len(args) + len(constexprs) != len(kernel.arg_names) or missing:
            raise TypeError(
                f"BoundLaunch of {getattr(kernel, '__name__', kernel)}: arguments {sorted(named)} do not "
                f"match its parameters {list(kernel.arg_names)}"
            )
        self.kernel, self.grid = kernel, grid
        self.args, self.constexprs, self.options = args, constexprs, options
        # The compiled launcher takes every parameter in signature order, constexprs included (it skips them).
        self._values = tuple(named[name] for name in kernel.arg_names)
        self._runner = None
        self.jit_launches = (
            0  # calls that went through the JIT (1 on a GPU; every call under the interpreter)
        )

    def __call__(self) -> None:
        runner = self._runner
        if runner is not None:
            runner(*self._values)
            return
        compiled = self.kernel[self.grid](*self.args, **self.constexprs, **self.options)
        self.jit_launches += 1
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            # The compiled kernel's launcher indexes all three grid dimensions (the JIT pads them itself).
            self._runner = compiled[tuple(self.grid) + (1,) * (3 - len(self.grid))]


def bind_fused_adam(param, grad, exp_avg, exp_avg_sq, segment, scalars, block: int) -> BoundLaunch:
    """launch_fused_adam as a BoundLaunch over buffers that stay in place (validated by the caller)."""
    return BoundLaunch(
        _fused_adam_kernel,
        *_fused_adam_launch(param, grad, exp_avg, exp_avg_sq, segment, scalars, block),
    )


def fused_adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    segment: torch.Tensor,
    scalars: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
) -> None:
    """One Adam step, in place, over flat buffers; element k uses row ``segment[k]`` of ``scalars``.

    param: bf16 or fp32 [N]; grad: param's dtype [N]; exp_avg, exp_avg_sq: fp32 [N]; segment: int32 [N] with
    values in [0, n_params); scalars: fp32 [n_params, len(SCALAR_COLUMNS)]. Rows with active == 0 are skipped.
    """
    _check_block(block)
    _check_group("fused_adam_", param, grad, exp_avg, exp_avg_sq, segment)
    _check_table(scalars, param.device)
    launch_fused_adam(param, grad, exp_avg, exp_avg_sq, segment, scalars, block)


def _two_group_split(groups: Sequence[tuple], block: int):
    """(first, second, n0, n1, blocks0, grid) of a launch whose programs [0, blocks0) take group 0's buffer
    (first[0] its numel n0) and the rest group 1's; with one group, second repeats it and n1 is 0."""
    first = groups[0]
    second = groups[1] if len(groups) > 1 else first
    n0 = first[0].numel()
    n1 = second[0].numel() if len(groups) > 1 else 0
    blocks0 = triton.cdiv(n0, block)
    return first, second, n0, n1, blocks0, (blocks0 + triton.cdiv(n1, block),)


def launch_fused_adam_groups(groups: Sequence[tuple], scalars, block: int) -> None:
    """The unchecked launch behind fused_adam_groups_."""
    first, second, n0, n1, blocks0, grid = _two_group_split(groups, block)
    _fused_adam_two_groups_kernel[grid](
        _bits(first[0]),
        _bits(first[1]),
        first[2],
        first[3],
        first[4],
        n0,
        blocks0,
        _bits(second[0]),
        _bits(second[1]),
        second[2],
        second[3],
        second[4],
        n1,
        scalars,
        PARAM0_BF16=first[0].dtype == torch.bfloat16,
        PARAM1_BF16=second[0].dtype == torch.bfloat16,
        DIV_RN=_div_rn(first[0].device),
        enable_fp_fusion=False,
        BLOCK=block,
        num_warps=_NUM_WARPS,
    )


def fused_adam_groups_(
    groups: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    scalars: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
) -> None:
    """fused_adam_ over one or two flat groups (param, grad, exp_avg, exp_avg_sq, segment) in one launch."""
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"fused_adam_groups_ takes one or two groups, got {len(groups)}")
    _check_block(block)
    for k, group in enumerate(groups):
        _check_group(f"fused_adam_groups_ group {k}", *group)
        _check_table(scalars, group[0].device)
    launch_fused_adam_groups(groups, scalars, block)


def device_scalar_table_(
    table: torch.Tensor,
    inputs: torch.Tensor,
    corrections: torch.Tensor,
    correction_index: torch.Tensor,
) -> None:
    """Fill columns step_size, eff_wd and active of ``table`` (fp32 [n, 8]) on its device, in one launch.

    inputs: fp64 [len(STEP_INPUTS), n], per parameter: lr, lr_mul, weight_decay, wd_mul, step (already
    incremented where active) and active (1.0 or 0.0). corrections: fp64, the concatenated host-computed
    tables of ``1 - beta1^t`` and ``sqrt(1 - beta2^t)`` for t = 0..last; correction_index: int32 [4, n], per
    parameter (first start, first last, second start, second last) into corrections.
    """
    n = table.shape[0]
    _device_scalar_table_kernel[(1,)](
        table,
        inputs,
        corrections,
        correction_index,
        n,
        BLOCK_N=max(16, triton.next_power_of_2(n)),
        enable_fp_fusion=False,  # fp64 products rounded one by one, as the host computes them in Python
    )


def launch_device_step(
    groups: Sequence[tuple],
    table: torch.Tensor,
    addresses: torch.Tensor,
    starts: torch.Tensor,
    inputs: torch.Tensor,
    corrections: torch.Tensor,
    correction_index: torch.Tensor,
    block: int,
    gather: bool,
    fence: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The unchecked launch behind device_step_ (for callers that validated their buffers at construction).

    ``fence``: (device count, pinned host count) of a GraphFence (its ``signal_targets()``) that the launch
    signals as it starts, or None."""
    first, second, n0, n1, blocks0, grid = _two_group_split(groups, block)
    n = table.shape[0]
    fence_device, fence_host = fence if fence is not None else (table, table)  # not read without SIGNAL
    _device_step_kernel[grid](
        _bits(first[0]),
        _bits(first[1]),
        first[2],
        first[3],
        first[4],
        n0,
        blocks0,
        _bits(second[0]),
        _bits(second[1]),
        second[2],
        second[3],
        second[4],
        n1,
        table,
        addresses,
        starts,
        inputs,
        corrections,
        correction_index,
        n,
        fence_device,
        fence_host,
        PARAM0_BF16=first[0].dtype == torch.bfloat16,
        PARAM1_BF16=second[0].dtype == torch.bfloat16,
        GATHER=gather,
        SIGNAL=fence is not None,
        DIV_RN=_div_rn(first[0].device),
        BLOCK=block,
        BLOCK_N=max(16, triton.next_power_of_2(n)),
        enable_fp_fusion=False,  # fp32 Adam and fp64 scalars both rounded op by op (see the docstring)
        num_warps=_NUM_WARPS,
    )


def device_step_(
    groups: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    table: torch.Tensor,
    addresses: torch.Tensor,
    starts: torch.Tensor,
    inputs: torch.Tensor,
    corrections: torch.Tensor,
    correction_index: torch.Tensor,
    *,
    gather: bool = True,
    block: int = DEFAULT_BLOCK,
) -> None:
    """One Adam step over one or two flat groups in one launch, with its scalars computed on the device.

    What device_scalar_table_, then fused_adam_groups_ (and, with ``gather``, gather_grads_ before them) do
    in three launches: each element computes its row's step_size and eff_wd from ``inputs``, ``corrections``
    and ``correction_index`` (as device_scalar_table_ takes them) and reads beta1, 1 - beta1, beta2,
    1 - beta2 and eps from ``table`` (SCALAR_COLUMNS); with ``gather`` it reads its gradient through
    ``addresses`` and ``starts`` (as gather_grads_ takes them) and writes it into the flat grad buffer, else
    it reads the flat buffer. One program also writes the table's step_size, eff_wd and active columns, so
    that the table ends as device_scalar_table_ leaves it. ``addresses`` and ``inputs`` may be pinned host
    tensors: the kernel then reads them in place, with no upload.
    """
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"device_step_ takes one or two groups, got {len(groups)}")
    _check_block(block)
    device = groups[0][0].device
    for k, group in enumerate(groups):
        _check_group(f"device_step_ group {k}", *group)
        _check_table(table, group[0].device)
    n = table.shape[0]
    for what, t, dtype, shape in (
        ("addresses", addresses, torch.int64, (n,)),
        ("starts", starts, torch.int64, (n,)),
        ("inputs", inputs, torch.float64, (len(STEP_INPUTS), n)),
        ("correction_index", correction_index, torch.int32, (4, n)),
    ):
        readable = t.device == device or (device.type == "cuda" and t.is_pinned())
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or not readable:
            raise ValueError(
                f"device_step_: {what} must be a contiguous {dtype} tensor of shape {list(shape)} on {device}"
                f"{' or pinned' if device.type == 'cuda' else ''}, got {t.dtype} {list(t.shape)} on "
                f"{t.device}"
            )
    if corrections.dtype != torch.float64 or corrections.device != device:
        raise ValueError(f"device_step_: corrections must be a float64 tensor on {device}")
    launch_device_step(groups, table, addresses, starts, inputs, corrections, correction_index, block, gather)


def _gather_launch(groups: Sequence[tuple], addresses, starts, block: int):
    """(grid, arguments, constexprs, options) of one gather_grads_ launch over one or two groups."""
    first, second, n0, n1, blocks0, grid = _two_group_split(groups, block)
    # Bits are copied as they are: bf16 buffers as int16, so the element width is all the kernel needs.
    args = (_bits(first[0]), first[1], n0, blocks0, _bits(second[0]), second[1], n1, addresses, starts)
    return grid, args, {"BLOCK": block}, {"num_warps": _NUM_WARPS}


def bind_gather_grads(groups: Sequence[tuple], addresses, starts, block: int) -> BoundLaunch:
    """gather_grads_ as a BoundLaunch over buffers and tables that stay in place (validated by the caller)."""
    return BoundLaunch(_gather_grads_kernel, *_gather_launch(groups, addresses, starts, block))


def gather_grads_(
    groups: Sequence[tuple[torch.Tensor, torch.Tensor]],
    addresses: torch.Tensor,
    starts: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
) -> None:
    """Copy every parameter's gradient into its slice of a flat buffer, in one launch for one or two buffers.

    groups: (grad, segment) per flat buffer: grad bf16 or fp32 [N], segment int32 [N] (parameter index per
    element). addresses: int64 [n_params], the data pointer of parameter i's gradient (a contiguous tensor of
    the parameter's dtype and numel, on the buffers' device) or 0 where it has none; its slice is then zeroed.
    starts: int64 [n_params], the offset of parameter i's first element in its buffer. The kernel reads the
    addresses on the device: a CUDA graph of this launch follows gradients that move from step to step.
    """
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"gather_grads_ takes one or two groups, got {len(groups)}")
    _check_block(block)
    device = groups[0][0].device
    for k, (grad, segment) in enumerate(groups):
        name = f"gather_grads_ group {k}"
        if grad.dim() != 1 or not grad.is_contiguous() or grad.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: grad must be a contiguous 1-D bf16 or fp32 buffer")
        if segment.dtype != torch.int32 or segment.shape != grad.shape or not segment.is_contiguous():
            raise ValueError(f"{name}: segment must be a contiguous int32 buffer of {grad.numel()} elements")
        if grad.device != device or segment.device != device:
            raise ValueError(f"{name}: every buffer must be on {device}")
    for what, table in (("addresses", addresses), ("starts", starts)):
        if table.dtype != torch.int64 or table.dim() != 1 or table.device != device:
            raise ValueError(f"gather_grads_: {what} must be a 1-D int64 tensor on {device}")
    if addresses.shape != starts.shape or not (addresses.is_contiguous() and starts.is_contiguous()):
        raise ValueError("gather_grads_: addresses and starts must be contiguous, one entry per parameter")
    grid, args, constexprs, options = _gather_launch(groups, addresses, starts, block)
    _gather_grads_kernel[grid](*args, **constexprs, **options)
