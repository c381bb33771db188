"""The symmetric Gram kernels (track_1_short/perf/kernels/sym_gram.py) and the ``optim.cascade_gram`` switch.

On the CPU the kernels run under Triton's interpreter (tests/conftest.py sets it), with small tiles so that
small shapes still cover several tiles, partial tiles and the mirror; the ``gpu`` tests run them compiled at
the track-1 bank shapes.

The bound. Each output element is an fp32 sum of exact products (bf16 x bf16 is exact in fp32) rounded once
to bf16; the reference is the same sum in another order, rounded once. Two fp32 sums of the same K products
differ by at most 2 K u S (u = 2^-24, S = sum_k |x_pk x_qk|, each order within K u S of the exact sum), and
each rounding to bf16 moves a value by at most half an ulp of the larger of the two results. So
|out - ref| <= ulp(max(|out|, |ref|)) + 2 K u S elementwise: one bf16 ulp where the sum does not cancel, more
only where it does (then S is much larger than the result).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.perf.compile_sm90 import compile_outside_the_interpreter
from track_1_short.optim import anvil, anvil_bank
from track_1_short.optim.anvil import AnvilAndAdam, OptimConfig
from track_1_short.optim.polar_express import orthogonalize
from track_1_short.perf.kernels import sym_gram as K

gpu = pytest.mark.gpu
U32 = 2.0**-24
SMALL = dict(block=16, block_k=16)  # tl.dot's least tile: s = 37 spans three tiles, the last partial
BANK_SHAPES = {"qk": (48, 256, 768), "vo": (16, 768, 768), "mlp": (24, 2816, 768)}


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |t| (fp64): 2^(e - 8) for |t| in [2^(e-1), 2^e); at 0 the least normal's."""
    t = t.double().abs().clamp_min(2.0**-126)
    _, e = torch.frexp(t)
    return torch.ldexp(torch.ones_like(t), e - 8)


def assert_rounding_close(out: torch.Tensor, ref: torch.Tensor, fp32_err: torch.Tensor) -> None:
    """|out - ref| <= ulp(max(|out|, |ref|)) + fp32_err elementwise (the module docstring says why)."""
    o, r = out.double(), ref.double()
    bound = bf16_ulp(torch.maximum(o.abs(), r.abs())) + fp32_err.double()
    excess = (o - r).abs() - bound
    assert bool((excess <= 0).all()), f"{int((excess > 0).sum())} elements out of bound, worst {excess.max()}"


def gram_fp32(x: torch.Tensor, tall: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the fp32 Gram, its accumulation bound 2 K u |X|^T|X| (either order), K)."""
    xf = x.float()
    xa = xf.abs().double()
    if tall:
        ref, s_abs, k = xf.mT @ xf, xa.mT @ xa, x.size(-2)
    else:
        ref, s_abs, k = xf @ xf.mT, xa @ xa.mT, x.size(-1)
    return ref, 2 * k * U32 * s_abs, k


def nan_out(batch: int, s: int, device="cpu") -> torch.Tensor:
    # NaN everywhere first: an element the kernel never writes fails every check below.
    return torch.full((batch, s, s), float("nan"), dtype=torch.bfloat16, device=device)


GRAM_CASES = [
    pytest.param((2, 70, 37), True, id="tall-partial-tiles"),
    pytest.param((3, 37, 70), False, id="wide-partial-tiles"),
    pytest.param((1, 48, 48), False, id="square-whole-tiles"),
    pytest.param((2, 9, 5), True, id="smaller-than-a-tile"),
]


@pytest.mark.parametrize("shape, tall", GRAM_CASES)
def test_gram_is_exactly_symmetric_and_within_rounding_of_the_fp32_product(shape, tall):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).bfloat16()
    s = shape[2] if tall else shape[1]
    out = K.gram_(x, nan_out(shape[0], s), tall, **SMALL)
    assert torch.equal(out, out.mT)  # bitwise: NaN-free too, since NaN != NaN
    ref, err, _ = gram_fp32(x, tall)
    assert_rounding_close(out, ref.bfloat16(), err)
    bmm = torch.bmm(x.mT, x) if tall else torch.bmm(x, x.mT)
    assert_rounding_close(out, bmm, err)


def test_gram_rounds_once_to_nearest_even():
    # K = 1: every entry is one exact product x_p x_q (in fp32), so no summation order is involved and the
    # result must be exactly its round-to-nearest-even bf16 (truncation would be up to 1 ulp off).
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 1, 37, generator=gen).bfloat16()
    out = K.gram_(x, nan_out(2, 37), True, **SMALL)
    assert torch.equal(out, (x.float().mT @ x.float()).bfloat16())


def test_gram_default_tiles_and_the_custom_op_agree_with_the_small_tiles():
    # One 128 x 128 tile covers s = 37 here: the default path, and the op the cascade calls.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 90, 37, generator=gen).bfloat16()
    small = K.gram_(x, nan_out(2, 37), True, **SMALL)
    default = K.gram_(x, nan_out(2, 37), True)
    op = torch.ops.track_1_short.sym_gram(x, True)
    ref, err, _ = gram_fp32(x, True)
    for out in (default, op):
        assert torch.equal(out, out.mT)
        assert_rounding_close(out, ref.bfloat16(), err)
    assert torch.equal(default, op)
    assert_rounding_close(small, default, 2 * err)


def test_gram_reads_strided_inputs():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 40, 70, generator=gen).bfloat16().mT  # [2, 70, 40], not contiguous
    out = K.gram_(x, nan_out(2, 40), True, **SMALL)
    ref, err, _ = gram_fp32(x, True)
    assert torch.equal(out, out.mT)
    assert_rounding_close(out, ref.bfloat16(), err)


def test_zero_matrix_gives_exact_zeros():
    x = torch.zeros(2, 37, 21, dtype=torch.bfloat16)
    x[1].normal_()
    out = K.gram_(x, nan_out(2, 21), True, **SMALL)
    assert torch.equal(out[0], torch.zeros(21, 21, dtype=torch.bfloat16))
    assert bool(out[1].diagonal().gt(0).all())


@pytest.mark.parametrize("s", [37, 48, 7])
def test_sym_poly_is_exactly_symmetric_and_within_rounding_of_the_fp32_polynomial(s):
    gen = torch.Generator().manual_seed(s)
    x = torch.randn(3, s + 13, s, generator=gen).bfloat16()
    a = torch.bmm(x.mT, x)
    a = (a.float() / a.float().diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1)).bfloat16()  # ||A|| <= 1
    a = torch.triu(a) + torch.triu(a, 1).mT  # exactly symmetric, as the cascade's Gram is
    b, c = -3.685181239622, 1.417196497642  # a round of ANVIL_MAPS
    out = K.sym_poly_(a, nan_out(3, s), b, c, **SMALL)
    assert torch.equal(out, out.mT)
    af, aa = a.float(), a.abs().double()
    prod = af @ af
    ref = (b * af + c * prod).bfloat16()  # fp32 throughout, one rounding
    # The product's two orders differ by 2 s u |c| (|A||A|); the fp32 scale-and-add rounds each side at most
    # three times (c * acc, b * a, the sum): 2 * 3 u (|b A| + |c A A|) between the two.
    err = 2 * s * U32 * abs(c) * (aa @ aa) + 6 * U32 * (abs(b) * aa + abs(c) * prod.abs().double())
    assert_rounding_close(out, ref, err)
    assert_rounding_close(out, torch.baddbmm(a, a, a, beta=b, alpha=c), err)
    op = torch.ops.track_1_short.sym_poly(a, b, c)
    assert torch.equal(op, op.mT)
    assert_rounding_close(op, ref, err)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: K.gram_(torch.zeros(4, 4, dtype=torch.bfloat16), nan_out(1, 4), True), "gram_"),
        (lambda: K.gram_(torch.zeros(1, 4, 6), nan_out(1, 6), True), "bf16"),
        (lambda: K.gram_(torch.zeros(1, 4, 6, dtype=torch.bfloat16), nan_out(1, 4), True), "out must be"),
        (lambda: K.sym_poly_(torch.zeros(1, 4, 6, dtype=torch.bfloat16), nan_out(1, 4), 1.0, 1.0), "square"),
        (lambda: K.gram_(torch.zeros(1, 4, 6, dtype=torch.bfloat16), nan_out(1, 6), True, block=24), "block"),
    ],
)
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_an_output_sharing_the_input_is_refused():
    a = torch.eye(4, dtype=torch.bfloat16)[None].clone()
    with pytest.raises(ValueError, match="shares storage"):
        K.sym_poly_(a, a, 1.0, 1.0)


def test_without_the_interpreter_a_cpu_tensor_is_refused(monkeypatch):
    monkeypatch.setattr(K, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="cascade_gram=bmm"):
        K.check_device("cpu", "optim.cascade_gram=triton")
    K.check_device("cuda", "optim.cascade_gram=triton")  # a CUDA device is always served


# -- the cascade --
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=(-2, -1)) / b.norm(dim=(-2, -1))).max())


@pytest.mark.parametrize("shape", [(3, 96, 40), (2, 40, 96), (1, 64, 64)])
def test_cascade_with_the_kernels_matches_the_bmm_cascade(shape):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen).bfloat16()
    ref = orthogonalize(x, gram="bmm")
    out = orthogonalize(x, gram="triton")
    # The bound tests/optim/test_polar_express.py accepts between two routes through the cascade that round
    # differently (each within 0.5% of the exact map in spectrum): 2% of the matrix norm.
    assert rel_err(out, ref) < 2e-2
    s_in = torch.linalg.svdvals(x.double())
    s_in = s_in / (1.05 * x.double().norm(dim=(-2, -1), keepdim=True).squeeze(-1))
    s_out = torch.linalg.svdvals(out.double())
    lifted = s_in >= 3e-3
    assert float(s_out[lifted].min()) > 0.99 and float(s_out.max()) < 1.01  # that file's band


def test_cascade_refuses_an_unknown_gram():
    with pytest.raises(ValueError, match="gram='cublas'"):
        orthogonalize(torch.zeros(1, 4, 4, dtype=torch.bfloat16), gram="cublas")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cascade_with_the_kernels_compiles_whole(backend):
    # optim.bank_update=compiled traces the cascade with fullgraph=True: the kernels' ops must not break it.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 48, 24, generator=gen).bfloat16()
    compiled = torch.compile(orthogonalize, backend=backend, fullgraph=True, dynamic=False)
    # The ops run the same kernel inside and outside the graph; only the fp32 scaling around them may be
    # fused differently by Inductor.
    assert rel_err(compiled(x, 1.05, "triton"), orthogonalize(x, gram="triton")) < 1e-2
    torch._dynamo.reset()


# -- the switch --
def test_config_refuses_an_unknown_cascade_gram_by_name():
    with pytest.raises(
        ValueError,
        match=r"optim\.cascade_gram='cuda'.*\['bmm', 'triton', 'folded', 'squared', 'gram_space'\]",
    ):
        OptimConfig(cascade_gram="cuda")


def _bank_table(shape):
    table = {
        "bank": {
            "optim": "anvil",
            "comms": "sharded",
            "adam_betas": None,
            "lr_mul": 1.0,
            "wd_mul": 1.0,
            "reshape": list(shape),
            "matrix_lr_mul": None,
        }
    }
    p = torch.nn.Parameter((torch.randn(shape) * 0.02).bfloat16())
    p.label = "bank"
    return [("bank", p)], table


@pytest.mark.parametrize(
    "gram, route",
    [
        ("bmm", "bmm"),
        ("triton", "triton"),
        ("folded", "folded"),
        ("squared", "squared"),
        ("gram_space", "squared"),
    ],
)
def test_cascade_gram_reaches_the_bank_update_and_orthogonalize(gram, route, monkeypatch):
    # gram_space reaches a bank of 24 x 16 matrices as squared (polar_express.route_for: aspect 1.5).
    seen = []
    real = anvil_bank.orthogonalize

    def spy(x, margin, g="bmm"):
        seen.append(g)
        return real(x, margin, g)

    monkeypatch.setattr(anvil_bank, "orthogonalize", spy)
    named, table = _bank_table((2, 24, 16))
    opt = AnvilAndAdam(named, table, ["bank"], ["bank"], OptimConfig(cascade_gram=gram))
    assert opt.banks["bank"].constants["gram"] == route
    named[0][1].grad = torch.randn(2, 24, 16).bfloat16()
    opt.step(do_adam=False)
    assert seen == [route]


def test_triton_cascade_gram_is_refused_at_construction_where_the_kernels_cannot_run(monkeypatch):
    from track_1_short.perf.kernels import sym_gram

    monkeypatch.setattr(sym_gram, "interpreted", lambda: False)
    named, table = _bank_table((2, 24, 16))
    with pytest.raises(RuntimeError, match=r"optim\.cascade_gram=triton"):
        AnvilAndAdam(named, table, ["bank"], ["bank"], OptimConfig(cascade_gram="triton"))
    assert anvil.CASCADE_GRAMS == ("bmm", "triton", "folded", "squared", "gram_space")


def test_triton_cascade_gram_with_the_compiled_bank_update(monkeypatch):
    from track_1_short.perf import bank_compile

    monkeypatch.setattr(bank_compile, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    steps = {}
    for gram in ("bmm", "triton"):
        torch.manual_seed(0)
        named, table = _bank_table((2, 24, 16))
        start = named[0][1].detach().clone()
        opt = AnvilAndAdam(
            named, table, ["bank"], ["bank"], OptimConfig(cascade_gram=gram, bank_update="compiled")
        )
        named[0][1].grad = torch.randn(2, 24, 16).bfloat16()
        opt.step(do_adam=False)
        steps[gram] = named[0][1].detach().double() - start.double()
    torch._dynamo.reset()
    assert steps["bmm"].abs().sum() > 0
    # The step is eff_lr * (cascade output), plus the decay (the same for both): the two routes' steps differ
    # as their cascades do (2%, above).
    assert rel_err(steps["triton"], steps["bmm"]) < 2e-2


# -- CUDA, the track-1 bank shapes (pytest -m gpu) --
@gpu
@pytest.mark.parametrize("bank", list(BANK_SHAPES))
def test_gpu_gram_at_the_bank_shapes_matches_bmm_within_rounding(bank):
    b, rows, cols = BANK_SHAPES[bank]
    tall = rows > cols
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, rows, cols, generator=gen, device="cuda").bfloat16()
    s = cols if tall else rows
    out = K.gram_(x, nan_out(b, s, "cuda"), tall)
    assert torch.equal(out, out.mT)
    xd = x.double()
    ref = xd.mT @ xd if tall else xd @ xd.mT  # exact: products of bf16 and sums of K <= 2816 in fp64
    xa = xd.abs()
    # Twice the CPU bound: tensor cores may truncate inside their fp32 adds (up to 1 ulp an add, not half).
    err = 4 * (rows if tall else cols) * U32 * (xa.mT @ xa if tall else xa @ xa.mT)
    assert_rounding_close(out, ref.float().bfloat16(), err)
    # cuBLAS may reduce split-K partial sums in bf16 unless told not to; with it off, bmm makes the same
    # contract as the kernel (fp32 accumulation, one rounding).
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        bmm = torch.bmm(x.mT, x) if tall else torch.bmm(x, x.mT)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
    assert_rounding_close(out, bmm, err)
    # The polynomial on this Gram, normalised as the cascade does.
    a = (out.float() / out.float().diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1)).bfloat16()
    bc, cc = -3.685181239622, 1.417196497642
    poly = K.sym_poly_(a, nan_out(b, s, "cuda"), bc, cc)
    assert torch.equal(poly, poly.mT)
    ad = a.double()
    aa = ad.abs()
    prod = ad @ ad
    ref_p = (bc * ad + cc * prod).float().bfloat16()
    # fp32 accumulation of the product (2 s u |c| |A||A|, tensor-core adds as above) and up to three fp32
    # roundings of the epilogue (an fma on the GPU rounds fewer).
    err_p = 4 * s * U32 * abs(cc) * (aa @ aa) + 6 * U32 * (abs(bc) * aa + abs(cc) * prod.abs())
    assert_rounding_close(poly, ref_p, err_p)


@gpu
@pytest.mark.parametrize("bank", list(BANK_SHAPES))
def test_gpu_cascade_with_the_kernels_matches_the_bmm_cascade(bank):
    b, rows, cols = BANK_SHAPES[bank]
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(b, rows, cols, generator=gen, device="cuda").bfloat16()
    ref = orthogonalize(x, gram="bmm")
    out = orthogonalize(x, gram="triton")
    assert rel_err(out, ref) < 2e-2  # the bound of the CPU test above
    s_in = torch.linalg.svdvals(x.double())
    s_in = s_in / (1.05 * x.double().norm(dim=(-2, -1), keepdim=True).squeeze(-1))
    s_out = torch.linalg.svdvals(out.double())
    lifted = s_in >= 3e-3
    assert float(s_out[lifted].min()) > 0.99 and float(s_out.max()) < 1.01


@gpu
def test_gpu_cascade_with_the_kernels_compiles_whole_with_inductor():
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4, 256, 768, generator=gen, device="cuda").bfloat16()
    compiled = torch.compile(orthogonalize, fullgraph=True, dynamic=False)
    assert rel_err(compiled(x, 1.05, "triton"), orthogonalize(x, gram="triton")) < 1e-2
    torch._dynamo.reset()


_COMPILE_FOR_H200 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tests.perf.compile_sm90 import assert_pipelined, spill_bytes
    from track_1_short.perf.kernels import sym_gram as k

    ints = ["s", "k_len", "x_batch_stride", "x_s_stride", "x_k_stride", "out_batch_stride", "out_row_stride",
            "out_col_stride"]
    sig = {"x_ptr": "*bf16", "out_ptr": "*i16", **dict.fromkeys(ints, "i32"), "b_coef": "fp32",
           "c_coef": "fp32"}
    names = list(sig)
    built = 0
    # What a launch on the record's banks specializes on: a unit stride (along the sum for X X^T and the
    # polynomial, between the product's rows for X^T X) and every other size and stride a multiple of 16.
    # The polynomial's coefficients come as fp32 from a plain launch and as fp64 from Inductor.
    variants = [(False, "x_k_stride", "fp32"), (False, "x_s_stride", "fp32"), (True, "x_k_stride", "fp32"),
                (True, "x_k_stride", "fp64")]
    for poly, unit, coef in variants:
        sig.update(b_coef=coef, c_coef=coef)
        consts = {unit: 1, "out_col_stride": 1, "POLY": poly, "WIDEN": False, "BLOCK": k.DEFAULT_BLOCK,
                  "BLOCK_K": k.DEFAULT_BLOCK_K}
        aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in consts
                   and n not in ("b_coef", "c_coef")}
        src = ASTSource(fn=k._sym_gram_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                        constexprs=consts, attrs=aligned)
        opts = {"num_warps": k.DEFAULT_NUM_WARPS, "num_stages": k.DEFAULT_NUM_STAGES}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        assert "wgmma" in compiled.asm["ptx"], ("no Hopper tensor-core instructions", poly, unit, coef)
        assert compiled.metadata.shared <= 232448, ("over an H100/H200 block's shared memory", poly, unit)
        assert_pipelined(compiled, k.DEFAULT_NUM_STAGES, poly, unit, coef)
        assert spill_bytes(compiled) == 0, ("registers spilled", poly, unit, coef)
        built += 1
    print(f"compiled {built} variants")
    """
)


def test_the_kernel_compiles_for_the_h200_with_hopper_tensor_core_instructions():
    # The interpreter runs the WIDEN variant; the GPU's (bf16 tiles straight into tl.dot) is compiled here to
    # an sm_90 cubin with the wheel's own ptxas, at the default tiles, and its PTX must use wgmma.
    proc = compile_outside_the_interpreter(_COMPILE_FOR_H200)
    assert proc.returncode == 0 and "compiled 4 variants" in proc.stdout, proc.stderr[-3000:]
