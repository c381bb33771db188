"""bf16 matmuls of a CPU run through torch's fp32 GEMM (``TrainConfig.cpu_bf16_matmul``).

What it replaces (``cpu_bf16_matmul=native``): torch's own CPU kernel for bf16 ``mm``, ``bmm``, ``addmm`` and
``baddbmm``. On a CPU without native bf16 GEMM (no AVX512-BF16 or AMX, e.g. an AVX2-only AMD EPYC: oneDNN
refuses it, ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False) that kernel is a scalar fallback:
measured 1.4 GFLOP/s on one thread at 512 x 512, against 35 GFLOP/s for fp32. Every CPU run trains in bf16
(the tiny model's compute dtype, the ANVIL cascade's bmm/baddbmm), so the fallback set the run's pace.

Why it is faster: inside :func:`fp32_matmuls` a dispatch mode sees every aten op below autograd (``F.linear``,
``@`` and ``einsum`` arrive as mm/addmm/bmm, the backward's matmuls too) and calls the same op on fp32 copies
of a bf16 CPU matmul's tensors, rounding the result once to bf16; the ``out=`` forms the model's chunked loss
uses (``mm.out``, ``addmm.out`` into a bf16 buffer) are computed the same way and copied into ``out``. The
upcasts are O(n^2) against the GEMM's O(n^3), and the fp32 GEMM is vectorised. Measured on that EPYC (one
thread): the smoke run's training from 105 s to 23 s. Every other op, and matmuls of other dtypes or devices,
pass through untouched; what the mode adds to an op is a Python call, two set lookups and a string compare.

The numerics are the native kernel's contract: bf16 inputs, products exact in fp32 (8-bit significands),
fp32 accumulation, one rounding to bf16. Measured against the native fallback: the two agree except for 1-ulp
flips near rounding ties in about 5e-4 of the elements (K = 1024..8192), both within half a bf16 ulp plus the
fp32 accumulation error of the exact result; runs on the two routes are therefore close, not bitwise equal.

The project's custom ops (namespace ``track_1_short``: the chunked softcapped loss) reach a dispatch mode as
one op whose Python body the mode would not see, so the mode runs that body with itself pushed again: its
matmuls are converted too.

Invariants (tests/test_cpu_bf16_matmul.py; the trainer's switch in tests/test_train.py):
1. Each converted op's result is bitwise the op computed in fp32 on the upcast inputs and rounded once to
   bf16, and lies within ulp_bf16/2 + the fp32 accumulation bound of the exact (fp64) result.
2. fp32 and non-CPU tensors and every non-matmul op pass through: bitwise the results without the mode.
3. Complete: a forward and backward of the tiny model and an ANVIL step under the mode reach no bf16
   matmul-family kernel (mm, bmm, addmm, baddbmm, addbmm, addmv, mv, dot and their out/in-place forms).
4. The trainer runs build, warmup, training and validation under the mode exactly when the switch resolves to
   fp32 (:func:`resolve`), in every process that trains, and the mode is gone after the run, also on an error.

Not combined with torch.compile: Dynamo refuses a frame while a Python dispatch mode is active (a
``fullgraph=True`` compile raises), so :func:`resolve` picks the native kernels for a run that compiles.

Provenance: torch's bf16 CPU fallback (aten/src/ATen/native/cpu/BlasKernel.cpp) already upcasts, accumulates
each dot product in fp32 and rounds once; here that upcast-compute-round is done per tensor, so that the fp32
GEMM does the work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

aten = torch.ops.aten

SETTINGS = ("auto", "native", "fp32")
"""The values of ``cpu_bf16_matmul``."""

# Overloads whose bf16 CPU calls are converted. The out forms are those the model hits (its chunked loss);
# bmm.out and baddbmm.out are never called (tests/test_cpu_bf16_matmul.py checks it), so they are not.
_FUNCTIONAL = frozenset((aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default))
_OUT = {aten.mm.out: aten.mm.default, aten.addmm.out: aten.addmm.default}
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_OWN_NAMESPACE = "track_1_short"  # custom ops whose bodies run under the mode (see the module docstring)


def _bf16_cpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is torch.bfloat16 and t.is_cpu


def _upcast(args: tuple) -> list:
    return [a.float() if _bf16_cpu(a) else a for a in args]


class Fp32Bf16Matmuls(TorchDispatchMode):
    """The dispatch mode of :func:`fp32_matmuls`; ``calls`` counts the matmuls it converted."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: torch would otherwise wrap __torch_dispatch__ in a Dynamo-disable context that swaps the
        # frame evaluator twice on every op the mode sees, matmul or not: a 64 x 64 add took 32 us under the
        # wrapped mode, 19 us under this one, 5 us with no mode (one thread, the AVX2-only EPYC), and a CPU
        # training step runs about 10,000 ops. The mode never runs under torch.compile (:func:`resolve`), so
        # there is no compiled frame for the wrapper to keep Dynamo out of.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FUNCTIONAL:
            # The last positional argument is mat2 for all four; mixed dtypes are the native kernel's error.
            if _bf16_cpu(args[-1]):
                self.calls += 1
                return func(*_upcast(args), **kwargs).bfloat16()
        elif func in _OUT:
            out = kwargs["out"]
            if _bf16_cpu(out) and _bf16_cpu(args[-1]):
                rest = {k: v for k, v in kwargs.items() if k != "out"}
                result = _OUT[func](*_upcast(args), **rest)
                if result.shape == out.shape:  # else the native kernel resizes ``out`` as it documents
                    self.calls += 1
                    return out.copy_(result)  # copy_ rounds to nearest even: the one rounding
        elif func.namespace == _OWN_NAMESPACE and all(a.is_cpu for a in args if isinstance(a, torch.Tensor)):
            # Below the Python key, with this mode pushed again, so the body's own ops come back here.
            with self:
                return func.redispatch(_CPU, *args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_matmuls() -> Iterator[Fp32Bf16Matmuls]:
    """Run bf16 CPU matmuls through fp32 GEMMs inside the block (see the module docstring); the mode is
    popped on exit, also on an error."""
    with Fp32Bf16Matmuls() as mode:
        yield mode


def active() -> bool:
    """Whether a :func:`fp32_matmuls` block is in force on this thread."""
    return any(isinstance(m, Fp32Bf16Matmuls) for m in _get_current_dispatch_mode_stack())


def native_bf16_gemm() -> bool:
    """Whether torch multiplies bf16 matrices on this CPU with a native kernel (oneDNN's AVX512-BF16/AMX
    path); False on a build without oneDNN, whose bf16 GEMM is the scalar fallback."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or trimmed build without the probe
        return False


def resolve(setting: str, device_type: str, compiled: bool) -> tuple[str, str]:
    """("fp32" | "native", the reason in a few words) for ``cpu_bf16_matmul=setting`` on a run on
    ``device_type`` that ``compiled`` something with torch.compile (which the mode would break)."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_bf16_matmul={setting!r} must be one of {list(SETTINGS)}.")
    if device_type != "cpu":
        return "native", f"a {device_type} run"
    if setting != "auto":
        return setting, f"cpu_bf16_matmul={setting}"
    if compiled:
        return "native", "auto: the run compiles, and torch.compile refuses a dispatch mode"
    if native_bf16_gemm():
        return "native", "auto: this CPU has native bf16 GEMM"
    return "fp32", "auto: this CPU has no native bf16 GEMM"


def route(name: str) -> contextlib.AbstractContextManager:
    """The block for a resolved route: :func:`fp32_matmuls` for "fp32", nothing for "native"."""
    return fp32_matmuls() if name == "fp32" else contextlib.nullcontext()
