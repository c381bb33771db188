"""The fp32 route for bf16 CPU matmuls (track_1_short/cpu_bf16_matmul.py): its numerics, what it leaves
alone, that nothing of a training step escapes it, and how ``cpu_bf16_matmul`` resolves.

What reaches torch's kernels is observed by a recording dispatch mode entered first, so that it sits beneath
the fp32 mode: it sees the ops the fp32 mode dispatches, not the ones the program called.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from tests.model.conftest import BOS, load_config, packed_batch
from track_1_short import cpu_bf16_matmul
from track_1_short.cpu_bf16_matmul import Fp32Bf16Matmuls, active, fp32_matmuls, resolve
from track_1_short.model.gpt import GPT
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig

aten = torch.ops.aten
BF16 = torch.bfloat16
CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
TORCH_NAMESPACES = {"aten", "prims", "rngprims", "debug_mode_ops"}
# Every matmul-family packet, functional, in place and out forms alike (an OpOverloadPacket holds them all).
MATMUL_FAMILY = {
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.addmm_,
    aten.baddbmm,
    aten.baddbmm_,
    aten.addbmm,
    aten.addbmm_,
    aten.addmv,
    aten.addmv_,
    aten.mv,
    aten.dot,
    aten.vdot,
    aten._addmm_activation,
}


class Recorder(TorchDispatchMode):
    """Records (op, dtypes of its tensor arguments and ``out``) of every op that reaches it.

    The project's custom ops (the chunked loss) arrive as one op; their bodies run with the recorder pushed
    again, so that the matmuls inside them are recorded too."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.seen.append((func, tuple(t.dtype for t in tensors)))
        if func.name() in OPDEFS and func.namespace not in TORCH_NAMESPACES:
            with self:
                return func.redispatch(CPU, *args, **kwargs)
        return func(*args, **kwargs)

    def bf16_matmuls(self) -> list:
        return [(f, d) for f, d in self.seen if f.overloadpacket in MATMUL_FAMILY and BF16 in d]

    def ops(self) -> set:
        return {f for f, _ in self.seen}


def bf16(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(BF16)


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (fp64): 2^(e - 8) for |x| in [2^(e-1), 2^e); subnormal below."""
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), e.clamp(min=-125) - 8)


K = 1024
# name: (the op as the program calls it, the same op on fp64 inputs, contraction length)
CASES = {
    "mm": (lambda a, b, c: torch.mm(a, b), lambda a, b, c: a @ b, K),
    "bmm": (lambda a, b, c: torch.bmm(a, b), lambda a, b, c: a @ b, K),
    "addmm": (
        lambda a, b, c: torch.addmm(c, a, b, beta=0.75, alpha=-1.25),
        lambda a, b, c: 0.75 * c + -1.25 * (a @ b),
        K,
    ),
    "baddbmm": (
        lambda a, b, c: torch.baddbmm(c, a, b, beta=-0.5, alpha=1.5),
        lambda a, b, c: -0.5 * c + 1.5 * (a @ b),
        K,
    ),
    "mm.out": (
        lambda a, b, c: torch.mm(a, b, out=torch.empty(a.size(0), b.size(1), dtype=a.dtype)),
        lambda a, b, c: a @ b,
        K,
    ),
    "addmm.out": (
        lambda a, b, c: torch.addmm(c, a, b, beta=0.75, alpha=-1.25, out=torch.empty(c.shape, dtype=a.dtype)),
        lambda a, b, c: 0.75 * c + -1.25 * (a @ b),
        K,
    ),
}
ALPHA_BETA = {"mm": (1, 0), "bmm": (1, 0), "addmm": (1.25, 0.75), "baddbmm": (1.5, 0.5)}
ALPHA_BETA |= {"mm.out": (1, 0), "addmm.out": (1.25, 0.75)}


def operands(name: str):
    batch = (3,) if name in ("bmm", "baddbmm") else ()
    a, b = bf16(*batch, 16, K, seed=1), bf16(*batch, K, 24, seed=2)
    c = bf16(*batch, 16, 24, seed=3)
    return a, b, c


@pytest.mark.parametrize("name", list(CASES))
def test_each_converted_op_is_the_fp32_op_rounded_once_within_the_bound_of_the_exact_result(name):
    op, exact_op, k = CASES[name]
    a, b, c = operands(name)
    recorder = Recorder()
    with recorder, fp32_matmuls() as mode:
        r = op(a, b, c)
    assert r.dtype == BF16 and mode.calls == 1
    # The definition: the op on fp32 copies of the inputs (exact upcasts), rounded once to bf16.
    assert torch.equal(r, op(a.float(), b.float(), c.float()).bfloat16())
    # The native kernel never saw a bf16 matmul; an fp32 one ran in its place.
    assert recorder.bf16_matmuls() == []
    assert any(f.overloadpacket in (aten.mm, aten.bmm, aten.addmm, aten.baddbmm) for f in recorder.ops())
    # Bound: products of bf16 inputs are exact in fp32, the K-term fp32 accumulation (with the alpha and beta
    # scalings, K + 2 roundings) errs by at most gamma = n u / (1 - n u) times the sum of the terms'
    # magnitudes, and the one rounding to bf16 adds half a bf16 ulp of the accumulated value, whose magnitude
    # is at most |exact| + that error.
    alpha, beta = ALPHA_BETA[name]
    a64, b64, c64 = a.double(), b.double(), c.double()
    exact = exact_op(a64, b64, c64)
    n, u = k + 2, 2.0**-24
    acc = n * u / (1 - n * u) * (alpha * (a64.abs() @ b64.abs()) + beta * c64.abs())
    err = (r.double() - exact).abs()
    assert (err <= ulp_bf16(exact.abs() + acc) / 2 + acc).all(), (err / ulp_bf16(exact)).max()


@pytest.mark.parametrize(
    "op",
    [
        lambda a, b, c: torch.mm(a, b),
        lambda a, b, c: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
        lambda a, b, c: torch.bmm(a[None], b[None]),
        lambda a, b, c: torch.baddbmm(c[None], a[None], b[None], beta=0.5),
        lambda a, b, c: torch.mm(a, b, out=torch.empty(c.shape, dtype=a.dtype)),
        lambda a, b, c: torch.nn.functional.linear(a, b.T, c[0]),
        lambda a, b, c: torch.einsum("ik,kj->ij", a, b),
    ],
    ids=["mm", "addmm", "bmm", "baddbmm", "mm.out", "linear", "einsum"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_matmuls_of_other_dtypes_pass_through_bitwise(op, dtype):
    a, b, c = (t.to(dtype) for t in operands("addmm"))
    recorder = Recorder()
    with recorder, fp32_matmuls() as mode:
        r = op(a, b, c)
    assert mode.calls == 0 and r.dtype == dtype
    assert torch.equal(r, op(a, b, c))
    assert all(dtype in d for f, d in recorder.seen if f.overloadpacket in MATMUL_FAMILY)


def test_non_matmul_ops_on_bf16_pass_through_bitwise():
    x, w = bf16(64, 48, seed=4), bf16(48, seed=5)

    def ops(x, w):
        y = torch.nn.functional.gelu(x * w + 1).softmax(-1)
        return [y, y.sum(0), torch.cumsum(x, 1), x.float().exp(), torch.cat((x, y)).square_()]

    recorder = Recorder()
    with recorder, fp32_matmuls() as mode:
        got = ops(x, w)
    assert mode.calls == 0
    for r, e in zip(got, ops(x, w), strict=True):
        assert r.dtype == e.dtype and torch.equal(r, e)
    assert all(f.overloadpacket not in MATMUL_FAMILY for f in recorder.ops())


def test_bf16_matmuls_on_another_device_are_left_to_its_kernels():
    # The meta device stands for any non-CPU device here (CUDA: the gpu-marked test below).
    a, b = torch.empty(16, 32, dtype=BF16, device="meta"), torch.empty(32, 8, dtype=BF16, device="meta")
    recorder = Recorder()
    with recorder, fp32_matmuls() as mode:
        r = torch.mm(a, b)
        torch.addmm(r, a, b, beta=0.5)
    assert mode.calls == 0 and r.dtype == BF16 and r.device.type == "meta"
    assert [f for f, d in recorder.bf16_matmuls()] == [aten.mm.default, aten.addmm.default]


@pytest.mark.gpu
def test_bf16_cuda_matmuls_are_left_to_cublas():
    a, b = bf16(64, 256, seed=6).cuda(), bf16(256, 32, seed=7).cuda()
    with fp32_matmuls() as mode:
        r = torch.mm(a, b)
    assert mode.calls == 0 and torch.equal(r, torch.mm(a, b))


def test_the_mode_is_popped_on_exit_and_on_an_error():
    assert not active()
    with fp32_matmuls():
        assert active()
    with pytest.raises(RuntimeError, match="planted"), fp32_matmuls():
        raise RuntimeError("planted")
    assert not active()


def test_the_mode_dispatches_without_dynamos_per_op_wrapper():
    # torch wraps a mode's __torch_dispatch__ in a Dynamo-disable context unless the mode opts out; the
    # wrapper's two frame-evaluator swaps were about half of what the mode adds to each op it sees.
    assert not hasattr(Fp32Bf16Matmuls.__dict__["__torch_dispatch__"], "__wrapped__")
    with fp32_matmuls() as mode:
        assert type(mode).__torch_dispatch__ is Fp32Bf16Matmuls.__dict__["__torch_dispatch__"]


# -- completeness: a whole training step --
@pytest.fixture(scope="module")
def step_under_the_mode():
    """A forward and backward of the tiny bf16 model (a small vocabulary, two MTP targets), one ANVIL + Adam
    step of AnvilAndAdam on its gradients, and an evaluation forward, all under the fp32 mode."""
    torch.manual_seed(0)
    model = GPT(load_config("tiny", vocab_size=1024))
    assert model.cfg.compute_dtype == "bfloat16"
    opt = AnvilAndAdam(
        list(model.named_parameters()),
        model.param_table(),
        model.scatter_order(),
        model.work_order(),
        OptimConfig(),  # the run's: the fused replicated Adam (its Triton kernel interpreted)
    )
    inputs, targets, cu = packed_batch([100, 156], vocab=1023)
    inputs[inputs == BOS], targets[targets == BOS] = 1023, 1023  # this vocabulary's BOS
    initial = copy.deepcopy(model.state_dict())
    recorder = Recorder()
    with recorder, fp32_matmuls() as mode:
        loss = model(inputs, targets, cu, (1, 2), [1.0, 0.5])
        loss.backward()
        opt.set_schedule(1.0, 0.9, 1)
        opt.step(do_adam=True)
        with torch.no_grad():
            val = model(inputs, targets, cu, (1, 2))
    assert torch.isfinite(loss) and torch.isfinite(val)
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, initial[k])]
    return recorder, mode, moved


def test_no_bf16_matmul_of_a_training_step_reaches_the_native_kernels(step_under_the_mode):
    recorder, mode, moved = step_under_the_mode
    assert {"qk_bank", "mlp_bank", "lm_head", "embed"} <= set(moved)  # ANVIL and Adam both updated
    assert recorder.bf16_matmuls() == []
    fp32_mm = [f for f, d in recorder.seen if f.overloadpacket in MATMUL_FAMILY and torch.float32 in d]
    assert mode.calls > 0 and aten.mm.default in fp32_mm  # the converted ones ran in fp32
    # The chunked loss's body was observed (its scatter_add_ occurs nowhere else), so its matmuls were too.
    assert aten.scatter_add_.default in recorder.ops()


def test_the_out_overloads_left_native_are_never_called(step_under_the_mode):
    # Only mm.out and addmm.out are converted; a bmm.out or baddbmm.out of any dtype would be a new caller.
    recorder, _, _ = step_under_the_mode
    assert not {aten.bmm.out, aten.baddbmm.out} & recorder.ops()


# -- the switch --
@pytest.mark.parametrize(
    ("setting", "device", "compiled", "native_gemm", "route"),
    [
        ("auto", "cpu", False, False, "fp32"),  # this CPU: no native bf16 GEMM
        ("auto", "cpu", True, False, "native"),  # torch.compile refuses the mode
        ("auto", "cpu", False, True, "native"),  # an AVX512-BF16 / AMX CPU
        ("auto", "cuda", False, False, "native"),
        ("native", "cpu", False, False, "native"),
        ("fp32", "cpu", False, True, "fp32"),
        ("fp32", "cuda", False, False, "native"),  # CUDA tensors are not the mode's anyway
    ],
)
def test_the_switch_resolves_by_device_compile_and_cpu_kind(
    setting, device, compiled, native_gemm, route, monkeypatch
):
    monkeypatch.setattr(cpu_bf16_matmul, "native_bf16_gemm", lambda: native_gemm)
    assert resolve(setting, device, compiled)[0] == route


def test_the_probe_asks_onednn_and_a_build_without_it_or_its_probe_counts_as_lacking_it(monkeypatch):
    assert cpu_bf16_matmul.native_bf16_gemm() == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # an AVX512-BF16 CPU
    assert cpu_bf16_matmul.native_bf16_gemm() is True
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a build without oneDNN
    assert cpu_bf16_matmul.native_bf16_gemm() is False
    monkeypatch.undo()

    def missing():
        raise AttributeError("no such op")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)  # a build without the probe
    assert cpu_bf16_matmul.native_bf16_gemm() is False


# docs/development.md measures the AVX2-only kind on an AVX512-BF16 CPU by capping oneDNN at AVX2; a run's
# route there must be the one an AVX2-only CPU takes. oneDNN reads the cap once, so a fresh process reads it.
ONEDNN_AVX2_PROBE = (
    "import torch; from track_1_short.cpu_bf16_matmul import native_bf16_gemm, resolve; "
    "print(native_bf16_gemm(), resolve('auto', 'cpu', False)[0])"
)


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the cap is oneDNN's; no oneDNN here")
def test_a_cpu_with_onednn_capped_at_avx2_lacks_native_bf16_gemm_and_takes_the_fp32_route():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", ONEDNN_AVX2_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "fp32"], out.stdout


ONE_OF = r"cpu_bf16_matmul='bf16' must be one of \['auto', 'native', 'fp32'\]"


def test_an_unknown_setting_is_refused_naming_the_values():
    with pytest.raises(ValueError, match=ONE_OF):
        resolve("bf16", "cpu", False)
