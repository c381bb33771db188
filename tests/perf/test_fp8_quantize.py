"""perf/kernels/fp8_quantize.py: the one-pass FP8 operand (both layouts, clip count, amax) against the torch
ops of model/fp8.py's quantize_both, bit for bit (under the interpreter on the CPU; ``gpu`` on CUDA)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.perf.compile_sm90 import compile_outside_the_interpreter
from track_1_short.model import fp8
from track_1_short.model.config import FP8Config
from track_1_short.model.fp8 import CLIP_AT, E4M3, E5M2, SITES, FP8State

CASES = [
    # (prologue, format, amax tracked, scale): every site's use in model/fp8.py
    (fp8.IDENTITY, E4M3, False, 2.0**-4),  # mlp.x, qkv.x
    (fp8.IDENTITY, E5M2, False, 2.0**-6),  # mlp.grad, qkv.grad
    (fp8.RELU_SQUARE, E4M3, True, 0.02),  # mlp.post
    (fp8.DRELU_SQUARE, E5M2, True, 2.0**-10),  # mlp.dpre
]


def _operands(seed: int, m: int, n: int, device: str):
    """bf16 [m, n] operands spanning the formats' whole range: normals, subnormals, saturating values, exact
    ties of the grid, zeros of both signs."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-24, 12, (m, n), generator=g).float())
    a[0, :8] = torch.tensor([0.0, -0.0, 12.5 * 2**-4, 7.86 * 2**-4, 500.0, -1e30, 2.0**-13, 3 * 2.0**-14])
    b = torch.randn(m, n, generator=g) * 4
    b[1, :3] = torch.tensor([-0.0, 0.0, -1.0])
    return a.bfloat16().to(device), b.bfloat16().to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("prologue", "fmt", "track", "scale"), CASES)
def test_kernel_equals_the_reference_bitwise(device, prologue, fmt, track, scale):
    m, n = 70, 130  # neither a multiple of the kernel's 64-wide tiles: its masked edges
    a, b = _operands(5, m, n, device)
    site = 3
    results = []
    for emulate in (True, False):
        clips = torch.zeros(2, len(SITES), dtype=torch.int64, device=device)
        clips[0, site] = 7  # counts add to what is there
        amax = torch.full((), 0.5, device=device) if track else None
        s = torch.tensor(scale, device=device)
        q, qt = fp8.quantize_both(a, b, s, fmt, clips, site, prologue, amax, emulate)
        results.append((q.view(torch.uint8), qt.view(torch.uint8), clips, amax))
    (q0, qt0, c0, a0), (q1, qt1, c1, a1) = results
    assert torch.equal(q0, q1)
    assert torch.equal(qt0, qt1)
    assert torch.equal(qt1, q1.t().contiguous())
    assert torch.equal(c0, c1)
    assert c1[0, site] > 7 and c1[1, site] == m * n  # the case saturates some elements
    if track:
        assert torch.equal(a0, a1)


def test_the_kernel_rounds_ties_to_even_and_keeps_the_sign_of_zero():
    # Stated from the e4m3 grid, not from torch: 12.5 lies between 12 and 13 (spacing 1 there), 12 is even;
    # 13.5 goes to 14; 2^-10 is half the subnormal step 2^-9 and goes to 0; -0 stays -0.
    x = torch.tensor([[12.5, 13.5, 2.0**-10, -0.0, 3 * 2.0**-10, 449.0, 470.0, -(2.0**-20)]]).bfloat16()
    clips = torch.zeros(2, len(SITES), dtype=torch.int64)
    q, _ = fp8.quantize_both(x, None, torch.tensor(1.0), E4M3, clips, 0, fp8.IDENTITY, None, False)
    assert q.float().tolist() == [[12.0, 14.0, 0.0, 0.0, 2.0**-8, 448.0, 448.0, 0.0]]
    assert q.view(torch.uint8)[0, 3] == 0x80 and q.view(torch.uint8)[0, 7] == 0x80  # -0 and a tiny negative
    assert clips[0, 0] == 1  # only 470 is beyond the clip threshold; 449 rounds to 448 anyway
    assert CLIP_AT[E4M3] == 464.0


_WQ = (torch.randn(96, 64, generator=torch.Generator().manual_seed(10)) * 0.1).bfloat16()  # a QKV weight


def _mlp_and_qkv(kernel: bool, monkeypatch, compiled: bool = False) -> list[torch.Tensor]:
    """The emulated FP8 MLP and QKV projection, forward and backward, with every activation and gradient
    quantised by the kernel or by the reference: outputs, gradients, clip counts and delayed amaxes."""
    monkeypatch.setattr(FP8State, "quantize_reference", property(lambda self: not kernel))
    g = torch.Generator().manual_seed(9)
    t, d, hidden = 70, 64, 192
    x = (torch.randn(t, d, generator=g) * 3).bfloat16().requires_grad_()
    w1 = (torch.randn(hidden, d, generator=g) * 0.1).bfloat16().requires_grad_()
    w2 = (torch.randn(hidden, d, generator=g) * 0.1).bfloat16().requires_grad_()
    wq = _WQ.clone().requires_grad_()
    gain = torch.tensor(0.7, requires_grad=True)
    st = FP8State(FP8Config(mlp=True, qkv=True), emulate=True)
    st.refresh(torch.stack((w1, w2)).detach()[None], {2: wq.detach()}, None)
    mlp, qkv_fn = (lambda x, w1, w2: st.mlp_forward(x, 0, w1, w2)), st.qkv_forward(2)
    if compiled:  # as the trainer's model runs them: Inductor, one graph each
        torch._dynamo.reset()
        mlp, qkv_fn = (torch.compile(f, fullgraph=True) for f in (mlp, qkv_fn))
    out = mlp(x, w1, w2)
    out.backward(torch.randn(t, d, generator=g).bfloat16() * 1e-3)
    qkv = qkv_fn(x, wq, gain)
    qkv.backward(torch.randn(t, 96, generator=g).bfloat16() * 1e-2)
    amaxes = [st.mlp["post_amax"][0], st.mlp["dpre_amax"][0]]
    return [out, qkv, x.grad, w1.grad, w2.grad, wq.grad, gain.grad, st.clip_counts(), *amaxes]


def test_the_fp8_paths_with_the_kernel_equal_them_with_the_reference_bitwise(monkeypatch):
    ref = _mlp_and_qkv(False, monkeypatch)
    got = _mlp_and_qkv(True, monkeypatch)
    for name, a, b in zip(
        ("out", "qkv", "dx", "dw1", "dw2", "dwq", "dgain", "clips", "post", "dpre"), ref, got
    ):
        assert torch.equal(a, b), name
    assert ref[7][0].sum() > 0  # something saturated, so the counts are compared where they matter


@pytest.mark.slow
def test_compiled_the_kernel_path_keeps_its_bits_and_its_counters(monkeypatch):
    # The kernel is an opaque op that writes the clip counters and the delayed amaxes in the forward and the
    # backward graphs: compiled, every output, gradient, counter and amax is still the eager run's.
    eager = _mlp_and_qkv(True, monkeypatch)
    compiled = _mlp_and_qkv(True, monkeypatch, compiled=True)
    torch._dynamo.reset()
    names = ("out", "qkv", "dx", "dw1", "dw2", "dwq", "dgain", "clips", "post", "dpre")
    for name, a, b in zip(names, eager, compiled):
        if name != "dgain":
            assert torch.equal(a, b), name
    # dgain is FP8Linear's fp32 sum of dW_eff * W over N x D = 96 x 64 terms, which Inductor adds in another
    # order: within (terms - 1) fp32 ulps of the sum of |terms|, taken here from the bf16 gradient dW_eff *
    # gain (its rounding, 2^-8, covered by the factor 2).
    dwq, gain = eager[5].float(), 0.7
    terms_abs = (dwq.abs() / gain * _WQ.abs()).sum()
    assert (eager[6] - compiled[6]).abs() <= 2 * (dwq.numel() - 1) * 2.0**-24 * terms_abs


_COMPILE_FOR_H100 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from track_1_short.model import fp8
    from track_1_short.perf.kernels.fp8_quantize import BLOCK, _quantize_both_kernel, grid_constants

    count = 0
    for prologue, fmt, track in ((0, fp8.E4M3, 0), (0, fp8.E5M2, 0), (1, fp8.E4M3, 1), (2, fp8.E5M2, 1)):
        q = "*fp8e4nv" if fmt == fp8.E4M3 else "*fp8e5"
        sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "q_ptr": q, "qt_ptr": q, "scale_ptr": "*fp32",
               "amax_ptr": "*fp32", "clips_ptr": "*i64"}
        sig.update(dict.fromkeys(("M", "N", "site", "n_sites"), "i32"))
        consts = {"PROLOGUE": prologue, **grid_constants(fmt), "CLIP": fp8.CLIP_AT[fmt],
                  "TRACK_AMAX": bool(track), "AS_BITS": False, "BM": BLOCK, "BN": BLOCK}
        sig.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(fn=_quantize_both_kernel, signature=sig, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert compiled.asm["cubin"], (prologue, fmt)
        count += 1
    print(f"compiled {count} variants")
    """
)


def test_the_kernel_compiles_for_the_h100_on_this_machine():
    # The interpreter accepts code Triton's compiler refuses: the GPU variants compiled here, with no GPU.
    proc = compile_outside_the_interpreter(_COMPILE_FOR_H100)
    assert proc.returncode == 0 and "compiled 4 variants" in proc.stdout, proc.stderr[-3000:]
