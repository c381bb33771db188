"""The ReLU² MLP with its elementwise work in the GEMM epilogues: ``model.mlp_impl=fused``.

What it replaces (``model.mlp_impl=reference``, model/layers.py ``relu2_mlp``): out = relu(x W1ᵀ)² W2 as
torch ops, where Inductor runs the square (forward) and the square-and-ReLU backward as separate elementwise
kernels between cuBLAS GEMMs. At the record's stage 2 (an H100, perf/RESULTS.md) those two kernels take about
40 ms of a 632 ms step at the memory-bandwidth floor: the forward reads the GEMM's [T, hidden] output and
writes its square, the backward reads the incoming gradient and the saved activation and writes another
[T, hidden] tensor.

Why it is faster: one persistent Triton GEMM kernel computes acc = a bᵀ and applies the elementwise step to
the accumulator tile before its only store.
- Forward (a = x, b = W1): it stores post = relu(bf16(acc))² and nothing else; post is what the down
  projection reads and what the backward saves. No [T, hidden] tensor is read back.
- Backward (a = dout, b = W2): it loads the saved post tile and stores d_pre = 2 bf16(acc) sqrt(post), since
  relu(pre) = sqrt(post); the gradient of post is never written.
The other four GEMMs (post W2, and the weight and input gradients) stay torch's.

Invariants (tests/perf/test_relu2_mlp.py):
1. Forward: post is the reference's bits for the same bf16 GEMM output: both round acc to bf16 once, then
   square in fp32 and round once more (Inductor's square of a bf16 tensor).
2. Backward: d_pre differs from the reference's bf16(2 g relu(pre)) only through sqrt(post) in place of
   relu(pre): post = relu(pre)² (1 + e) with |e| <= 2^-9, so sqrt(post) is within 2^-9 relative of relu(pre)
   and d_pre within one bf16 ulp (plus the GEMM's own summation order on a GPU).
3. Rows, columns and the reduction need not be multiples of the tiles (masked loads and stores).

Provenance: upstream's record ("Triton kernel for MLP: relu(x @ W1.T)^2", the persistent linear_relu_square
kernel that stores only post and rebuilds relu(pre) as its square root in the backward); written here for
this project's [hidden, D] bank layout, with pointer loads so that the interpreter runs it on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from track_1_short.perf.kernels.bf16_bits import load_bf16, round_to_bf16_bits, widen_bf16
from track_1_short.perf.kernels.interpreter import check_device as _check_device
from track_1_short.perf.kernels.interpreter import multiprocessors, runs_interpreted

# The H100/H200 tile the sm_90 compile test checks: 128 x 256 outputs, 64-deep slices of the reduction
# (D = 768: 12 of them), 8 warps, 3 stages of 48 KB of operands in shared memory (upstream's choice).
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
NUM_WARPS, NUM_STAGES = 8, 3
# On CUDA the first call of each (M, N, K, pass) times these and keeps the fastest (a configuration that does
# not fit the GPU's shared memory is skipped); the first is the one above.
GPU_CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
]
# Under the interpreter (numpy), where each program costs Python overhead: 64 x 64 x 64 tiles (tests pass
# smaller ones to cross tile edges in every direction).
BLOCK_INTERPRETER = 64


@triton.jit
def _linear_relu2_kernel(
    a_ptr,  # [M, K] bf16 (x forward, dout backward); int16 bits when BITS
    b_ptr,  # [N, K] bf16 (W1 forward, W2 backward): acc = a @ b.T; int16 bits when BITS
    out_ptr,  # [M, N] int16 bits of bf16: post (forward) or d_pre (backward)
    post_ptr,  # [M, N] int16 bits of the saved post (backward only; unused forward)
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    FORWARD: tl.constexpr,
    BITS: tl.constexpr,  # the interpreter: operands as int16 bits, widened to fp32 exactly (no numpy bf16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    rm_base = tl.arange(0, BLOCK_M)
    rn_base = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Persistent: programs stride over the tiles in row-major order, so the programs running at one time
    # share a few row blocks of a, and b (a bank matrix, 4 MB) stays in L2.
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        rm = (tile // tiles_n) * BLOCK_M + rm_base
        rn = (tile % tiles_n) * BLOCK_N + rn_base
        m_ok = rm < M
        n_ok = rn < N
        a_rows = a_ptr + tl.cast(rm, tl.int64)[:, None] * stride_am  # M x K passes 2^31 at the record
        b_rows = b_ptr + rn[:, None] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            a = load_bf16(a_rows + (k0 + rk)[None, :], m_ok[:, None] & k_ok[None, :], BITS)
            b = load_bf16(b_rows + (k0 + rk)[None, :], n_ok[:, None] & k_ok[None, :], BITS)
            acc = tl.dot(a, tl.trans(b), acc)
        # The GEMM's bf16 output, as the reference's matmul rounds it (to nearest even, in integer arithmetic:
        # the interpreter's own conversion truncates), then the epilogue in fp32, rounded once.
        g = widen_bf16(round_to_bf16_bits(acc))
        offs = tl.cast(rm, tl.int64)[:, None] * stride_om + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if FORWARD:
            r = tl.maximum(g, 0.0)
            tl.store(out_ptr + offs, round_to_bf16_bits(r * r), mask=mask)
        else:
            post = widen_bf16(tl.load(post_ptr + offs, mask=mask, other=0))
            tl.store(out_ptr + offs, round_to_bf16_bits(2.0 * g * tl.sqrt_rn(post)), mask=mask)


def autotuned(configs: list[triton.Config]):
    """The kernel behind an autotuner over ``configs`` (tiles, warps, stages), keyed on the GEMM's shape and
    pass."""
    return triton.autotune(configs=configs, key=["M", "N", "K", "FORWARD"])(_linear_relu2_kernel)


_linear_relu2_tuned = autotuned(
    [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
        for m, n, k, w, st in GPU_CONFIGS
    ]
)


# Once, at import (runs_interpreted says why).
_INTERPRETED = runs_interpreted(_linear_relu2_kernel)


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 when this module was loaded)."""
    return _INTERPRETED


def check_device(device: torch.device | str, what: str = "model.mlp_impl=fused") -> None:
    """Raise a RuntimeError naming ``what`` unless the kernel can run on ``device`` (CUDA, or any device under
    Triton's interpreter)."""
    _check_device(device, what, interpreted(), "relu2_mlp", "model.mlp_impl=reference")


def _programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":
        return tiles  # the interpreter runs programs one after another: one tile each
    return min(tiles, multiprocessors(device))


def linear_relu2(
    a: torch.Tensor,
    b: torch.Tensor,
    post: torch.Tensor | None = None,
    *,
    block: int | None = None,
    tuned: bool | None = None,
) -> torch.Tensor:
    """relu(a bᵀ)² (``post`` None: the forward) or 2 (a bᵀ) sqrt(post) (the backward's d_pre), bf16 [M, N].

    a [M, K] and b [N, K] bf16 with contiguous rows; post bf16 [M, N], contiguous (what the forward returned).
    block: one square tile size for all three dimensions (a power of two, at least 16) instead of the
    defaults (BLOCK_M x BLOCK_N x BLOCK_K on CUDA, BLOCK_INTERPRETER elsewhere). tuned: launch through the
    autotuner over GPU_CONFIGS (default: on CUDA when no block is given).
    """
    if block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(
            f"linear_relu2: block={block} must be a power of two, at least 16 (tl.dot's minimum)"
        )
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(
            f"linear_relu2: a and b must be bf16 with contiguous rows, got {a.dtype} {tuple(a.stride())} and "
            f"{b.dtype} {tuple(b.stride())}"
        )
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"linear_relu2: a is [{m}, {k}] and b [{n}, {k_b}]; their last dims must agree")
    if post is not None and (
        post.shape != (m, n) or post.dtype != torch.bfloat16 or not post.is_contiguous()
    ):
        raise ValueError(f"linear_relu2: post must be a contiguous bf16 [{m}, {n}], got {tuple(post.shape)}")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    on_gpu = a.device.type == "cuda"
    if m == 0 or n == 0:
        return out
    bits = interpreted()
    out_bits = out.view(torch.int16)
    if tuned if tuned is not None else on_gpu and block is None:
        kernel, launch = _linear_relu2_tuned, {}  # the tile comes from the autotuner
    else:
        size = block or BLOCK_INTERPRETER
        kernel, launch = _linear_relu2_kernel, {"BLOCK_M": size, "BLOCK_N": size, "BLOCK_K": size}

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
        return (_programs(a.device, tiles),)

    kernel[grid](
        a.view(torch.int16) if bits else a,
        b.view(torch.int16) if bits else b,
        out_bits,
        out_bits if post is None else post.view(torch.int16),  # never read forward
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        FORWARD=post is None,
        BITS=bits,
        **launch,
    )
    return out


@torch.library.custom_op("track_1_short::relu2_mlp", mutates_args=())
def _relu2_mlp_fused(
    x: torch.Tensor, c_fc: torch.Tensor, c_proj: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, post): post = relu(x c_fcᵀ)² from the epilogue kernel, out = post c_proj (torch's GEMM)."""
    post = linear_relu2(x, c_fc)
    return post @ c_proj, post


@_relu2_mlp_fused.register_fake
def _relu2_mlp_fused_fake(x, c_fc, c_proj):
    post = x.new_empty((x.size(0), c_fc.size(0)))
    return x.new_empty((x.size(0), c_proj.size(1))), post


def _setup(ctx, inputs, output) -> None:
    x, c_fc, c_proj = inputs
    ctx.save_for_backward(x, c_fc, c_proj, output[1])
    ctx.mark_non_differentiable(output[1])


@torch.library.custom_op("track_1_short::relu2_mlp_d_pre", mutates_args=())
def _d_pre(dout: torch.Tensor, c_proj: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """The backward's epilogue GEMM, an op of its own: AOTAutograd traces the backward below with fake
    tensors, which a Triton launch cannot take."""
    return linear_relu2(dout, c_proj, post)


@_d_pre.register_fake
def _d_pre_fake(dout, c_proj, post):
    return torch.empty_like(post)


def _backward(ctx, dout, _dpost):
    x, c_fc, c_proj, post = ctx.saved_tensors
    dout = dout.contiguous()
    d_pre = _d_pre(dout, c_proj, post)  # [T, hidden]: 2 (dout c_projᵀ) relu(pre)
    return d_pre @ c_fc, d_pre.T @ x, post.T @ dout


_relu2_mlp_fused.register_autograd(_backward, setup_context=_setup)


def relu2_mlp_fused(x: torch.Tensor, c_fc: torch.Tensor, c_proj: torch.Tensor) -> torch.Tensor:
    """relu(x c_fcᵀ)² c_proj (x [T, D] bf16; c_fc, c_proj [hidden, D] bf16) with the epilogue kernel on both
    passes; the contract of model/layers.py ``relu2_mlp``."""
    out, _post = _relu2_mlp_fused(x.contiguous(), c_fc.contiguous(), c_proj.contiguous())
    return out
