"""perf/kernels/relu2_mlp.py and model/mlp.py: the ReLU^2 MLP with its activation in the up-projection GEMM's
epilogue (``model.mlp_impl=triton``) against model/layers.py's reference.

On the CPU the kernel runs in Triton's interpreter at its GPU tile (128 x 256 x 64); the shapes here are not
multiples of it, so tiles end short in every direction. Inputs on a coarse grid make every fp32 sum exact
whatever its order, so both sides hold the same GEMM output and what is compared is everything else.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.call_counts import count_calls
from tests.model.conftest import load_config
from tests.perf.compile_sm90 import compile_outside_the_interpreter
from track_1_short.model.config import ModelConfig, ModelConfigError
from track_1_short.model.layers import relu2_mlp
from track_1_short.model.mlp import fused_relu2_mlp
from track_1_short.perf.kernels import relu2_mlp as kernels
from track_1_short.perf.kernels.relu2_mlp import relu2_up, relu2_up_grad

T, D, H = 300, 136, 520  # 3 row tiles (the last 44 rows), 3 column tiles (the last 8), 3 K steps (the last 8)


def _grid(*shape, step: float, seed: int) -> torch.Tensor:
    """bf16 multiples of ``step`` in [-8 step, 8 step]: products and their sums over D are exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g) * step).bfloat16()


def _exact_case(seed: int = 0):
    return (
        _grid(T, D, step=1 / 8, seed=seed),  # x
        _grid(H, D, step=1 / 16, seed=seed + 1),  # w1
        _grid(H, D, step=1 / 16, seed=seed + 2),  # w2
        _grid(T, D, step=1 / 8, seed=seed + 3),  # the output's gradient
    )


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits); the smallest normal's at zero."""
    e = torch.floor(torch.log2(x.abs().double().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(e - 7)


def _same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def test_forward_gives_the_references_bits_where_the_gemm_is_exact():
    x, w1, _, _ = _exact_case()
    pre, post = relu2_up(x, w1)
    ref_pre = x @ w1.T
    assert torch.equal(pre, ref_pre)
    assert _same_bits_or_both_nan(post, F.relu(ref_pre).square())
    # both branches of the ReLU, and squares that need more than bf16's 8 significant bits (rounded)
    assert (ref_pre < 0).any() and (ref_pre > 0).any()
    assert (F.relu(ref_pre).float().square() != post.float()).any()
    # without pre stored (the evaluation forward), post is the same
    none, post_only = relu2_up(x, w1, store_pre=False)
    assert none is None and torch.equal(post_only, post)


def test_backward_gives_the_references_bits_where_the_gemm_is_exact():
    x, w1, w2, grad = _exact_case(4)
    pre = x @ w1.T
    pre[0, :4] = torch.tensor([0.0, -0.0, float("nan"), 1.0])  # relu's edge, and a NaN that must pass through
    dpost = grad @ w2.T  # exact
    leaf = pre.clone().requires_grad_()
    F.relu(leaf).square().backward(dpost)
    dpre = relu2_up_grad(grad, w2, pre)
    assert _same_bits_or_both_nan(dpre, leaf.grad)
    assert dpre[0, 2].isnan() and (dpre[pre <= 0] == 0).all() and (dpre != 0).float().mean() > 0.3


def test_a_nan_input_row_comes_out_nan_as_the_references():
    x, w1, _, _ = _exact_case(8)
    x[5, 3] = float("nan")
    _, post = relu2_up(x, w1)
    assert _same_bits_or_both_nan(post, F.relu(x @ w1.T).square())
    assert post[5].isnan().all() and not post[[4, 6]].isnan().any()


def test_random_operands_are_within_the_accumulation_bound_of_the_exact_product():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, D, generator=g).bfloat16()
    w1 = (torch.randn(H, D, generator=g) * D**-0.5).bfloat16()
    pre, post = relu2_up(x, w1)
    exact = x.double() @ w1.double().T
    # the fp32 sum of D exact products, in any order, is within gamma_D * sum |x||w| of the exact sum (Higham
    # 3.1); rounding it to bf16 adds half an ulp at the larger of the two magnitudes
    gamma = D * 2.0**-24 / (1 - D * 2.0**-24)
    err = gamma * (x.double().abs() @ w1.double().abs().T)
    assert torch.all((pre.double() - exact).abs() <= 0.5 * _bf16_ulp(exact.abs() + err) + err)
    assert torch.equal(post, F.relu(pre).square())  # the epilogue on the kernel's own pre: exact


def _trained(fn, x, w1, w2, grad) -> list[torch.Tensor]:
    """fn(x, w1, w2) and the gradients of x, w1 and w2 for the output's gradient ``grad``."""
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def test_the_op_trains_as_the_reference_mlp_bit_for_bit_where_the_gemms_are_exact():
    x, w1, w2, grad = _exact_case(12)
    results = [_trained(fn, x, w1, w2, grad) for fn in (relu2_mlp, fused_relu2_mlp)]
    for name, got, want in zip(("out", "x.grad", "w1.grad", "w2.grad"), results[1], results[0]):
        assert torch.equal(got, want), name
    with torch.no_grad():  # the evaluation op, which stores no pre
        assert torch.equal(fused_relu2_mlp(x, w1, w2), results[0][0])
        # a strided view of x (a slice of a wider tensor, as a residual's channels) is the same input
        wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, : x.shape[1]]
        assert not wide.is_contiguous() and torch.equal(fused_relu2_mlp(wide, w1, w2), results[0][0])


def test_the_op_compiles_whole_and_gives_the_eager_bits():
    # AOTAutograd traces the forward and the backward through the ops' fake kernels; the trainer compiles the
    # model with dynamic=False
    torch._dynamo.reset()
    x, w1, w2, grad = _exact_case(16)
    compiled = torch.compile(fused_relu2_mlp, backend="aot_eager", fullgraph=True, dynamic=False)
    results = [_trained(fn, x, w1, w2, grad) for fn in (compiled, fused_relu2_mlp)]
    assert all(torch.equal(a, b) for a, b in zip(*results))
    torch._dynamo.reset()


def test_the_models_switch_runs_each_mlp_through_the_kernels_once_each_way(monkeypatch):
    from track_1_short.model.gpt import GPT

    calls = count_calls(monkeypatch, kernels, ("relu2_up", "relu2_up_grad"))
    g = torch.Generator().manual_seed(0)
    inp, tgt = torch.randint(1, 1024, (256,), generator=g).int(), torch.randint(0, 1024, (256,), generator=g)
    inp[[0, 100]] = 0
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    losses = {}
    for impl in ("reference", "triton"):
        torch.manual_seed(0)
        m = GPT(load_config("tiny", vocab_size=1024, mlp_impl=impl))
        with torch.no_grad():  # c_proj starts at zero; give the down projection something to carry
            m.mlp_bank[:, 1].normal_(0, 0.02)
        calls.update(relu2_up=0, relu2_up_grad=0)
        loss = m(inp, tgt, cu, (1, 2))
        loss.backward()
        losses[impl] = loss.item()
        cfg = m.cfg
        n_mlp = cfg.num_layers - len(cfg.no_mlp_layers) + (cfg.parallel_mlp_layer >= 0)
        want = n_mlp if impl == "triton" else 0
        assert calls == {"relu2_up": want, "relu2_up_grad": want}, impl
    # the two differ only in the GEMMs' summation order (bf16 outputs one ulp apart at most)
    assert abs(losses["triton"] - losses["reference"]) <= 1e-2 * abs(losses["reference"])


def test_bad_operands_are_one_clear_error_naming_the_fix(monkeypatch):
    x, w1, _, _ = _exact_case()
    with pytest.raises(ValueError, match="contiguous 2-D bf16.*mlp_impl=reference"):
        relu2_up(x.float(), w1.float())
    with pytest.raises(ValueError, match="multiple of 8.*mlp_impl=reference"):
        relu2_up(x[:, :12].contiguous(), w1[:, :12].contiguous())
    with pytest.raises(ValueError, match="differ in D"):
        relu2_up(x, w1[:, :128].contiguous())
    with pytest.raises(ValueError, match="do not make grad @ w2.T the shape of pre"):
        relu2_up_grad(x, w1, torch.zeros(T, 8, dtype=torch.bfloat16))
    monkeypatch.setattr(kernels, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="relu2_mlp kernels run on CUDA.*model.mlp_impl=reference"):
        relu2_up(x, w1)


def test_the_config_refuses_an_unknown_impl_and_triton_where_it_cannot_run():
    with pytest.raises(ModelConfigError, match=r"mlp_impl='fused' must be one of \['reference', 'triton'\]"):
        ModelConfig(mlp_impl="fused")
    with pytest.raises(ModelConfigError, match="mlp_impl='triton' runs bf16 GEMMs.*compute_dtype='float32'"):
        ModelConfig(mlp_impl="triton", compute_dtype="float32")
    with pytest.raises(ModelConfigError, match="mlp_hidden=2820"):
        ModelConfig(mlp_impl="triton", mlp_hidden=2820)


_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tests.perf.compile_sm90 import spill_bytes
    from track_1_short.perf.kernels import relu2_mlp as k

    half = [k.BLOCK_M, k.BLOCK_N // 2]
    sig = {"a_desc": f"tensordesc<bf16[{k.BLOCK_M}, {k.BLOCK_K}]>",
           "b_desc": f"tensordesc<bf16[{k.BLOCK_N}, {k.BLOCK_K}]>",
           "pre_desc": f"tensordesc<bf16{half}>", "out_desc": f"tensordesc<bf16{half}>",
           "M": "i32", "N": "i32", "K": "i32"}
    for forward, store_pre, stores in ((True, True, 8), (True, False, 4), (False, False, 4)):
        consts = {"NUM_PROGRAMS": 132, "BLOCK_M": k.BLOCK_M, "BLOCK_N": k.BLOCK_N, "BLOCK_K": k.BLOCK_K,
                  "FORWARD": forward, "STORE_PRE": store_pre, "AS_BITS": False}
        src = ASTSource(fn=k._relu2_gemm_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                        constexprs=consts)
        opts = {"num_warps": k.NUM_WARPS, "num_stages": k.NUM_STAGES, "enable_fp_fusion": False}
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        ttgir = c.asm["ttgir"]
        what = (forward, store_pre)
        assert "wgmma" in c.asm["ptx"], ("no Hopper tensor-core instructions", what)
        # every operand and output tile moves by TMA: the operand loads in NUM_STAGES buffers, each store
        # of a half tile's outputs (its stores are unrolled twice by the two halves)
        loads = ttgir.count("async_tma_copy_global_to_local")
        assert loads >= 2 * k.NUM_STAGES, ("operand loads not pipelined through TMA", what, loads)
        assert ttgir.count("async_tma_copy_local_to_global") == stores, what
        assert spill_bytes(c) == 0, ("registers spilled", what)
        assert c.metadata.shared <= 232448, ("more shared memory than an H100 block has", what)
    print("compiled 3")
    """
)


def test_the_kernel_compiles_for_the_h100_with_tma_and_tensor_core_instructions():
    # the interpreter runs the AS_BITS variant; the GPU's is compiled here with the wheel's own ptxas
    proc = compile_outside_the_interpreter(_COMPILE_FOR_SM90)
    assert proc.returncode == 0 and "compiled 3" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_kernels_at_the_record_shapes_match_the_reference():
    g = torch.Generator(device="cuda").manual_seed(17)
    x = torch.randn(65536 + 77, 768, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(2816, 768, device="cuda", generator=g) * 768**-0.5).bfloat16()
    w2 = (torch.randn(2816, 768, device="cuda", generator=g) * 0.02).bfloat16()
    grad = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    pre, post = relu2_up(x, w1)
    ref_pre = x @ w1.T
    # cuBLAS and the kernel sum in other orders: a bf16 output next to a rounding boundary moves by one ulp
    assert torch.all((pre.float() - ref_pre.float()).abs() <= _bf16_ulp(ref_pre).float())
    assert (pre != ref_pre).float().mean() < 0.01
    assert torch.equal(post, F.relu(pre).square())  # the epilogue on the kernel's own pre: exact
    grads = []
    for fn in (relu2_mlp, fused_relu2_mlp):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        fn(*leaves).backward(grad)
        grads.append([t.grad.float() for t in leaves])
    # one-ulp differences of pre and dpost, carried through one GEMM each: bf16's 2^-9 relative, in norm
    for a, b in zip(*grads):
        assert ((a - b).norm() / b.norm()).item() < 4e-3
