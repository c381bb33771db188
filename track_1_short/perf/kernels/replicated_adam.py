"""Triton kernels of the replicated-Adam fast path: Adam over flat buffers, hyperparameters by segment.

``fused_adam_`` runs the Adam step of track_1_short/optim/adam.py over every element of one flat buffer (many
small parameters laid end to end). Each element finds its parameter's row of an fp32 scalar table through an
int32 segment id; the columns are SCALAR_COLUMNS. ``bind_fused_adam`` binds one launch to buffers that never
move (the fast path's flat groups), so that each step replays the compiled kernel without the JIT's binder.

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
"""

from __future__ import annotations

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
