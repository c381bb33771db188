"""The ReLU² MLP with its square in the GEMM epilogues (perf/kernels/relu2_mlp.py) against model/layers'
reference, ``model.mlp_impl``.

On the CPU the kernel runs in Triton's interpreter; the kernel-level tests ask for 16 x 16 x 16 tiles, and
their shapes are not multiples of them, so tiles meet in every direction and every edge is masked.
Integer-valued inputs make every fp32 sum exact whatever its order, so the GEMM output is the same on both
sides and what is left to compare is the epilogue itself.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.perf.compile_sm90 import compile_outside_the_interpreter
from track_1_short.model.config import ModelConfig, ModelConfigError
from track_1_short.model.layers import relu2_mlp
from track_1_short.perf.kernels import relu2_mlp as kernel_module
from track_1_short.perf.kernels.relu2_mlp import linear_relu2, relu2_mlp_fused

gpu = pytest.mark.gpu


def _ints(*shape, high, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high + 1, shape, generator=g).to(torch.bfloat16)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits), the smallest normal's for zero."""
    e = torch.floor(torch.log2(x.abs().float().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(e - 7)


def _reference_post(x, w1):
    return F.relu(x @ w1.T).square()


def test_forward_stores_the_references_bits_of_relu_squared():
    # Integer inputs, |pre| <= 21 * 3 * 3: exact fp32 sums and exact bf16 GEMM outputs on both sides; the
    # squares (up to 189^2) need more than bf16's 8 significant bits, so both round them, to nearest even.
    x, w1 = _ints(37, 21, high=3, seed=0), _ints(45, 21, high=3, seed=1)
    post = linear_relu2(x, w1, block=16)
    ref = _reference_post(x, w1)
    assert torch.equal(post, ref)
    assert (ref == 0).any() and (ref > 256).any()  # both ReLU branches and rounded squares were exercised


def test_forward_on_random_data_matches_up_to_the_gemms_summation_order():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(53, 40, generator=g).bfloat16()
    w1 = (torch.randn(70, 40, generator=g) * 0.3).bfloat16()
    post = linear_relu2(x, w1, block=16)
    # Against the GEMM accumulated in fp32 and rounded once (what the kernel computes; torch's CPU bf16
    # matmul is further off where terms cancel). The fp32 sums differ only in order, which can move the bf16
    # GEMM output by one ulp where it lies next to a rounding boundary; the square then moves by about two
    # ulps of itself.
    ref = F.relu((x.float() @ w1.float().T).bfloat16()).square()
    assert torch.all((post.float() - ref.float()).abs() <= 2 * _bf16_ulp(ref))
    assert (post != ref).float().mean() < 0.01


def test_backward_d_pre_is_within_one_bf16_ulp_of_two_g_relu_pre():
    x, w1 = _ints(37, 21, high=3, seed=3), _ints(45, 21, high=3, seed=4)
    dout, w2 = _ints(37, 21, high=2, seed=5), _ints(45, 21, high=2, seed=6)
    post = linear_relu2(x, w1, block=16)
    d_pre = linear_relu2(dout, w2, post, block=16)
    pre = (x @ w1.T).float()
    g = (dout @ w2.T).float()  # exact: integer sums
    ref = (2 * g * F.relu(pre)).bfloat16()
    # sqrt(post) stands in for relu(pre): post = relu(pre)^2 (1 + e), |e| <= 2^-9, so sqrt(post) is within
    # 2^-10 relative of relu(pre), and the one rounding of 2 g sqrt(post) lands within one ulp of ref's.
    diff = (d_pre.float() - ref.float()).abs()
    assert torch.all(diff <= _bf16_ulp(ref)), diff.max()
    assert torch.equal(d_pre[pre <= 0], torch.zeros_like(d_pre[pre <= 0]))  # ReLU's zero branch exactly
    assert (diff > 0).any()  # the square root's rounding shows: the bound is the claim, not equality


def test_the_op_matches_the_reference_mlp_forward_and_backward():
    x, w1, w2 = _ints(37, 21, high=3, seed=7), _ints(45, 21, high=3, seed=8), _ints(45, 21, high=2, seed=9)
    dout = _ints(37, 21, high=2, seed=10)
    grads = []
    for fn in (relu2_mlp, relu2_mlp_fused):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        out = fn(*leaves)
        out.backward(dout)
        grads.append((out.detach(), *(t.grad for t in leaves)))
    (out_r, gx_r, g1_r, g2_r), (out_f, gx_f, g1_f, g2_f) = grads
    assert torch.equal(out_f, out_r)  # the same post, then the same torch GEMM
    assert torch.equal(g2_f, g2_r)  # post^T dout: the same operands
    # d_pre within one bf16 ulp elementwise (above); carried through one GEMM each, the relative norm error
    # stays near bf16's 2^-9.
    for a, b in ((gx_f, gx_r), (g1_f, g1_r)):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 4e-3


def test_the_switch_selects_the_kernel_and_the_reference_stays_torch(monkeypatch):
    calls = []
    kernel = kernel_module.linear_relu2
    monkeypatch.setattr(kernel_module, "linear_relu2", lambda *a: calls.append(len(a)) or kernel(*a))
    x, w1, w2 = _ints(20, 16, high=2, seed=11), _ints(24, 16, high=2, seed=12), _ints(24, 16, high=2, seed=13)
    xx = x.clone().requires_grad_()
    relu2_mlp(xx, w1, w2, "fused").sum().backward()
    assert calls == [2, 3]  # the forward epilogue, then the backward's
    relu2_mlp(x, w1, w2, "reference")
    assert calls == [2, 3]


def test_the_op_compiles_whole_forward_and_backward_and_gives_the_eager_bits():
    # AOTAutograd traces the op's backward with fake tensors: the kernel launch there must be an op of its own
    # (a plain launch fails on fake tensors; the trainer compiles the model).
    torch._dynamo.reset()
    x, w1, w2 = _ints(24, 16, high=3, seed=14), _ints(40, 16, high=3, seed=15), _ints(40, 16, high=2, seed=16)
    dout = _ints(24, 16, high=2, seed=17)
    compiled = torch.compile(relu2_mlp_fused, backend="aot_eager", fullgraph=True, dynamic=False)
    results = []
    for fn in (compiled, relu2_mlp_fused):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        out = fn(*leaves)
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in leaves)])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    torch._dynamo.reset()


def test_the_autotuned_launch_takes_its_tile_from_the_chosen_config(monkeypatch):
    # On CUDA the launch goes through the autotuner, whose configs set the tile and the grid: with one
    # config the autotuner runs it without timing, so its launch path runs here under the interpreter.
    import triton

    one = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16})
    monkeypatch.setattr(kernel_module, "_linear_relu2_tuned", kernel_module.autotuned([one]))
    x, w1 = _ints(37, 21, high=3, seed=18), _ints(45, 21, high=3, seed=19)
    post = linear_relu2(x, w1, tuned=True)
    assert torch.equal(post, _reference_post(x, w1))
    dout, w2 = _ints(37, 21, high=2, seed=20), _ints(45, 21, high=2, seed=21)
    assert torch.equal(linear_relu2(dout, w2, post, tuned=True), linear_relu2(dout, w2, post, block=16))


def test_bad_operands_are_one_clear_error():
    x, w = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(6, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be bf16 with contiguous rows"):
        linear_relu2(x.float(), w)
    with pytest.raises(ValueError, match="last dims must agree"):
        linear_relu2(x, torch.zeros(6, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"post must be a contiguous bf16 \[4, 6\]"):
        linear_relu2(x, w, torch.zeros(6, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="block=24 must be a power of two"):
        linear_relu2(x, w, block=24)


def test_config_refuses_an_unknown_impl_and_fused_outside_bf16():
    with pytest.raises(ModelConfigError, match=r"mlp_impl='triton' must be one of \['reference', 'fused'\]"):
        ModelConfig(mlp_impl="triton")
    with pytest.raises(ModelConfigError, match="mlp_impl='fused' runs in bf16"):
        ModelConfig(mlp_impl="fused", compute_dtype="float32")


def test_fused_on_a_cpu_without_the_interpreter_is_refused_at_build(monkeypatch):
    from track_1_short.model.gpt import GPT

    monkeypatch.setattr(kernel_module, "interpreted", lambda: False)
    # The record's config: the check comes before any parameter is allocated.
    with pytest.raises(RuntimeError, match="model.mlp_impl=fused: the relu2_mlp kernels run on CUDA"):
        GPT(ModelConfig(mlp_impl="fused"), device="cpu")


_COMPILE_FOR_H200 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tests.perf.compile_sm90 import assert_pipelined, spill_bytes
    from track_1_short.perf.kernels import relu2_mlp as k

    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*i16", "post_ptr": "*i16", "M": "i32", "N": "i32",
           "K": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_om": "i32"}
    assert k.GPU_CONFIGS[0] == (k.BLOCK_M, k.BLOCK_N, k.BLOCK_K, k.NUM_WARPS, k.NUM_STAGES)
    # What a launch specializes on with the model's tensors: aligned pointers, and K (768) and the strides
    # (768 or 2816) multiples of 16. Without K's, the masked loads along it would not be pipelined.
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6, 7, 8, 9)}
    fits = []
    for bm, bn, bk, warps, stages in k.GPU_CONFIGS:
        for forward in (True, False):
            consts = {"FORWARD": forward, "BITS": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
            full_sig = {**sig, **dict.fromkeys(consts, "constexpr")}
            src = ASTSource(fn=k._linear_relu2_kernel, signature=full_sig, constexprs=consts, attrs=aligned)
            opts = {"num_warps": warps, "num_stages": stages}
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            assert "wgmma" in compiled.asm["ptx"], ("no Hopper tensor-core instructions", bm, bn, bk)
            assert_pipelined(compiled, stages, bm, bn, bk, forward)
            # The accumulator and the epilogue fit in registers: rounding with the GPU's own bf16 conversion
            # instead of the integer arithmetic here once spilled 476 bytes in the 128 x 256 backward tile.
            assert spill_bytes(compiled) == 0, ("registers spilled", bm, bn, bk, forward)
            fits.append(compiled.metadata.shared <= 232448)  # an H100/H200 block's shared memory at most
    assert fits[0] and fits[1], "the default tile does not fit in shared memory"
    print(f"compiled {len(fits)} variants, {sum(fits)} fit")
    """
)


def test_the_kernel_compiles_for_the_h200_with_hopper_tensor_core_instructions():
    # The interpreter runs the BITS variant; the GPU's (bf16 operands straight into tl.dot) is compiled here
    # to an sm_90 cubin with the wheel's own ptxas for every autotuned tile, and its PTX must use wgmma.
    proc = compile_outside_the_interpreter(_COMPILE_FOR_H200)
    assert proc.returncode == 0 and "compiled 10 variants" in proc.stdout, proc.stderr[-3000:]


@gpu
def test_gpu_fused_mlp_at_the_record_shapes_matches_the_reference():
    g = torch.Generator(device="cuda").manual_seed(17)
    x = torch.randn(65536 + 77, 768, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(2816, 768, device="cuda", generator=g) * 768**-0.5).bfloat16()
    w2 = (torch.randn(2816, 768, device="cuda", generator=g) * 0.02).bfloat16()
    dout = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    post, ref = linear_relu2(x, w1), _reference_post(x, w1)
    # cuBLAS and the kernel sum in other orders: the GEMM output may move by one bf16 ulp, its square by two.
    assert torch.all((post.float() - ref.float()).abs() <= 2 * _bf16_ulp(ref) + 1e-30)
    grads = []
    for fn in (relu2_mlp, relu2_mlp_fused):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        fn(*leaves).backward(dout)
        grads.append([t.grad.float() for t in leaves])
    for a, b in zip(*grads):
        assert ((a - b).norm() / b.norm()).item() < 4e-3
