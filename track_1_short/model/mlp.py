"""The ReLU^2 MLP as one custom op each way, on the fused up-projection kernels (``model.mlp_impl=triton``).

layers.relu2_mlp is the reference (``model.mlp_impl=reference``), whose pointwise activation and its gradient
Inductor runs as kernels of their own. Here the forward is perf/kernels/relu2_mlp.py's GEMM with relu^2 in its
epilogue, then ``post @ W2``; the backward is that kernel's gradient form (g @ W2, times 2 relu(pre), in the
epilogue), then the three weight and input GEMMs the reference's autograd runs, in the same form. Being custom
ops, the compiler neither recomputes nor splits them.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("track_1_short::relu2_mlp", mutates_args=())
def _mlp_op(x: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # (out, pre, post): pre and post are outputs so that the backward can keep them
    from track_1_short.perf.kernels.relu2_mlp import relu2_up  # its interpreter choice is fixed at import

    pre, post = relu2_up(x, w1)
    return post @ w2, pre, post


@_mlp_op.register_fake
def _mlp_fake(x, w1, w2):
    hidden = x.new_empty((x.shape[0], w1.shape[0]))
    return x.new_empty((x.shape[0], w2.shape[1])), hidden, torch.empty_like(hidden)


@torch.library.custom_op("track_1_short::relu2_mlp_eval", mutates_args=())
def _mlp_eval_op(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    # no gradient wanted: pre is never stored
    from track_1_short.perf.kernels.relu2_mlp import relu2_up

    return relu2_up(x, w1, store_pre=False)[1] @ w2


@_mlp_eval_op.register_fake
def _mlp_eval_fake(x, w1, w2):
    return x.new_empty((x.shape[0], w2.shape[1]))


@torch.library.custom_op("track_1_short::relu2_mlp_grad", mutates_args=())
def _mlp_grad_op(grad: Tensor, w2: Tensor, pre: Tensor) -> Tensor:
    from track_1_short.perf.kernels.relu2_mlp import relu2_up_grad

    return relu2_up_grad(grad, w2, pre)


@_mlp_grad_op.register_fake
def _mlp_grad_fake(grad, w2, pre):
    return torch.empty_like(pre)


def _setup(ctx, inputs, output) -> None:
    _, pre, post = output
    ctx.save_for_backward(*inputs, pre, post)


def _backward(ctx, grad, _grad_pre, _grad_post):
    x, w1, w2, pre, post = ctx.saved_tensors
    dpre = _mlp_grad_op(grad.contiguous(), w2, pre)
    # the GEMMs autograd runs for the reference's ``x @ w1.T`` and ``post @ w2``, in their form
    return dpre @ w1, (x.t() @ dpre).t(), post.t() @ grad


_mlp_op.register_autograd(_backward, setup_context=_setup)


def fused_relu2_mlp(x: Tensor, c_fc: Tensor, c_proj: Tensor) -> Tensor:
    """layers.relu2_mlp on the fused kernels: relu(x @ c_fc.T)^2 @ c_proj for x [T, D] bf16 and c_fc, c_proj
    [hidden, D] (cast to x's dtype, as the reference casts them). CUDA, or a CPU under TRITON_INTERPRET=1."""
    # TMA reads dense rows: a strided view is copied once here (a no-op for the model's tensors)
    x, w1, w2 = x.contiguous(), c_fc.type_as(x).contiguous(), c_proj.type_as(x).contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w2.requires_grad):
        return _mlp_op(x, w1, w2)[0]
    return _mlp_eval_op(x, w1, w2)
