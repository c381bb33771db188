"""perf/kernels/fp8_relu2_mlp.py (``model.fp8.mlp_impl=triton``): the FP8 MLP's up-projection GEMMs with the
activation and its quantise in their epilogues, against model/fp8.py's ``fp8_mm`` then ``quantize_both``.

On the CPU the kernels run in Triton's interpreter at their GPU tile (128 x 256 x 128); the shapes here end
short of it in every direction. The FP8 operands are small integers (times a scale), so every fp32 sum of
their products is exact whatever its order: both sides hold the same accumulators, and what is compared is
the epilogue, bit for bit.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.call_counts import count_calls
from tests.model.conftest import needs_fp8_gpu
from tests.perf.compile_sm90 import compile_outside_the_interpreter
from track_1_short.model import fp8
from track_1_short.model.config import FP8Config, ModelConfig, ModelConfigError
from track_1_short.model.fp8 import CLIP_AT, E4M3, E5M2, SITE, SITES, FP8State, fp8_mm, quantize_both
from track_1_short.perf.kernels import fp8_relu2_mlp as kernels
from track_1_short.perf.kernels.fp8_relu2_mlp import fp8_relu2_up, fp8_relu2_up_grad

T, D, H = (
    304,
    144,
    528,
)  # 3 row tiles (the last 48 rows), 3 column tiles (the last 16), 2 K steps (the last 16)


def _ints(*shape, high: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high + 1, shape, generator=g).float()


def _operands(seed: int = 0):
    """e4m3 x and weights, e5m2 g: integers up to 15 (7 for e5m2: both formats hold them exactly), the
    weights times 448 / 15 (the grid from 30 to 448 in steps of 2 or more), so every product is an even
    integer and every sum of D of them is below 2^24: exact in fp32."""
    xq = _ints(T, D, high=15, seed=seed).to(E4M3)
    w1q = (_ints(H, D, high=15, seed=seed + 1) * 448 / 15).to(E4M3)
    w2q = (_ints(H, D, high=15, seed=seed + 2) * 448 / 15).to(E4M3)
    gq = _ints(T, D, high=7, seed=seed + 3).to(E5M2)
    return xq, w1q, w2q, gq


SCALES = {"x": 2.0**-4, "w1": 0.004, "w2": 0.003, "g": 2.0**-6, "post": 0.05, "dpre": 2.0**-12}


def _both_ways(kernel: bool, xq, w1q, w2q, gq):
    """pre, post (both layouts), dpre (both layouts), the clip counts and the two amaxes, by the kernels or by
    the reference's GEMM then quantise (emulated: fp32 GEMM of the FP8 values)."""
    s = {k: torch.tensor(v) for k, v in SCALES.items()}
    clips = torch.zeros(2, len(SITES), dtype=torch.int64)
    post_amax, dpre_amax = torch.zeros(()), torch.zeros(())
    if kernel:
        pre, pq, pqt = fp8_relu2_up(
            xq, w1q, s["x"], s["w1"], s["post"], post_amax, clips, SITE["mlp.post"], CLIP_AT[E4M3]
        )
        dq, dqt = fp8_relu2_up_grad(
            gq, w2q, s["g"], s["w2"], pre, s["dpre"], dpre_amax, clips, SITE["mlp.dpre"], CLIP_AT[E5M2]
        )
    else:
        pre = fp8_mm(xq, w1q.t(), s["x"], s["w1"], torch.bfloat16, True, True)
        pq, pqt = quantize_both(
            pre, None, s["post"], E4M3, clips, SITE["mlp.post"], fp8.RELU_SQUARE, post_amax, True
        )
        dpost = fp8_mm(gq, w2q.t(), s["g"], s["w2"], torch.bfloat16, False, True)
        dq, dqt = quantize_both(
            dpost, pre, s["dpre"], E5M2, clips, SITE["mlp.dpre"], fp8.DRELU_SQUARE, dpre_amax, True
        )
    return {"pre": pre, "post": pq, "post_t": pqt, "dpre": dq, "dpre_t": dqt, "clips": clips,
            "post_amax": post_amax, "dpre_amax": dpre_amax}  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


def test_both_kernels_give_the_references_bits_where_the_gemm_is_exact():
    ops = _operands()
    got, want = _both_ways(True, *ops), _both_ways(False, *ops)
    for name in want:
        assert torch.equal(_bits(got[name]), _bits(want[name])), name
    # the comparison reaches every branch: both relu branches, saturation of both formats, subnormals
    pre, clips = want["pre"], want["clips"]
    assert (pre < 0).any() and (pre > 0).any()
    assert clips[0, SITE["mlp.post"]] > 0 and clips[0, SITE["mlp.dpre"]] > 0
    assert clips[1, SITE["mlp.post"]] == clips[1, SITE["mlp.dpre"]] == T * H  # each element seen once
    assert (want["post"].float().abs() < 2.0**-6).logical_and(want["post"].float() != 0).any()  # subnormal


def _mlp(impl: str, x, w1, w2, g, compiled: bool = False):
    """The emulated FP8 MLP (slot 0 of a one-slot bank) forward and backward with fp8.mlp_impl=impl: the
    output, the three gradients, the clip counts and the two amaxes."""
    st = FP8State(FP8Config(mlp=True, mlp_impl=impl), emulate=True)
    st.refresh(torch.stack((w1, w2))[None], None, None)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    fn = lambda x, w1, w2: st.mlp_forward(x, 0, w1, w2)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
    out = fn(*leaves)
    out.backward(g)
    m = st.mlp
    return [out.detach(), *(t.grad for t in leaves), st.clip_counts(), m["post_amax"][0], m["dpre_amax"][0]]


def _exact_mlp_inputs():
    # x on x's static scale's integers; the weights' exact scales (amax / 448 at the first refreshes) then
    # give the weights' FP8 values 448 / 15 times integers; g on its static scale's integers
    x = (_ints(T, D, high=15, seed=20) * 2.0**-4).bfloat16()
    w1 = (_ints(H, D, high=15, seed=21) * 2.0**-5).bfloat16()
    w2 = (_ints(H, D, high=15, seed=22) * 2.0**-5).bfloat16()
    g = (_ints(T, D, high=7, seed=23) * fp8.MLP_GRAD_SCALE).bfloat16()
    for w in (w1, w2):
        w[0, 0] = 15 * 2.0**-5  # the amax the exact scale is taken from
    return x, w1, w2, g


def test_the_fp8_mlp_on_the_fused_kernels_trains_as_on_scaled_mm_bit_for_bit(monkeypatch):
    calls = count_calls(monkeypatch, kernels, ("fp8_relu2_up", "fp8_relu2_up_grad"))
    x, w1, w2, g = _exact_mlp_inputs()
    want = _mlp("scaled_mm", x, w1, w2, g)
    assert sum(calls.values()) == 0
    got = _mlp("triton", x, w1, w2, g)
    assert calls == {"fp8_relu2_up": 1, "fp8_relu2_up_grad": 1}  # the fused path ran, once each way
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "clips", "post_amax", "dpre_amax"), got, want):
        assert torch.equal(a, b), name
    assert want[4][0].sum() > 0 or want[4][1].sum() > 0  # counted operands


def test_compiled_the_fused_path_keeps_its_bits_and_counters():
    # the kernels are opaque ops that write the clip counters and the amaxes in the forward and backward
    # graphs: traced (fake tensors) and run, every output, gradient, counter and amax is the eager run's
    x, w1, w2, g = _exact_mlp_inputs()
    eager = _mlp("triton", x, w1, w2, g)
    compiled = _mlp("triton", x, w1, w2, g, compiled=True)
    torch._dynamo.reset()
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "clips", "post_amax", "dpre_amax"), compiled, eager):
        assert torch.equal(a, b), name


def test_bad_operands_are_one_clear_error_naming_the_fix(monkeypatch):
    xq, w1q, _, gq = _operands()
    s, amax, clips = torch.tensor(1.0), torch.zeros(()), torch.zeros(2, len(SITES), dtype=torch.int64)
    with pytest.raises(ValueError, match="multiples of 16.*fp8.mlp_impl=scaled_mm"):
        fp8_relu2_up(xq[:300], w1q, s, s, s, amax, clips, 0, 464.0)
    with pytest.raises(ValueError, match="A must be torch.float8_e4m3fn"):
        fp8_relu2_up(gq, w1q, s, s, s, amax, clips, 0, 464.0)
    with pytest.raises(ValueError, match="pre must be bf16"):
        fp8_relu2_up_grad(gq, w1q, s, s, torch.zeros(T, 16, dtype=torch.bfloat16), s, amax, clips, 0, 1.0)
    monkeypatch.setattr(kernels, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="fp8_relu2_mlp kernels run on CUDA.*fp8.mlp_impl=scaled_mm"):
        fp8_relu2_up(xq, w1q, s, s, s, amax, clips, 0, 464.0)


def test_the_config_refuses_an_unknown_fp8_mlp_impl():
    with pytest.raises(
        ModelConfigError, match=r"fp8.mlp_impl='fused' must be one of \['scaled_mm', 'triton'\]"
    ):
        ModelConfig(fp8=FP8Config(mlp_impl="fused"))


_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tests.perf.compile_sm90 import spill_bytes
    from track_1_short.model import fp8
    from track_1_short.perf.kernels import fp8_relu2_mlp as k
    from track_1_short.perf.kernels.fp8_quantize import grid_constants

    half = [k.BLOCK_M, k.BLOCK_N // 2]
    for forward in (True, False):
        fmt, ty = (fp8.E4M3, "fp8e4nv") if forward else (fp8.E5M2, "fp8e5")
        sig = {"a_desc": f"tensordesc<{ty}[{k.BLOCK_M}, {k.BLOCK_K}]>",
               "b_desc": f"tensordesc<fp8e4nv[{k.BLOCK_N}, {k.BLOCK_K}]>",
               "pre_desc": f"tensordesc<bf16{half}>", "q_desc": f"tensordesc<{ty}{half}>",
               "qt_desc": f"tensordesc<{ty}{half[::-1]}>"}
        sig.update(dict.fromkeys(("a_scale_ptr", "b_scale_ptr", "q_scale_ptr", "amax_ptr"), "*fp32"))
        sig.update({"clips_ptr": "*i64", **dict.fromkeys(("site", "n_sites", "M", "N", "K"), "i32")})
        consts = {"NUM_PROGRAMS": 132, "BLOCK_M": k.BLOCK_M, "BLOCK_N": k.BLOCK_N, "BLOCK_K": k.BLOCK_K,
                  "FORWARD": forward, **grid_constants(fmt), "CLIP": fp8.CLIP_AT[fmt], "AS_BITS": False}
        src = ASTSource(fn=k._fp8_relu2_gemm_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                        constexprs=consts)
        opts = {"num_warps": k.NUM_WARPS, "num_stages": k.NUM_STAGES, "enable_fp_fusion": False}
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        ttgir = c.asm["ttgir"]
        assert "wgmma" in c.asm["ptx"], ("no Hopper tensor-core instructions", forward)
        loads = ttgir.count("async_tma_copy_global_to_local")
        assert loads >= 2 * k.NUM_STAGES, ("operand loads not pipelined through TMA", forward, loads)
        # each half tile's stores: both FP8 layouts, and the forward's pre
        assert ttgir.count("async_tma_copy_local_to_global") == (6 if forward else 4) * 2, forward
        assert c.metadata.shared <= 232448, ("more shared memory than an H100 block has", forward)
        # the forward's epilogue holds pre, its square and the quantise at once: it spilled 28 bytes when
        # written; a register-hungrier epilogue spills more (its quarters spilled 172)
        assert spill_bytes(c) <= (32 if forward else 0), ("registers spilled", forward, spill_bytes(c))
    print("compiled 2")
    """
)


def test_the_kernels_compile_for_the_h100_with_tma_and_fp8_tensor_core_instructions():
    proc = compile_outside_the_interpreter(_COMPILE_FOR_SM90)
    assert proc.returncode == 0 and "compiled 2" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_the_fused_fp8_mlp_agrees_with_scaled_mm_at_the_record_shapes():
    needs_fp8_gpu()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.nn.functional.rms_norm(torch.randn(8192, 768, device="cuda", generator=g), (768,)).bfloat16()
    w1 = (torch.randn(2816, 768, device="cuda", generator=g) * 768**-0.5).bfloat16()
    w2 = (torch.randn(2816, 768, device="cuda", generator=g) * 0.02).bfloat16()
    grad = (torch.randn(8192, 768, device="cuda", generator=g) * 1e-3).bfloat16()
    runs = {}
    for impl in ("scaled_mm", "triton"):
        st = FP8State(FP8Config(mlp=True, mlp_impl=impl))
        st.refresh(torch.stack((w1, w2))[None], None, None)
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        out = st.mlp_forward(*leaves[:1], 0, *leaves[1:])
        out.backward(grad)
        runs[impl] = [out.detach().float(), *(t.grad.float() for t in leaves)]
    # cuBLAS and the kernel sum the FP8 products in other orders, so a bf16 pre or dpost next to a rounding
    # boundary moves by an ulp and its FP8 code, rarely, by one step of the format (2^-3 relative for e4m3,
    # 2^-2 for e5m2); under 1% of codes moving, the outputs move by under sqrt(0.01) 2^-2 = 0.025 in norm
    for name, a, b in zip(("out", "dx", "dw1", "dw2"), runs["triton"], runs["scaled_mm"]):
        assert ((a - b).norm() / b.norm()).item() < 0.025, name
