"""The per-matrix bf16 division kernel (track_1_short/perf/kernels/bf16_div.py) and its use by the cascade's
normalisation (polar_express.scaled_to_bf16). On the CPU the kernel runs under Triton's interpreter (tests/
conftest.py sets it); the ``gpu`` tests run it compiled, where Triton's ``/`` would not be IEEE division."""

from __future__ import annotations

import pytest
import torch

from track_1_short.optim import polar_express
from track_1_short.perf.kernels import bf16_div

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


def _torch_div(t: torch.Tensor, divisor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.div(t, divisor, out=torch.empty_like(t, dtype=dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16)


def _inputs(shape, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 values over 2^-130 .. 2^100 with zeros of both signs, and per-matrix divisors from 2^-100 to
    2^100: quotients that overflow to inf, fall below fp32's normal range, and round at every position."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-130, 100, shape, generator=gen).float()
    t = (torch.randn(shape, generator=gen) * torch.exp2(exponent)).bfloat16()
    flat = t.view(-1)
    if flat.numel() >= 4:
        flat[:4] = torch.tensor([0.0, -0.0, 1.0, -3.0])
    divisor = torch.exp2(torch.randint(-100, 100, (shape[0], 1, 1), generator=gen).float())
    divisor *= 1 + torch.rand(shape[0], 1, 1, generator=gen)  # not a power of two: the quotient rounds
    return t.to(device), divisor.to(device)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 37, 53), (2, 70, 70), (1, 1, 1), (0, 5, 5), (2, 0, 4)])
def test_division_has_the_bits_of_torch_div(shape, device):
    # (3, 37, 53): a matrix shorter than one block; (2, 70, 70): two blocks a matrix, the second partial.
    t, divisor = _inputs(shape, seed=sum(shape), device=device)
    out = bf16_div.div_(t, divisor, torch.empty_like(t))
    assert torch.equal(_bits(out), _bits(_torch_div(t, divisor)))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "in_dtype, out_dtype",
    [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_fp16_in_or_out_has_the_bits_of_torch_div(in_dtype, out_dtype, device):
    # The Gram-space cascade's changes of precision. The bf16 inputs' range overflows fp16 (inf in, inf out)
    # and its quotients round to fp16 normals, subnormals, zero and inf.
    gen = torch.Generator().manual_seed(9)
    shape = (3, 37, 53)
    # Values over 2^-40 .. 2^40, divisors 2^-10 .. 2^10, not powers of two: quotients across fp16's range
    # (normals 2^-14 .. 2^16) and beyond it at both ends.
    t = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-40, 40, shape, generator=gen).float())
    t = t.to(in_dtype).to(device)
    divisor = torch.exp2(torch.randint(-10, 10, (3, 1, 1), generator=gen).float())
    divisor = (divisor * (1 + torch.rand(3, 1, 1, generator=gen))).to(device)
    out = bf16_div.div_(t, divisor, torch.empty_like(t, dtype=out_dtype))
    want = _torch_div(t, divisor, out_dtype)
    assert out.dtype == out_dtype and torch.equal(_bits(out), _bits(want))
    finite = want.float().isfinite() & (want.float() != 0)
    assert finite.float().mean() > 0.3 and not bool(finite.all())  # the range's ends and its middle


@pytest.mark.parametrize("device", DEVICES)
def test_quotients_at_bf16_ties_round_as_torch_div_rounds_them(device):
    # Random quotients round to bf16 the same way whatever the last fp32 bit: these sit within an fp32 ulp
    # of a point halfway between two bf16 numbers, where only the correctly rounded fp32 quotient (div_rn)
    # gives torch's bf16. One divisor a matrix, so each matrix is one such case: t / d with d the fp32
    # nearest to t / tie.
    gen = torch.Generator().manual_seed(12)
    n = 512  # programs: the interpreter runs them one by one
    t = (torch.randn(n, generator=gen) * 4).bfloat16()
    t[t == 0] = 1.0
    tie_bits = (torch.randn(n, generator=gen).bfloat16().float().view(torch.int32) | 0x8000).view(
        torch.float32
    )
    divisor = (t.double() / tie_bits.double()).float()
    t, divisor = t.view(n, 1, 1).to(device), divisor.view(n, 1, 1).to(device)
    out = bf16_div.div_(t, divisor, torch.empty_like(t))
    assert torch.equal(_bits(out), _bits(_torch_div(t, divisor)))


@gpu
@pytest.mark.parametrize("shape", [(24, 768, 768), (16, 768, 768), (48, 256, 256), (24, 2816, 768)])
def test_division_has_the_bits_of_torch_div_at_the_bank_shapes(shape):
    # The cascade divides the Gram matrices (s x s) and, in the reference route, X itself.
    t, divisor = _inputs(shape, seed=shape[0], device="cuda")
    out = bf16_div.div_(t, divisor, torch.empty_like(t))
    assert torch.equal(_bits(out), _bits(_torch_div(t, divisor)))
    # The Gram-space cascade: its first Gram into fp16, each segment's product back into bf16.
    half = bf16_div.div_(t, divisor, torch.empty_like(t, dtype=torch.float16))
    assert torch.equal(_bits(half), _bits(_torch_div(t, divisor, torch.float16)))
    back = bf16_div.div_(half, divisor, torch.empty_like(t))
    assert torch.equal(_bits(back), _bits(_torch_div(half, divisor, torch.bfloat16)))


def test_nan_comes_out_as_a_nan():
    t = torch.tensor([[[float("nan"), 1.0]]], dtype=torch.bfloat16)
    out = bf16_div.div_(t, torch.ones(1, 1, 1), torch.empty_like(t))
    assert bool(out[0, 0, 0].isnan()) and float(out[0, 0, 1]) == 1.0


@pytest.mark.parametrize(
    ("t", "divisor", "match"),
    [
        (torch.zeros(2, 4, 6, dtype=torch.bfloat16).mT, torch.ones(2, 1, 1), "contiguous bf16"),
        (torch.zeros(2, 4, 4), torch.ones(2, 1, 1), "contiguous bf16"),
        (torch.zeros(2, 4, 4, dtype=torch.bfloat16), torch.ones(2, 1, 1).double(), "fp32"),
        (torch.zeros(2, 4, 4, dtype=torch.bfloat16), torch.ones(1, 1, 1), r"\[B, 1, 1\]"),
    ],
)
def test_inputs_the_kernel_does_not_take_are_refused_naming_torch_div(t, divisor, match):
    out = torch.full(t.shape, 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match) as raised:
        bf16_div.div_(t, divisor, out)
    assert "torch.div" in str(raised.value)
    assert bool((out == 7.0).all())  # nothing written


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16])
def test_an_out_the_kernel_cannot_write_is_refused(dtype):
    t = torch.ones(2, 4, 4, dtype=torch.bfloat16)
    out = torch.full(t.shape, 7, dtype=dtype)
    with pytest.raises(ValueError, match="out must be a contiguous bf16 or fp16"):
        bf16_div.div_(t, torch.ones(2, 1, 1), out)
    assert bool((out == 7).all())  # nothing written


def test_the_kernel_is_refused_off_cuda_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(bf16_div, "_INTERPRETED", False)
    t = torch.zeros(1, 2, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="torch.div"):
        bf16_div.div_(t, torch.ones(1, 1, 1), torch.empty_like(t))


def _spy(monkeypatch) -> list[tuple]:
    calls = []
    real = bf16_div.launch_

    def spy(t, divisor, out):
        calls.append(tuple(t.shape))
        return real(t, divisor, out)

    monkeypatch.setattr(bf16_div, "launch_", spy)
    return calls


def test_scaled_to_bf16_keeps_torch_div_on_the_cpu(monkeypatch):
    calls = _spy(monkeypatch)
    t, divisor = _inputs((2, 8, 8), seed=5, device="cpu")
    assert torch.equal(_bits(polar_express.scaled_to_bf16(t, divisor)), _bits(_torch_div(t, divisor)))
    assert calls == []


@gpu
def test_scaled_to_bf16_takes_the_kernel_on_cuda_and_keeps_torch_div_where_it_cannot(monkeypatch):
    calls = _spy(monkeypatch)
    t, divisor = _inputs((4, 96, 40), seed=6, device="cuda")
    assert torch.equal(_bits(polar_express.scaled_to_bf16(t, divisor)), _bits(_torch_div(t, divisor)))
    assert calls == [(4, 96, 40)]
    strided = t.mT  # not contiguous: torch.div, the same bits
    assert torch.equal(
        _bits(polar_express.scaled_to_bf16(strided, divisor)), _bits(_torch_div(strided, divisor))
    )
    assert calls == [(4, 96, 40)]
    # The whole cascade, every route, on the GPU: the same bits with the kernel as with torch.div.
    x = torch.randn(3, 96, 40, device="cuda").bfloat16()
    for gram in ("bmm", "folded", "squared", "gram_space"):
        with_kernel = orthogonalize_with(x, gram, monkeypatch, kernel=True)
        without = orthogonalize_with(x, gram, monkeypatch, kernel=False)
        assert torch.equal(_bits(with_kernel), _bits(without)), gram


def orthogonalize_with(x, gram, monkeypatch, kernel: bool):
    with monkeypatch.context() as patch:
        if not kernel:
            patch.setattr(bf16_div, "supports", lambda t, divisor: False)
        return polar_express.orthogonalize(x, gram=gram)
